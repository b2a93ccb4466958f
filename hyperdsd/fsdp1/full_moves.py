"""FSDP1's flat shards to full tensors: a full get's gather, straight from where FSDP1 keeps each element.

:func:`to_full` makes the full tensors of a run of a unit's parameters on
every rank of its group, or on a root alone, from each rank's flat shards
(or :class:`Pieces`, state kept per original parameter): each rank's
elements go straight to their place, no rows in between. A unit of many
small parameters moves one span of its flat shard a rank. A part of an
:class:`~hyperdsd.fsdp1.unit_moves.Exchange`, like the moves to rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .. import _compat
from .unit_moves import Exchange, run_or_add, shard_bytes


@dataclass
class Pieces:
    """A rank's flat shard that is no one tensor (state kept per original
    parameter): ``cut(i, a, b)`` gives its elements at positions in the flat parameter
    ``[a, b)``, all of parameter ``i``, of ``dtype``."""

    cut: Callable[[int, int, int], torch.Tensor]
    dtype: torch.dtype
    device: torch.device


def to_full(
    layout, shards: list, run: list[int], root: int | None, exchange: Exchange | None = None
) -> list[list[torch.Tensor | None]]:
    """The full tensors of the unit's parameters ``run`` (the same list on
    every rank) from each of ``shards`` (this rank's flat shards, or
    :class:`Pieces`): on every rank of the unit's group, or with ``root`` (a
    global rank among them) on the root alone, None elsewhere. Each rank's
    elements go from its flat shard straight to their place in the full
    tensors, no rows in between. A collective over the unit's ranks."""
    me, base = layout.index, layout.index * layout.shard
    dest = None if root is None else dist.get_group_rank(layout.unit.pg, root)
    if layout.index_plan() is not None and not any(isinstance(s, Pieces) for s in shards):
        return _to_full_span(layout, shards, run, dest, exchange)
    keep = dest is None or dest == me
    held = [layout.held(r, run) for r in range(layout.size)]
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    result = []
    for shard in shards:
        if not isinstance(shard, Pieces):
            shard = shard.detach().reshape(-1)
            shard = Pieces(lambda i, a, b, shard=shard: shard[a - base : b - base], shard.dtype, shard.device)
        full = [
            torch.empty(layout.unit.shapes[i], dtype=shard.dtype, device=shard.device) if keep else None for i in run
        ]
        at = {i: (t.view(-1), layout.unit.offsets[i]) for i, t in zip(run, full) if t is not None}
        mine = [shard.cut(i, a, b) for i, a, b in held[me]]
        for q in range(layout.size):
            if dest is None or q == dest:
                outgoing[q] += mine
            if keep:
                incoming[q] += [at[i][0][a - at[i][1] : b - at[i][1]] for i, a, b in held[q]]
        result.append(full)
    run_or_add(layout, outgoing, incoming, shard_bytes(layout, [f.dtype for f in shards]), exchange)
    return result


def _to_full_span(layout, shards: list[torch.Tensor], run: list[int], dest, exchange) -> list[list]:
    """:func:`to_full` of a unit of many small parameters: each rank sends
    its part of the span of flat positions the run covers as one piece (the
    padding between parameters with it), which lands in place in one buffer
    on each rank that keeps the full tensors; those are then cut from it,
    each a copy of its own (filled when the move has run)."""
    me, shard = layout.index, layout.shard
    keep = dest is None or dest == me
    offsets, shapes = layout.unit.offsets, layout.unit.shapes
    lo = min(offsets[i] for i in run)
    hi = max(offsets[i] + math.prod(shapes[i]) for i in run)
    spans = [(max(lo, r * shard), min(hi, (r + 1) * shard)) for r in range(layout.size)]
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    result, landed = [], []
    for flat in shards:
        flat = flat.detach().reshape(-1)
        a, b = spans[me]
        for q in range(layout.size):
            if a < b and (dest is None or q == dest):
                outgoing[q].append(flat[a - me * shard : b - me * shard])
        span = flat.new_empty(hi - lo) if keep else None
        for r, (a, b) in enumerate(spans):
            if keep and a < b:
                incoming[r].append(span[a - lo : b - lo])
        result.append([None] * len(run))
        landed.append(span)

    cut = _span_cut(tuple(offsets[i] - lo for i in run), tuple(shapes[i] for i in run))

    def settle() -> None:
        for full, span in zip(result, landed):
            if span is None:
                continue
            for shape, index, places in cut:
                index = index if span.device.type == "cpu" else index.to(span.device)
                pieces = _compat.unbound_copies(span.index_select(0, index).view(len(places), *shape))
                for j, piece in zip(places, pieces):
                    full[j] = piece

    run_or_add(layout, outgoing, incoming, shard_bytes(layout, [f.dtype for f in shards]), exchange, settle)
    return result


@functools.lru_cache(maxsize=1024)
def _span_cut(starts: tuple[int, ...], shapes: tuple[torch.Size, ...]) -> tuple[tuple, ...]:
    """How a run's full tensors are cut from the span they landed in (parameter
    ``j`` of shape ``shapes[j]`` at ``starts[j]``): per shape, the positions of
    its parameters' elements, taken by one ``index_select`` and cut into copies
    by one ``unbind_copy``, and the places in the run they fill. Alike units'
    runs share it (a slice, a view and a clone a parameter took 3 to 4 times as long)."""
    places: dict[torch.Size, list[int]] = {}
    for j, shape in enumerate(shapes):
        places.setdefault(shape, []).append(j)
    cut = []
    for shape, js in places.items():
        numel = math.prod(shape)
        index = torch.cat([torch.arange(starts[j], starts[j] + numel) for j in js])
        cut.append((shape, index, tuple(js)))
    return tuple(cut)
