"""The adapter that lets the conformance suite drive ``vendor_backend``.

Run the suite against it with::

    python -m conformance --impl conformance.examples.vendor_adapter

The suite calls torch's signatures; this module translates each call. It is
all an adapter has to do: rename functions, build the backend's options from
torch's field names, mark each call into the backend (``iut_call()``: only
errors raised inside it count where a clause expects one), and refuse what
the backend does not support before calling it (here: more than one
optimizer, so the optional ``multi-optimizer`` profile is not claimed, and a
case that passes several optimizers is ``n/a`` naming why).
"""

from __future__ import annotations

import torch

from conformance.adapters import Adapter, iut_call, not_supported

from . import vendor_backend as backend


def options(
    full_state_dict=False,
    cpu_offload=False,
    ignore_frozen_params=False,
    strict=True,
    broadcast_from_rank0=False,
    flatten_optimizer_state_dict=False,
    **_ignored,
):
    return backend.CheckpointConfig(
        gather=full_state_dict,
        to_host=cpu_offload,
        skip_frozen=ignore_frozen_params,
        strict=strict,
        from_rank0=broadcast_from_rank0,
        flat_keys=flatten_optimizer_state_dict,
    )


def _one(optimizers) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise not_supported(f"several optimizers (vendor_backend takes one; the case passed {len(optimizers)})")
    return optimizers[0]


def get_model_state_dict(model, *, options=None):
    with iut_call():
        return backend.get_model_state_dict(model, options)


def set_model_state_dict(model, model_state_dict, *, options=None):
    with iut_call():
        return backend.set_model_state_dict(model, model_state_dict, options)


def get_optimizer_state_dict(model, optimizers, *, options=None):
    optimizer = _one(optimizers)
    with iut_call():
        return backend.get_optim_state_dict(model, optimizer, options)


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    optimizer = _one(optimizers)
    with iut_call():
        backend.set_optim_state_dict(model, optimizer, optim_state_dict, options)


conformance_adapter = Adapter(
    name="vendor-example",
    version="1.0",
    get_model_state_dict=get_model_state_dict,
    set_model_state_dict=set_model_state_dict,
    get_optimizer_state_dict=get_optimizer_state_dict,
    set_optimizer_state_dict=set_optimizer_state_dict,
    options=options,
    profiles=frozenset({"inplace"}),
)
