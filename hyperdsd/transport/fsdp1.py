"""FSDP1's flat shards to rows and back: one uneven all-to-all per unit and tensor.

An FSDP1 rank holds a contiguous run of its unit's flat parameter (or of a
state tensor laid out like it); the canonical layout gives it whole rows of
each parameter (:class:`hyperdsd.state.fsdp1.UnitLayout`). :func:`to_rows`
and :func:`to_flat` move exactly the elements whose holder and owner
differ, among the ranks the unit is sharded over (a replica of HYBRID_SHARD
moves within itself): no rank ever holds more than its shard in either
layout, plus what is in flight. Every rank computes the same plan from the
unit's shapes alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import StateDictError
from .collectives import as_bytes, from_bytes

_meshes: dict[tuple[int, str], tuple[Any, DeviceMesh]] = {}


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
    hit = _meshes.get(key)
    if hit is None or hit[0] is not pg:
        hit = _meshes[key] = (pg, DeviceMesh.from_group(pg, device_type))
    return hit[1]


def shard_index(unit) -> tuple[int, int]:
    """(ranks the unit is sharded over, this rank's place among them)."""
    return dist.get_world_size(unit.pg), dist.get_rank(unit.pg)


def _exchange(layout, outgoing: list[list[torch.Tensor]], incoming: list[int], dtype, device) -> torch.Tensor:
    """Send ``outgoing[q]`` (pieces, in order) to shard rank ``q``; receive
    ``incoming[r]`` elements from each rank ``r``, concatenated by rank."""
    size = dtype.itemsize
    me = layout.index
    if layout.size == 1:
        pieces = outgoing[me]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device)
    sends = [as_bytes(p) for q in outgoing for p in q]
    send = torch.cat(sends) if sends else torch.empty(0, dtype=torch.uint8, device=device)
    send_sizes = [sum(p.numel() for p in q) * size for q in outgoing]
    recv = torch.empty(sum(incoming) * size, dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        recv, send, output_split_sizes=[n * size for n in incoming], input_split_sizes=send_sizes, group=layout.unit.pg
    )
    return from_bytes(recv, dtype, (sum(incoming),))


def to_rows(layout, flat: torch.Tensor) -> list[torch.Tensor]:
    """This rank's rows of each of the unit's parameters (new tensors), from
    ``flat``, this rank's flat shard of them (the parameter's or a state
    tensor's). A collective over the unit's ranks."""
    me, base = layout.index, layout.index * layout.shard
    flat = flat.detach().reshape(-1)
    outgoing = [[flat[a - base : b - base] for _, a, b in layout.pieces(me, q)] for q in range(layout.size)]
    plans = [layout.pieces(r, me) for r in range(layout.size)]
    incoming = [sum(b - a for _, a, b in plan) for plan in plans]
    recv = _exchange(layout, outgoing, incoming, flat.dtype, flat.device)
    out = [torch.empty(layout.local_shape(i), dtype=flat.dtype, device=flat.device) for i in range(len(layout.fqns))]
    views = [t.view(-1) for t in out]
    at = 0
    for plan in plans:
        for i, a, b in plan:
            start = layout.rows(i, me)[0]
            views[i][a - start : b - start] = recv[at : at + b - a]
            at += b - a
    return out


def to_flat(layout, rows: list[torch.Tensor], into: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's flat shard made from every rank's ``rows`` (this rank's rows
    of each parameter, as :func:`to_rows` gives them): written into ``into``
    (its padding left as it is) or a new zero-padded tensor. A collective
    over the unit's ranks."""
    me, base = layout.index, layout.index * layout.shard
    dtype = rows[0].dtype if rows else into.dtype
    device = into.device if into is not None else rows[0].device
    flats = [r.detach().reshape(-1) for r in rows]
    outgoing = []
    for q in range(layout.size):
        pieces = []
        for i, a, b in layout.pieces(q, me):
            start = layout.rows(i, me)[0]
            pieces.append(flats[i][a - start : b - start].to(device=device, dtype=dtype))
        outgoing.append(pieces)
    plans = [layout.pieces(me, r) for r in range(layout.size)]
    incoming = [sum(b - a for _, a, b in plan) for plan in plans]
    recv = _exchange(layout, outgoing, incoming, dtype, device)
    out = into if into is not None else torch.zeros(layout.shard, dtype=dtype, device=device)
    view = out.view(-1)
    at = 0
    for plan in plans:
        for _, a, b in plan:
            view[a - base : b - base] = recv[at : at + b - a]
            at += b - a
    return out


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
