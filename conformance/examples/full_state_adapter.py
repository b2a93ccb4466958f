"""The adapter that lets the conformance suite drive ``full_state_backend``.

Run the suite against it with::

    python -m conformance --impl conformance.examples.full_state_adapter

The backend has full state dicts only, so the adapter declares the modes
that need nothing else (``full``, ``full_cpu``, ``bcast``, ``file``); the
suite reports every case of the other modes ``n/a``. It translates torch's
options into the backend's arguments:

==========================================  ===========================================
torch's options                             the backend's call
==========================================  ===========================================
``full_state_dict``                         ``gather_*(device=<rank's device>)``
``full_state_dict`` + ``cpu_offload``       ``gather_*(device="cpu", rank0_only=True)``
``full_state_dict`` (set)                   ``load_*(from_rank0=False)``
``full_state_dict`` + ``broadcast_from_rank0``  ``load_*(from_rank0=True)``
``ignore_frozen_params``, ``strict``        ``skip_frozen``, ``strict``
==========================================  ===========================================

A contradiction (``broadcast_from_rank0`` without ``full_state_dict``) is a
``ValueError``, as in torch; what the backend cannot do (a sharded or flat
state dict, several optimizers) is a ``NotImplementedError`` naming it.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from conformance.adapters import Adapter

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


def rank_device(model) -> torch.device:
    """The device this rank computes ``model`` on: where its parameters live.

    The suite's ranks compute on the CPU, or with ``--device TYPE`` each on
    its own accelerator (``RankContext.device``: ``TYPE:local_rank``, made
    current in the rank's process); sharded models have their local shards
    there. A model still on the meta device has no device yet: the CPU.
    """
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")


def _supported(opts: Options | None, call: str) -> Options:
    opts = opts or Options()
    if opts.broadcast_from_rank0 and not opts.full_state_dict:
        raise ValueError(f"{call}: broadcast_from_rank0=True needs full_state_dict=True")
    if not opts.full_state_dict:
        raise NotImplementedError(f"{call}: full_state_backend has full state dicts only (full_state_dict=False asks for a sharded one)")
    if opts.flatten_optimizer_state_dict:
        raise NotImplementedError(f"{call}: full_state_backend has no flat optimizer layout (flatten_optimizer_state_dict=True)")
    return opts


def _one(optimizers) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise NotImplementedError(f"full_state_backend takes one optimizer; the case passed {len(optimizers)}")
    return optimizers[0]


def _where(model, opts: Options) -> dict:
    if opts.cpu_offload:
        return {"device": "cpu", "rank0_only": True}
    return {"device": rank_device(model), "rank0_only": False}


def get_model_state_dict(model, *, options=None):
    opts = _supported(options, "get_model_state_dict")
    return backend.gather_model(model, skip_frozen=opts.ignore_frozen_params, **_where(model, opts))


def set_model_state_dict(model, model_state_dict, *, options=None):
    opts = _supported(options, "set_model_state_dict")
    result = backend.load_model(model, model_state_dict, from_rank0=opts.broadcast_from_rank0, strict=opts.strict)
    return IncompatibleKeys(result.missing, result.unexpected)


def get_optimizer_state_dict(model, optimizers, *, options=None):
    opts = _supported(options, "get_optimizer_state_dict")
    return backend.gather_optimizer(model, _one(optimizers), **_where(model, opts))


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    opts = _supported(options, "set_optimizer_state_dict")
    backend.load_optimizer(model, _one(optimizers), optim_state_dict, from_rank0=opts.broadcast_from_rank0, strict=opts.strict)


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
)
