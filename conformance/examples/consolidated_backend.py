"""A stand-in for a training framework with full state dicts only.

Like many trainers, it checkpoints one way: rank 0 gathers the model and its
one optimizer to the CPU and saves one file; every rank reads the whole file
and loads it. It has no options type (keyword arguments only), takes one
optimizer, and knows nothing of pipeline stages. Gathering and the model
load go through ``hyperdsd``; the optimizer load is the framework's own and
pairs the checkpoint with the optimizer *by position* (groups in order,
parameters in order), with no check of keys or shapes: the deviation the
conformance suite must find (OPT-ATOM-1/2/4, OPT-PART-1/6).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

import hyperdsd

_GATHER = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=True)


def gather_model(model: nn.Module) -> dict:
    """The full model state dict on rank 0, on the CPU; ``{}`` elsewhere."""
    return hyperdsd.get_model_state_dict(model, options=_GATHER)


def gather_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The full optimizer state dict (FQN keys) on rank 0, on the CPU; ``{}`` elsewhere."""
    return hyperdsd.get_optimizer_state_dict(model, optimizer, options=_GATHER)


def load_model(model: nn.Module, state: dict):
    """Every rank loads the whole model dict (strict)."""
    return hyperdsd.set_model_state_dict(model, state, options=hyperdsd.StateDictOptions(full_state_dict=True))


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Every rank loads the whole optimizer dict: the i-th parameter of the
    i-th group takes the state listed i-th there, whatever its name."""
    for group, saved in zip(optimizer.param_groups, state["param_groups"]):
        for param, fqn in zip(group["params"], saved["params"]):
            if fqn in state["state"]:
                optimizer.state[param] = {k: _like(param, v) for k, v in state["state"][fqn].items()}
        group.update({k: v for k, v in saved.items() if k != "params"})


def _like(param, value):
    """A full value placed as ``param`` is: sharded like it, on its device."""
    if isinstance(value, dict):
        return {k: _like(param, v) for k, v in value.items()}
    if isinstance(value, list):
        return [_like(param, v) for v in value]
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if isinstance(param, DTensor):
        return distribute_tensor(
            value.to(param.to_local().device), param.device_mesh, param.placements, src_data_rank=None
        )
    return value.to(param.device)
