"""What ownstack's state-dict functions share: names, the model's mesh, copies, agreement.

Names are canonical fully qualified names: a parameter's name in the model
with the segments wrappers add (``module``, ``_orig_mod``,
``_checkpoint_wrapped_module``) taken out, a tied parameter under the first
name it has. Validation is agreed between ranks before anything changes: a
rank that refuses a load tells the others, and every rank raises the same
error, so that none is left waiting in a later collective.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .tensor import SplitTensor

WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module"})


@dataclass
class StateDictOptions:
    """torch's option fields, under torch's names (SPEC §1)."""

    full_state_dict: bool = False
    cpu_offload: bool = False
    ignore_frozen_params: bool = False
    keep_submodule_prefixes: bool = True
    strict: bool = True
    broadcast_from_rank0: bool = False
    flatten_optimizer_state_dict: bool = False
    dsd_fqn_modifiers: str = "_fqn_modifiers"


def checked(options) -> StateDictOptions:
    """``options`` (default: all off); refuses contradictions before any collective."""
    options = options or StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError("ownstack: broadcast_from_rank0 needs full_state_dict=True (a broadcast sends full tensors)")
    return options


def canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(canonical FQN, parameter), each parameter once, under its first name."""
    return [(canonical(n), p) for n, p in model.named_parameters()]


def all_names(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every canonical name of every parameter (a tied one under each of its names)."""
    return {canonical(n): p for n, p in model.named_parameters(remove_duplicate=False)}


def model_mesh(model: nn.Module):
    """The mesh of the model's first SplitTensor parameter; None for a model of plain tensors."""
    for p in model.parameters():
        if isinstance(p, SplitTensor):
            return p.mesh
    return None


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def root_rank(model: nn.Module) -> int:
    """The rank that holds full CPU dicts and broadcasts them: the mesh's first (global rank 0 without one)."""
    mesh = model_mesh(model)
    return mesh.first_rank() if mesh is not None else 0


def is_root(model: nn.Module) -> bool:
    return (dist.get_rank() if _distributed() else 0) == root_rank(model)


def group_of(model: nn.Module):
    """(process group, size) over which the model's ranks agree: the mesh's
    whole group, or the world for a model of plain tensors (DDP)."""
    if not _distributed():
        return None, 1
    mesh = model_mesh(model)
    if mesh is None:
        return dist.group.WORLD, dist.get_world_size()
    return mesh.whole_group(), mesh.size()


def agree(model: nn.Module, error: Exception | None) -> None:
    """Every rank learns whether any refused; all raise the first refusal (in rank order).

    A collective every rank enters, whatever it found: after it no rank
    starts a transfer that another has abandoned."""
    group, size = group_of(model)
    if size > 1 and group is not None:
        everyone: list = [None] * size
        dist.all_gather_object(everyone, None if error is None else (type(error).__name__, str(error)), group=group)
        if error is None:
            first = next((e for e in everyone if e is not None), None)
            if first is not None:
                kind = RuntimeError if first[0] == "RuntimeError" else ValueError
                raise kind(f"ownstack: another rank refused the load: {first[1]}")
    if error is not None:
        raise error


def device_of(model: nn.Module) -> torch.device:
    """Where the model's blocks live (the CPU for a model with none)."""
    for p in model.parameters():
        local = p._local if isinstance(p, SplitTensor) else p
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")


def copied(value):
    """A detached copy of ``value`` that shares nothing with it: SplitTensors
    keep their layout, containers are rebuilt, other values deep-copied."""
    if isinstance(value, SplitTensor):
        return SplitTensor(value._local.detach().clone(), value.mesh, value.placements, value.shape)
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(copied(v) for v in value)
    return copy.deepcopy(value)


def offloaded(value):
    """``value`` with every tensor on the CPU (a SplitTensor's block moved, its layout kept)."""
    if isinstance(value, SplitTensor):
        return SplitTensor(value._local.cpu(), value.mesh, value.placements, value.shape)
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: offloaded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [offloaded(v) for v in value]
    if isinstance(value, tuple):
        return tuple(offloaded(v) for v in value)
    return value


def gathered(value, cpu: bool):
    """``value`` with every SplitTensor made whole (collective, in the order
    the structure lists them); a copy throughout."""
    if isinstance(value, SplitTensor):
        full = value.full_tensor()
        return full.cpu() if cpu else full
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        return out.cpu() if cpu else out
    if isinstance(value, dict):
        return {k: gathered(v, cpu) for k, v in value.items()}
    if isinstance(value, list):
        return [gathered(v, cpu) for v in value]
    if isinstance(value, tuple):
        return tuple(gathered(v, cpu) for v in value)
    return copy.deepcopy(value)
