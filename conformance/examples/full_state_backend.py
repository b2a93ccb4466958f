"""A stand-in for a training framework whose checkpoint API has full state
dicts only.

- ``gather_model`` / ``gather_optimizer`` return full (unsharded) tensors,
  either on every rank or on rank 0 only (``rank0_only``);
- ``device`` says where the returned tensors live: ``"cpu"`` or the rank's
  own device (``"cuda:1"``, or ``"cpu"`` again when the rank computes on it);
- ``load_model`` / ``load_optimizer`` take a full dict, either on every rank
  or on rank 0 only (``from_rank0``: the others pass ``{}`` and receive their
  part), and copy each rank's part into the model's own (sharded) tensors;
- the optimizer functions take exactly one optimizer.

There is no sharded state dict and no flat optimizer layout. Underneath it
is hyperdsd's public API with ``full_state_dict=True``, so what it does, it
does correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

import hyperdsd


@dataclass
class LoadResult:
    """What ``load_model`` did not match, by FQN."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def gather_model(
    model: nn.Module, *, device: str | torch.device, rank0_only: bool = False, skip_frozen: bool = False
) -> dict:
    """The model's full state dict by FQN, its tensors on ``device``.

    ``rank0_only``: rank 0 gets it all, every other rank ``{}``; the full
    tensors never exist elsewhere. ``skip_frozen`` leaves out parameters
    with ``requires_grad=False``.
    """
    device = torch.device(device)
    options = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=rank0_only, ignore_frozen_params=skip_frozen)
    return _to(hyperdsd.get_model_state_dict(model, options=options), device)


def gather_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, device: str | torch.device, rank0_only: bool = False
) -> dict:
    """The optimizer's full state (``state`` and ``param_groups`` by FQN), on ``device``."""
    device = torch.device(device)
    _one_optimizer(optimizer)
    options = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return _to(hyperdsd.get_optimizer_state_dict(model, optimizer, options=options), device)


def load_model(model: nn.Module, state: dict, *, from_rank0: bool = False, strict: bool = True) -> LoadResult:
    """Load a full model state dict; with ``strict``, missing or unexpected keys raise."""
    options = hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0, strict=strict)
    keys = hyperdsd.set_model_state_dict(model, state, options=options)
    return LoadResult(list(keys.missing_keys), list(keys.unexpected_keys))


def load_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict, *, from_rank0: bool = False, strict: bool = True
) -> None:
    """Load a full optimizer state dict into the optimizer's existing tensors."""
    _one_optimizer(optimizer)
    options = hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0, strict=strict)
    hyperdsd.set_optimizer_state_dict(model, optimizer, state, options=options)


def _one_optimizer(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"full_state_backend takes exactly one torch.optim.Optimizer, got {type(optimizer).__name__}")


def _to(tree, device: torch.device):
    """``tree`` with every tensor on ``device`` (tensors already there are not copied)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to(v, device) for v in tree]
    return tree
