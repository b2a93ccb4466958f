"""Rows of many FSDP1 units at once: alike units moved as one stack.

A model's units are mostly alike (blocks of the same shapes, one group). A
unit of many small parameters moves by index tensors
(:func:`hyperdsd.fsdp1.unit_moves.to_rows_many`), but unit by unit that is
a dozen tensor calls per unit and state key, and a new tensor per
parameter allocated and filled one by one: most of an FSDP1 get of many
small parameters. :class:`RowsBatch` stacks alike units' flat shards into
one ``(n, shard)`` tensor and moves the stack as one unit: one
``index_select`` per peer, the rows received cut by one ``index_select``
and one ``unbind_copy`` per local shape
(:class:`hyperdsd.fsdp1.unit_geometry.StackPlan`): each piece a copy with
its own storage (a value kept from a get keeps nothing else alive).
:class:`ShardsBatch` moves a load's rows back into flat shards so. Units
moved piece by piece (large ones) go as before, in the same exchange.
Stacks are cut at :data:`~hyperdsd.transport.collectives.BUCKET_BYTES` of
flat shards, so no rank holds more than a bucket's stack in flight, and at
a block of pieces (:mod:`hyperdsd.blocks`), so that a stack stays in cache.
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _compat, blocks
from .unit_geometry import stack_plan
from .unit_moves import Exchange, to_rows_many, to_shard_many


class _Stacks:
    """What both batches share: alike units grouped by value (every rank must
    make the same stacks), each group moved in stacks of at most a bucket of
    flat shards and a block of pieces a tensor (:func:`_chunks`). A member is
    ``(layout, tensors, ...)``, ``tensors`` a list whose each item the unit
    moves one of (a flat shard, or a list of rows)."""

    def __init__(self, limit: float | None = None):
        self.exchange = Exchange(limit)
        self._stacks: dict[tuple, list] = {}

    def _join(self, layout, kinds: tuple, device, member: tuple) -> None:
        unit = layout.unit
        key = (id(unit.pg), layout.shard, unit.shapes, unit.offsets, kinds, device)
        self._stacks.setdefault(key, []).append(member)

    def run(self) -> None:
        stacks, self._stacks = self._stacks, {}
        for members in stacks.values():
            layout, per_unit = members[0][0], _unit_bytes(members[0])
            for at, step in _chunks(len(members), per_unit, len(layout.fqns), self.exchange.limit):
                self._stacked(members[at : at + step], per_unit)
        self.exchange.run()

    def _stacked(self, members: list, per_unit: int) -> None:
        raise NotImplementedError


class RowsBatch(_Stacks):
    """:func:`~hyperdsd.fsdp1.unit_moves.to_rows_many` of many units, run
    together. :meth:`add` each unit's flat shards (every rank of a group in
    the same order), :meth:`run` once, then :meth:`rows` of each ticket."""

    def __init__(self, limit: float | None = None):
        super().__init__(limit)
        self._rows: list = []

    def add(self, layout, shards: list[torch.Tensor]) -> int:
        """Ask for this rank's rows of each of ``shards`` (flat shards of the
        unit ``layout``, all of one device); returns the ticket of :meth:`rows`."""
        ticket = len(self._rows)
        shards = [s.detach().reshape(-1) for s in shards]
        if layout.index_plan() is None or not shards:
            self._rows.append(to_rows_many(layout, shards, self.exchange))
            return ticket
        self._rows.append([None] * len(shards))
        self._join(layout, tuple(s.dtype for s in shards), shards[0].device, (layout, shards, ticket))
        return ticket

    def rows(self, ticket: int) -> list[list[torch.Tensor]]:
        """For each flat shard added with ``ticket``: this rank's rows of each of the unit's parameters."""
        return self._rows[ticket]

    def _stacked(self, members: list, per_unit: int) -> None:
        layout = members[0][0]
        plan, n = layout.index_plan(), len(members)
        shard_at, rows_at, _ = plan.on(members[0][1][0].device)
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
        incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
        received = []
        for k in range(len(members[0][1])):
            stack = torch.stack([shards[k] for _, shards, _ in members])
            got = [stack.new_empty(n * len(at)) for at in rows_at]
            for q, at in enumerate(shard_at):
                outgoing[q].append(stack.index_select(1, at).reshape(-1))
                incoming[q].append(got[q])
            received.append(got)
        cut = stack_plan(plan)
        first = [0]  # where each shape's pieces start among a stack's
        for _, c, _ in cut.groups:
            first.append(first[-1] + n * c)

        def settle() -> None:
            for k, got in enumerate(received):
                joined = torch.cat([g.view(n, -1) for g in got], dim=1)  # (columns: IndexPlan.rows_order)
                on = joined.device.type != "cpu"
                by_shape = [joined.index_select(1, cols.to(joined.device) if on else cols) for _, _, cols in cut.groups]
                pieces = []  # (each its own storage)
                for (shape, c, _), t in zip(cut.groups, by_shape):
                    pieces += _compat.unbound_copies(t.view(n * c, *shape))
                for u, (_, _, ticket) in enumerate(members):
                    self._rows[ticket][k] = [pieces[first[g] + u * c + at] for g, c, at in cut.where]

        self.exchange.add(layout, outgoing, incoming, per_unit * n, settle)


class ShardsBatch(_Stacks):
    """:func:`~hyperdsd.fsdp1.unit_moves.to_shard_many` of many units, run
    together (a load's write-back): alike units' rows joined as one
    ``(n, rows)`` stack, what goes to each rank taken by one
    ``index_select``, what comes put into the stacked flat shards by one
    ``index_copy_`` a rank. :meth:`add` each unit (every rank of a group in
    the same order) with what to do once its flat shards are filled, then
    :meth:`run` once."""

    def add(self, layout, rows_of: list[list[torch.Tensor]], intos: list, then: Callable[[list], None]) -> None:
        """This rank's flat shard of each of ``rows_of`` (this rank's rows of
        every parameter of the unit ``layout``), written into the tensor of
        ``intos`` (its padding left as it is) or a new zero-padded one;
        ``then(shards)`` once they are filled."""
        if not rows_of:
            then([])
            return
        if layout.index_plan() is None or not all(rows_of):
            shards = to_shard_many(layout, rows_of, intos, exchange=self.exchange)
            self.exchange.after(lambda: then(shards))
            return
        kinds = tuple((rows[0].dtype, None if into is None else into.dtype) for rows, into in zip(rows_of, intos))
        device = intos[0].device if intos[0] is not None else rows_of[0][0].device
        self._join(layout, kinds, device, (layout, rows_of, intos, then))

    def _stacked(self, members: list, per_unit: int) -> None:
        layout = members[0][0]
        plan, n = layout.index_plan(), len(members)
        outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
        incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
        landing = []
        for k in range(len(members[0][1])):
            into = members[0][2][k]
            dtype = members[0][1][k][0].dtype
            device = into.device if into is not None else members[0][1][k][0].device
            shard_at, rows_at, _ = plan.on(device)
            mine = _compat.joined_flat([r for _, rows_of, _, _ in members for r in rows_of[k]])
            mine = mine.to(device=device, dtype=dtype).view(n, -1)
            got = [mine.new_empty(n * len(at)) for at in shard_at]
            for q, at in enumerate(rows_at):
                outgoing[q].append(mine.index_select(1, at).reshape(-1))
                incoming[q].append(got[q])
            intos = None if into is None else [intos[k] for _, _, intos, _ in members]
            landing.append((intos, got, shard_at, dtype, device))

        def settle() -> None:
            shards = []
            for intos, got, shard_at, dtype, device in landing:
                if intos is None:  # new flat shards, zero-padded: the stack's rows
                    stack = torch.zeros(n, layout.shard, dtype=dtype, device=device)
                else:  # written into the given ones, their padding as it is
                    stack = torch.stack([t.view(-1) for t in intos])
                for at, values in zip(shard_at, got):
                    stack.index_copy_(1, at, values.view(n, -1).to(stack.dtype))
                if intos is None:
                    shards.append(stack.unbind(0))
                    continue
                for into, written in zip(intos, stack):
                    into.view(-1).copy_(written)
                shards.append(intos)
            for u, (_, _, _, then) in enumerate(members):
                then([of_k[u] for of_k in shards])

        self.exchange.add(layout, outgoing, incoming, per_unit * n, settle)


def _unit_bytes(member: tuple) -> int:
    """The bytes of flat shards a member's unit moves: one shard per item of
    its tensors (a flat shard, or a list of rows of the first's dtype)."""
    layout, tensors = member[0], member[1]
    return sum(layout.shard * (t if isinstance(t, torch.Tensor) else t[0]).element_size() for t in tensors)


def _chunks(n: int, unit_bytes: int, params: int, limit: float) -> list[tuple[int, int]]:
    """``(start, count)`` of the stacks ``n`` alike units move in: at most a
    bucket of flat shards (``limit`` bytes, ``unit_bytes`` a unit), and at
    most a block of pieces a state key (:data:`hyperdsd.blocks.BLOCK`), so
    that each stack's pieces stay in cache while it is cut apart (one stack of
    50,000 pieces cost a fifth more a key than stacks of a block)."""
    step = max(1, min(int(limit // max(unit_bytes, 1)), blocks.BLOCK // max(params, 1)))
    return [(at, step) for at in range(0, n, step)]
