"""FSDP1: its wrapper, its FlatParameter's layout, and resharding one instance."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch


@functools.cache
def fsdp1_class() -> type:
    # Imported once: an import statement per module of a large model is measurable.
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def is_fsdp1(module: torch.nn.Module) -> bool:
    return isinstance(module, fsdp1_class())


FSDP1_WRAPPED = "_fsdp_wrapped_module"  # the child FSDP1 hides from state-dict keys


class Fsdp1Unit(NamedTuple):
    """One FSDP1 instance's FlatParameter, as plain facts (see :func:`fsdp1_unit`)."""

    module: torch.nn.Module  # the FSDP1 instance
    flat_param: torch.nn.Parameter  # what the optimizer steps with use_orig_params=False
    local: torch.Tensor  # the padded local shard, where the values live even while FSDP1 holds them unsharded
    unsharded: bool  # FSDP1 keeps an unsharded copy to reuse (a forward of SHARD_GRAD_OP left it)
    names: tuple[str, ...]  # each original parameter's name below the wrapped module, raw
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # where each starts in the padded unsharded flat parameter
    shared: tuple[tuple[str, int], ...]  # (raw name below the wrapped module, index of the parameter it ties)
    in_shard: tuple[tuple[int, int] | None, ...]  # each parameter's (offset, numel) in the local shard, if any
    params: tuple | None  # the original parameters the optimizer steps (use_orig_params=True), else None
    pg: Any  # the group the flat parameter is sharded over
    mesh: Any  # the DeviceMesh FSDP1 was given (None: a process group)
    replicate_pg: Any  # HYBRID_SHARD: the group across the replicas; else None
    sharded: bool  # False for NO_SHARD


def fsdp1_unit(module: torch.nn.Module) -> Fsdp1Unit | None:
    """The FlatParameter of one FSDP1 instance (None if it manages none).

    FSDP1 keeps the layout of its flat parameters (original names, shapes,
    offsets with padding, ties) in private attributes of FlatParameter and
    its handle; its public state-dict paths need the unsharding it does
    itself, one all-gather of a whole unit per rank. Read here once per call.
    """
    handle = module._handle
    if handle is None:
        return None
    flat_param = handle.flat_param
    starts, offset = [], 0
    for numel, padding in zip(flat_param._numels_with_padding, flat_param._is_padding_mask):
        if not padding:
            starts.append(offset)
        offset += numel
    prim = {(info.module, info.param_name): i for i, info in enumerate(flat_param._param_infos)}
    shared = tuple(
        (f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name, prim[(s.prim_module, s.prim_param_name)])
        for s in flat_param._shared_param_infos
    )
    local = getattr(flat_param, "_local_shard", flat_param.data)
    padded = getattr(flat_param, "_full_param_padded", None)  # the all-gather's destination, freed when resharded
    return Fsdp1Unit(
        module=module,
        flat_param=flat_param,
        local=local,
        unsharded=handle.uses_sharded_strategy
        and (flat_param.data_ptr() != local.data_ptr() or (padded is not None and padded.untyped_storage().size() > 0)),
        names=tuple(flat_param._fqns),
        shapes=tuple(flat_param._shapes),
        offsets=tuple(starts),
        shared=shared,
        in_shard=tuple(
            (i.offset_in_shard, i.numel_in_shard) if i.in_shard else None for i in flat_param._shard_param_infos
        ),
        params=tuple(flat_param._params) if module._use_orig_params else None,
        pg=module.process_group,
        mesh=module._device_mesh,
        replicate_pg=getattr(module, "_inter_node_pg", None),
        sharded=handle.uses_sharded_strategy,
    )


def fsdp1_reshard(module: torch.nn.Module) -> None:
    """Free the unsharded copy an FSDP1 instance keeps, so that its next
    forward gathers the shards again (after a load wrote into them)."""
    # FSDP1 reshards through its handle only; SHARD_GRAD_OP keeps the copy a
    # forward made and reuses it while its storage is allocated.
    module._handle.reshard(True)


def is_flat_param(p: Any) -> bool:
    # FlatParameter lives in a private module; its metaclass answers isinstance by a flag.
    return getattr(p, "_is_flat_param", False) is True
