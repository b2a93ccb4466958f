"""The adapter that lets the conformance suite drive ``consolidated_backend``.

Run the suite against it with::

    python -m conformance --impl conformance.examples.consolidated_adapter

The framework gathers to rank 0 (``full_cpu``) and loads a consolidated file
on every rank (``file``): those are the get and load modes it declares. It
has no options type, no ``strict=False`` and no ``ignore_frozen_params``,
takes one optimizer and has no pipeline stages, tensor parallelism or
models on meshes of their own: it declares none of them. The suite runs
what that admits (SPEC §1) and reports the rest ``n/a``, naming the need.
Each call into the framework runs in ``iut_call()``; what the framework
cannot take, the adapter refuses before calling it (``not_supported``).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch

from conformance.adapters import Adapter, iut_call, not_supported

from . import consolidated_backend as backend

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


@dataclass(frozen=True)
class Options:
    """Torch's ``StateDictOptions`` fields, as the suite asked for them (the framework has none)."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False


def _check(opts: Options | None, call: str, get: bool) -> None:
    opts = opts or Options()
    if get and not (opts.full_state_dict and opts.cpu_offload):
        raise not_supported(f"{call} other than gathered to rank 0 on the CPU (full_state_dict + cpu_offload)")
    if not get and (not opts.full_state_dict or opts.broadcast_from_rank0):
        raise not_supported(f"{call} other than from a full dict every rank holds (full_state_dict, no broadcast)")
    if opts.flatten_optimizer_state_dict or opts.ignore_frozen_params or not opts.strict:
        raise not_supported(f"{call} with flatten_optimizer_state_dict, ignore_frozen_params or strict=False")


def _one(optimizers) -> torch.optim.Optimizer:
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise not_supported(f"several optimizers (the framework takes one; the case passed {len(optimizers)})")
    return optimizers[0]


def get_model_state_dict(model, *, options=None):
    _check(options, "get_model_state_dict", get=True)
    with iut_call():
        return backend.gather_model(model)


def set_model_state_dict(model, model_state_dict, *, options=None):
    _check(options, "set_model_state_dict", get=False)
    with iut_call():
        keys = backend.load_model(model, model_state_dict)
    return IncompatibleKeys(list(keys.missing_keys), list(keys.unexpected_keys))


def get_optimizer_state_dict(model, optimizers, *, options=None):
    _check(options, "get_optimizer_state_dict", get=True)
    optimizer = _one(optimizers)
    with iut_call():
        return backend.gather_optimizer(model, optimizer)


def set_optimizer_state_dict(model, optimizers, optim_state_dict, *, options=None):
    _check(options, "set_optimizer_state_dict", get=False)
    optimizer = _one(optimizers)
    with iut_call():
        backend.load_optimizer(model, optimizer, optim_state_dict)


conformance_adapter = Adapter(
    name="consolidated-example",
    version="1.0",
    get_model_state_dict=get_model_state_dict,
    set_model_state_dict=set_model_state_dict,
    get_optimizer_state_dict=get_optimizer_state_dict,
    set_optimizer_state_dict=set_optimizer_state_dict,
    options=Options,
    get_modes=frozenset({"full_cpu"}),
    load_modes=frozenset({"file"}),
    layouts=frozenset(),
    supported_options=frozenset(),
)
