"""What an FSDP1 unit's process group is asked: the mesh its parameters are
DTensors on, this rank's place in it, and what every rank of it holds
(one collective per distinct group, for many units at once)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import StateDictError
from ..transport.group import WorldCache

# 1-D meshes made over FSDP1 process groups, by group, in this world: a mesh
# holds its group, whose backend's threads would outlive a re-formed world.
_meshes = WorldCache()


def unit_mesh(unit, device_type: str) -> DeviceMesh:
    """The mesh a unit's parameters are DTensors on: the one FSDP1 was given,
    or a 1-D mesh over its process group."""
    if unit.mesh is not None:
        return unit.mesh
    if unit.replicate_pg is not None:
        raise StateDictError(
            "an FSDP1 model with HYBRID_SHARD built from process groups: build it with device_mesh= "
            "(a 2-D mesh, replicas by shards) for hyperdsd to lay its state out by rows"
        )
    pg = unit.pg
    key = (id(pg), device_type)
    meshes = _meshes.current()
    hit = meshes.get(key)
    if hit is None or hit[0] is not pg:
        hit = meshes[key] = (pg, DeviceMesh.from_group(pg, device_type))
    return hit[1]


def shard_index(unit) -> tuple[int, int]:
    """(ranks the unit is sharded over, this rank's place among them)."""
    return dist.get_world_size(unit.pg), dist.get_rank(unit.pg)


def exchange_by_group(objs: list[Any], pgs: list[Any]) -> list[list[Any]]:
    """For each ``objs[k]``, every rank's of the ranks of ``pgs[k]``, in
    group order: one all-gather of objects per distinct group."""
    by_pg: dict[int, list[int]] = {}
    for k, pg in enumerate(pgs):
        by_pg.setdefault(id(pg), []).append(k)
    out: list[list[Any]] = [[] for _ in objs]
    for ks in by_pg.values():
        pg = pgs[ks[0]]
        n = dist.get_world_size(pg)
        mine = [objs[k] for k in ks]
        everyone: list[Any] = [None] * n
        if n == 1:
            everyone = [mine]
        else:
            dist.all_gather_object(everyone, mine, group=pg)
        for j, k in enumerate(ks):
            out[k] = [e[j] for e in everyone]
    return out


def anywhere(units: list, flags: list[list[bool]]) -> list[tuple[list[bool], list[bool]]]:
    """For each unit's ``flags`` (one per parameter, this rank's): whether
    any rank of the unit's group has it set, and whether any has it clear
    (one all-reduce per group)."""
    by_pg: dict[int, list[int]] = {}
    for k, u in enumerate(units):
        by_pg.setdefault(id(u.unit.pg), []).append(k)
    out: list = [None] * len(units)
    for ks in by_pg.values():
        mine = [f for k in ks for f in flags[k]]
        both = torch.tensor(mine + [not f for f in mine], dtype=torch.int32)
        if units[ks[0]].size > 1 and mine:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=units[ks[0]].unit.pg)
        read = [bool(x) for x in both.tolist()]  # (as Python values at once: an element at a time cost 1 us)
        at = 0
        for k in ks:
            n = len(flags[k])
            out[k] = (read[at : at + n], read[len(mine) + at : len(mine) + at + n])
            at += n
    return out
