"""The geometry of one FSDP1 unit's flat shards and rows, on every rank.

A unit's parameters are concatenated (padded) and cut into equal flat
shards, one a rank; the canonical layout gives each rank whole rows of
each parameter. :func:`geometry` says, for every pair of ranks, which flat
positions one holds of the other's rows (:class:`Geometry`); it depends on
the parameters' shapes and offsets alone, so it is computed once for every
unit alike. :func:`index_plan` turns one rank's part of it into index
tensors, for units of many small parameters, and :func:`stack_plan` how the
rows of alike units moved as one stack are cut apart. No collectives, no tensors of the
model.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from ..placement import chunk_bounds


@dataclass(frozen=True)
class Geometry:
    """A unit's rows and pieces on every shard rank (see
    :class:`hyperdsd.fsdp1.units.UnitLayout`)."""

    shard: int  # elements of each rank's flat shard, padding included
    rows: tuple  # [rank][i]: (start, stop) of parameter i's rows, as positions in the flat parameter
    starts: tuple  # [rank][i]: start of parameter i's rows
    shapes: tuple  # [rank][i]: the shape of parameter i's rows
    pieces: tuple  # [holder][owner]: ((i, start, stop), ...), what holder's flat shard holds of owner's rows
    plans: dict = field(default_factory=dict, compare=False, hash=False)  # rank -> its IndexPlan (or None)


# Units whose shards hold at most this many elements, in pieces of fewer than
# _INDEXED_MAX_PIECE elements on average, move by index tensors (int64, two
# per shard element, kept with the geometry); larger ones piece by piece,
# where a piece's Python cost is nothing beside its bytes.
_INDEXED_MAX_SHARD = 1 << 20
_INDEXED_MAX_PIECE = 256


@dataclass(frozen=True)
class IndexPlan:
    """One rank's moves between its flat shard and its rows, for a unit of
    many small parameters: ``shard_at[q]``, the positions in this rank's flat
    shard of what it holds of shard rank ``q``'s rows (in :attr:`Geometry.pieces`
    order); ``rows_at[r]``, the positions in this rank's rows (all its
    parameters' rows, one after the other) of what rank ``r``'s flat shard
    holds of them; ``numels``, each parameter's elements in this rank's rows."""

    shard_at: tuple
    rows_at: tuple
    numels: tuple
    total: int
    rows_order: torch.Tensor  # rows_at of every rank, one after the other
    shapes: tuple  # the shape of this rank's rows of each parameter
    on_device: dict = field(default_factory=dict, compare=False, hash=False)
    derived: dict = field(default_factory=dict, compare=False, hash=False)  # made from it once (its StackPlan)

    def on(self, device: torch.device) -> tuple[tuple, tuple, torch.Tensor]:
        """(shard_at, rows_at, rows_order) on ``device``, moved there once."""
        if device.type == "cpu":
            return self.shard_at, self.rows_at, self.rows_order
        if device not in self.on_device:
            move = lambda ts: tuple(t.to(device) for t in ts)  # noqa: E731
            self.on_device[device] = (move(self.shard_at), move(self.rows_at), self.rows_order.to(device))
        return self.on_device[device]


def _positions(spans: list[tuple[int, int]]) -> torch.Tensor:
    if not spans:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in spans])


def _index_plan(g: Geometry, me: int, shard: int) -> IndexPlan:
    base, starts = me * shard, g.starts[me]
    numels = tuple(b - a for a, b in g.rows[me])
    cum = [0]
    for n in numels:
        cum.append(cum[-1] + n)
    size = len(g.pieces)
    shard_at = tuple(_positions([(a - base, b - base) for _, a, b in g.pieces[me][q]]) for q in range(size))
    rows_at = tuple(
        _positions([(cum[i] + a - starts[i], cum[i] + b - starts[i]) for i, a, b in g.pieces[r][me]])
        for r in range(size)
    )
    return IndexPlan(shard_at, rows_at, numels, cum[-1], torch.cat(rows_at), g.shapes[me])


@functools.lru_cache(maxsize=1024)
def geometry(shapes: tuple, offsets: tuple, shard: int, size: int) -> Geometry:
    """The geometry of a unit of these shapes and offsets: computed once for
    all units alike (a model's blocks usually are), not once per call and unit."""
    rows, local = [], []
    for rank in range(size):
        mine, shaped = [], []
        for shape, start in zip(shapes, offsets):
            if not len(shape):
                mine.append((start, start + 1))
                shaped.append(())
                continue
            a, b = chunk_bounds(shape[0], size, rank)
            inner = math.prod(shape[1:])
            mine.append((start + a * inner, start + b * inner))
            shaped.append((b - a, *shape[1:]))
        rows.append(tuple(mine))
        local.append(tuple(shaped))
    pieces = [[[] for _ in range(size)] for _ in range(size)]
    for owner in range(size):
        for i, (a, b) in enumerate(rows[owner]):
            if a >= b or not shard:
                continue
            for holder in range(a // shard, min((b - 1) // shard, size - 1) + 1):
                lo, hi = holder * shard, (holder + 1) * shard
                if max(a, lo) < min(b, hi):
                    pieces[holder][owner].append((i, max(a, lo), min(b, hi)))
    return Geometry(
        shard=shard,
        rows=tuple(rows),
        starts=tuple(tuple(a for a, _ in r) for r in rows),
        shapes=tuple(local),
        pieces=tuple(tuple(map(tuple, by_owner)) for by_owner in pieces),
    )


def index_plan(g: Geometry, me: int) -> IndexPlan | None:
    """Rank ``me``'s :class:`IndexPlan` where the unit's pieces are many and
    small, else None (moved piece by piece). Decided from the whole unit, the
    same on every rank: the two ends of a move must agree."""
    if me not in g.plans:
        size, shard = len(g.pieces), g.shard
        pieces = sum(len(by_owner) for by_holder in g.pieces for by_owner in by_holder)
        small = shard <= _INDEXED_MAX_SHARD and size * shard < pieces * _INDEXED_MAX_PIECE
        g.plans[me] = _index_plan(g, me, shard) if small else None
    return g.plans[me]


@dataclass(frozen=True)
class StackPlan:
    """One rank's rows of alike units moved as one stack (their flat shards
    the rows of an ``(n, shard)`` tensor, what goes to rank ``q`` its
    ``index_select(1, shard_at[q])``): what comes from every rank, joined
    along dim 1 rank after rank (:attr:`IndexPlan.rows_order`), is cut by
    local shape. ``groups``: ``(shape, count, columns)``, the columns of
    the joined rows that hold the rows of the unit's ``count`` parameters of
    that shape, parameter after parameter, so that ``index_select(1,
    columns).view(n * count, *shape).unbind(0)`` gives each unit's in turn;
    ``where``: each parameter's ``(group, count, place among the group's)``.
    It does not depend on how many units are stacked."""

    groups: tuple
    where: tuple


def stack_plan(plan: IndexPlan) -> StackPlan:
    """:class:`StackPlan` of units of ``plan``, kept with it."""
    hit = plan.derived.get("stack")
    if hit is not None:
        return hit
    column_of = torch.empty(plan.total, dtype=torch.int64)  # a position in the rows -> its column
    column_of[plan.rows_order] = torch.arange(plan.total, dtype=torch.int64)
    starts = [0]
    for n in plan.numels:
        starts.append(starts[-1] + n)
    members: dict[tuple, list[int]] = {}
    for i, shape in enumerate(plan.shapes):
        members.setdefault(tuple(shape), []).append(i)
    groups, where = [], [None] * len(plan.shapes)
    for g, (shape, ids) in enumerate(members.items()):
        spans = [torch.arange(starts[i], starts[i + 1], dtype=torch.int64) for i in ids]
        groups.append((shape, len(ids), column_of[torch.cat(spans)]))
        for k, i in enumerate(ids):
            where[i] = (g, len(ids), k)
    made = plan.derived["stack"] = StackPlan(tuple(groups), tuple(where))
    return made
