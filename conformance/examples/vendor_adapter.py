"""The adapter that lets the conformance suite drive ``vendor_backend``.

Run the suite against it with::

    python -m conformance --impl conformance.examples.vendor_adapter

The suite calls torch's signatures; this module translates each call. It is
all an adapter has to do: rename functions, build the backend's options from
torch's field names, and say what the backend does not support (here: more
than one optimizer, so the optional ``multi-optimizer`` profile is not
claimed, and a case that passes several optimizers fails on the spot with a
clear error).
"""

from __future__ import annotations

import torch

from conformance.adapters import Adapter

from . import vendor_backend as backend


def options(full_state_dict=False, cpu_offload=False, ignore_frozen_params=False, strict=True,
            broadcast_from_rank0=False, flatten_optimizer_state_dict=False, **_ignored):
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
        raise NotImplementedError(f"vendor_backend takes one optimizer; the case passed {len(optimizers)}")
    return optimizers[0]


def get_model_state_dict(model, *, options=None):
    return backend.get_model_state_dict(model, options)


def set_model_state_dict(model, model_state_dict, *, options=None):
    return backend.set_model_state_dict(model, model_state_dict, options)


def get_optimizer_state_dict(model, optimizers, *, options=None):
    return backend.get_optim_state_dict(model, _one(optimizers), options)


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    backend.set_optim_state_dict(model, _one(optimizers), optim_state_dict, options)


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
