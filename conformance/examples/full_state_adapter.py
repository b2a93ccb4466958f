"""The adapter that lets the conformance suite drive ``full_state_backend``.

Run the suite against it with::

    python -m conformance --impl conformance.examples.full_state_adapter

The backend has full state dicts only, so the adapter declares the modes
that need nothing else (``full``, ``full_cpu``, ``bcast``, ``file``); the
suite reports every case of the other modes ``n/a``. The backend has no
options type of its own (keyword arguments only), so it cannot be handed
contradictory options: the adapter does not declare ``options_type``
(OPT-ATOM-3 does not apply). It translates torch's options into the
backend's arguments:

==========================================  ===========================================
torch's options                             the backend's call
==========================================  ===========================================
``full_state_dict``                         ``gather_*(device=<rank's device>)``
``full_state_dict`` + ``cpu_offload``       ``gather_*(device="cpu", rank0_only=True)``
``full_state_dict`` (set)                   ``load_*(from_rank0=False)``
``full_state_dict`` + ``broadcast_from_rank0``  ``load_*(from_rank0=True)``
``ignore_frozen_params``, ``strict``        ``skip_frozen``, ``strict``
==========================================  ===========================================

What the backend cannot do (a sharded or flat state dict, several
optimizers, contradictory options) the adapter refuses before calling it
(``not_supported``): those cases are ``n/a``, never passed. Every call into
the backend runs in ``iut_call()``, so that only the backend's own errors
count where a clause expects one.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch

from conformance.adapters import OPTION_CAPABILITIES, Adapter, iut_call, not_supported, rank_device

from . import full_state_backend as backend

# What torch's set_model_state_dict returns: a named pair of key lists.
IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


@dataclass(frozen=True)
class Options:
    """Torch's ``StateDictOptions`` fields, as the suite asked for them."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False


def _supported(opts: Options | None, call: str) -> Options:
    opts = opts or Options()
    if not opts.full_state_dict:
        raise not_supported(f"{call} without full_state_dict (full_state_backend has full state dicts only)")
    if opts.flatten_optimizer_state_dict:
        raise not_supported(
            f"{call} with flatten_optimizer_state_dict (full_state_backend has no flat optimizer layout)"
        )
    return opts


def _one(optimizers) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise not_supported(f"several optimizers (full_state_backend takes one; the case passed {len(optimizers)})")
    return optimizers[0]


def _where(model, opts: Options) -> dict:
    if opts.cpu_offload:
        return {"device": "cpu", "rank0_only": True}
    return {"device": rank_device(model), "rank0_only": False}


def get_model_state_dict(model, *, options=None):
    opts = _supported(options, "get_model_state_dict")
    with iut_call():
        return backend.gather_model(model, skip_frozen=opts.ignore_frozen_params, **_where(model, opts))


def set_model_state_dict(model, model_state_dict, *, options=None):
    opts = _supported(options, "set_model_state_dict")
    with iut_call():
        result = backend.load_model(model, model_state_dict, from_rank0=opts.broadcast_from_rank0, strict=opts.strict)
    return IncompatibleKeys(result.missing, result.unexpected)


def get_optimizer_state_dict(model, optimizers, *, options=None):
    opts = _supported(options, "get_optimizer_state_dict")
    optimizer = _one(optimizers)
    with iut_call():
        return backend.gather_optimizer(model, optimizer, **_where(model, opts))


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    opts = _supported(options, "set_optimizer_state_dict")
    optimizer = _one(optimizers)
    with iut_call():
        backend.load_optimizer(
            model, optimizer, optim_state_dict, from_rank0=opts.broadcast_from_rank0, strict=opts.strict
        )


conformance_adapter = Adapter(
    name="full-state-example",
    version="1.0",
    get_model_state_dict=get_model_state_dict,
    set_model_state_dict=set_model_state_dict,
    get_optimizer_state_dict=get_optimizer_state_dict,
    set_optimizer_state_dict=set_optimizer_state_dict,
    options=Options,
    profiles=frozenset({"inplace"}),
    modes=frozenset({"full", "full_cpu", "bcast", "file"}),
    supported_options=frozenset(OPTION_CAPABILITIES) - {"options_type"},
)
