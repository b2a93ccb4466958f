"""ownstack's state-dict functions, with torch's names and signatures.

Model and optimizer state dicts keyed by canonical FQNs. By default
(*sharded*) a parameter's value is a SplitTensor laid out like the parameter
and so is every optimizer state tensor shaped like its parameter's block (the
optimizer itself keeps plain blocks); with ``full_state_dict`` they are whole
plain tensors (gathered), with ``cpu_offload`` as well on the CPU and only on
the mesh's first rank. A get returns copies: changing what it returned never
changes the model or the optimizer. A set validates everything first, agrees
with the other ranks, and only then changes anything; the model and the
optimizer load inside :func:`~.tensor.local_ops`.

The optimizer functions live in :mod:`.optim`; this module re-exports them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from . import transfer
from .common import (
    StateDictOptions,
    agree,
    all_names,
    canonical,
    checked,
    copied,
    device_of,
    gathered,
    group_of,
    is_root,
    offloaded,
    root_rank,
)
from .optim import get_optimizer_state_dict, set_optimizer_state_dict
from .sharding import materialize, settle
from .tensor import SplitTensor, cut, local_ops


class IncompatibleKeys(NamedTuple):
    """What ``set_model_state_dict`` returns, as ``nn.Module.load_state_dict`` does: canonical keys."""

    missing_keys: list[str]
    unexpected_keys: list[str]


__all__ = [
    "IncompatibleKeys",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


def get_model_state_dict(model: nn.Module, *, submodules=None, options=None) -> dict:
    """The model's ``state_dict()`` under canonical keys (tied weights under each name, as there)."""
    options = checked(options)
    frozen = {n for n, p in all_names(model).items() if not p.requires_grad} if options.ignore_frozen_params else set()
    raw = {canonical(k): v for k, v in model.state_dict().items()}
    raw = {k: v for k, v in raw.items() if k not in frozen}
    if not options.full_state_dict:
        out = {k: copied(v) for k, v in raw.items()}
        return {k: offloaded(v) for k, v in out.items()} if options.cpu_offload else out
    keep = is_root(model) or not options.cpu_offload
    out = {}
    for key, value in raw.items():  # one tensor whole at a time: others drop it at once
        full = gathered(value, options.cpu_offload)
        if keep:
            out[key] = full
    return out


def _target_value(key: str, target, value):
    """``value`` as the model's ``target`` takes it, or a ValueError naming ``key``."""
    if not isinstance(target, torch.Tensor):
        return value
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"ownstack: {key}: expected a tensor, got {type(value).__name__}")
    if isinstance(target, SplitTensor):
        if isinstance(value, SplitTensor):
            if value.shape != target.shape or value._local.shape != target._local.shape:
                raise ValueError(
                    f"ownstack: {key}: a SplitTensor of shape {tuple(value.shape)} (block "
                    f"{tuple(value._local.shape)}) does not fit the parameter's {tuple(target.shape)} "
                    f"(block {tuple(target._local.shape)})"
                )
            local = value._local
        elif value.shape == target.shape:
            local = cut(value.detach(), target.mesh, target.placements)
        elif value.shape == target._local.shape:
            local = value
        else:
            raise ValueError(f"ownstack: {key}: shape {tuple(value.shape)}, the model's is {tuple(target.shape)}")
        return SplitTensor(local, target.mesh, target.placements, target.shape)
    if isinstance(value, SplitTensor) or value.shape != target.shape:
        raise ValueError(f"ownstack: {key}: {value!r} does not fit the model's tensor of shape {tuple(target.shape)}")
    return value


def _received(model, state_dict, targets):
    """The root's dict on every rank, SplitTensors' blocks scattered (``broadcast_from_rank0``)."""
    group, size = group_of(model)
    if size == 1:
        return state_dict

    def target_of(path, slot):
        target = targets.get(path[0]) if len(path) == 1 else None
        return target if isinstance(target, SplitTensor) else None

    return transfer.send_from_root(
        state_dict, src=root_rank(model), group=group, device=device_of(model), target_of=target_of
    )


def set_model_state_dict(model: nn.Module, model_state_dict: dict, *, options=None) -> IncompatibleKeys:
    """Load ``model_state_dict`` (sharded or full); returns (missing_keys, unexpected_keys)."""
    options = checked(options)
    settle(model)
    raw_keys = list(model.state_dict(keep_vars=True).items())
    targets = {canonical(k): v for k, v in raw_keys}
    if options.broadcast_from_rank0:
        model_state_dict = _received(model, model_state_dict, targets)
    error, converted = None, {}
    try:
        if not isinstance(model_state_dict, dict):
            raise ValueError(f"ownstack: a model state dict is a dict, got {type(model_state_dict).__name__}")
        missing, unexpected = _compare_keys(model, model_state_dict, targets)
        if options.strict and (missing or unexpected):
            raise RuntimeError(
                f"ownstack: Error(s) in loading state_dict: missing keys {missing}, unexpected keys {unexpected}"
            )
        for key, value in model_state_dict.items():
            if key in targets:
                converted[key] = _target_value(key, targets[key], value)
    except (ValueError, RuntimeError, TypeError) as exc:
        error = exc
    agree(model, error)
    materialize(model)
    with torch.no_grad(), local_ops():
        model.load_state_dict(_by_raw_key(model, raw_keys, converted), strict=False)
    return IncompatibleKeys(missing, unexpected)


def _compare_keys(model, given: dict, targets: dict) -> tuple[list[str], list[str]]:
    """(missing, unexpected), canonical; a tied weight given under one of its names counts for all."""
    names = all_names(model)
    given_ids = {id(names[k]) for k in given if k in names}
    missing = [k for k in targets if k not in given and not (k in names and id(names[k]) in given_ids)]
    unexpected = [k for k in given if k not in targets]
    return missing, unexpected


def _by_raw_key(model, raw_keys, converted: dict) -> dict:
    """``converted`` under the model's own keys (wrapper segments and all), tied twins filled in."""
    names = all_names(model)
    by_param = {id(names[k]): v for k, v in converted.items() if k in names}
    out = {}
    for raw, _ in raw_keys:
        key = canonical(raw)
        if key in converted:
            out[raw] = converted[key]
        elif key in names and id(names[key]) in by_param:
            out[raw] = by_param[id(names[key])]
    return out


def get_state_dict(model: nn.Module, optimizers, *, submodules=None, options=None) -> tuple[dict, dict]:
    """(model state dict, optimizer state dict), as the two functions return them."""
    return (
        get_model_state_dict(model, options=options),
        get_optimizer_state_dict(model, optimizers, options=options),
    )


def set_state_dict(model: nn.Module, optimizers, *, model_state_dict, optim_state_dict, options=None):
    """Load both; returns the model's (missing_keys, unexpected_keys)."""
    checked(options)
    result = set_model_state_dict(model, model_state_dict, options=options)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    return result
