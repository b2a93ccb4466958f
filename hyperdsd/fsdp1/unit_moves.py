"""FSDP1's flat shards to rows and back: one exchange for a set of tensors of many units.

An FSDP1 rank holds a contiguous run of its unit's flat parameter (or of a
state tensor laid out like it); the canonical layout gives it whole rows of
each parameter (:class:`hyperdsd.fsdp1.units.UnitLayout`). :func:`to_rows`
and :func:`to_shard` move exactly the elements whose holder and owner
differ, among the ranks the unit is sharded over (a replica of HYBRID_SHARD
moves within itself): no rank ever holds more than its shard in either
layout, plus what is in flight (:mod:`.full_moves` makes full tensors
straight from the flat shards, :mod:`.stacks` moves alike units at once).
Every rank computes the same plan from the unit's shapes alone.
:class:`Exchange` runs the moves of many units together, one collective
per process group and bucket rather than one per unit: on a model of
hundreds of units a collective's latency, not its bytes, was the cost.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..transport.collectives import BUCKET_BYTES, DIRECT_BYTES, as_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _move(layout, outgoing: list[list[torch.Tensor]], incoming: list[list[torch.Tensor]]) -> None:
    """Send ``outgoing[q]`` (contiguous 1-D pieces, in order) to shard rank
    ``q``; fill ``incoming[r]`` (contiguous 1-D views of the sent pieces'
    dtype, in the order rank ``r`` sends them) from each rank ``r``. Pieces of
    :data:`DIRECT_BYTES` or more go point to point, straight from where they
    are into where they land; the rest in one all-to-all of bytes (which
    every rank joins, whether or not it has any)."""
    me, pg = layout.index, layout.unit.pg
    for src, dst in zip(outgoing[me], incoming[me]):
        dst.copy_(src)
    if layout.size == 1:
        return
    peers = [r for r in range(layout.size) if r != me]
    works = []
    small_in: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    small_out: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    for r in peers:  # the same pieces, in the same order, as rank r lists for this one: the same tags
        for tag, dst in enumerate(incoming[r]):
            if _nbytes(dst) >= DIRECT_BYTES:
                works.append(dist.irecv(dst, src=dist.get_global_rank(pg, r), group=pg, tag=tag))
            elif dst.numel():
                small_in[r].append(dst)
    for q in peers:
        for tag, src in enumerate(outgoing[q]):
            if _nbytes(src) >= DIRECT_BYTES:
                works.append(dist.isend(src, dst=dist.get_global_rank(pg, q), group=pg, tag=tag))
            elif src.numel():
                small_out[q].append(as_bytes(src))
    sends = [p for q in small_out for p in q]
    send = torch.cat(sends) if sends else torch.empty(0, dtype=torch.uint8, device=layout.unit.local.device)
    in_sizes = [sum(_nbytes(t) for t in q) for q in small_in]
    recv = torch.empty(sum(in_sizes), dtype=torch.uint8, device=send.device)
    out_sizes = [sum(p.numel() for p in q) for q in small_out]
    dist.all_to_all_single(recv, send, output_split_sizes=in_sizes, input_split_sizes=out_sizes, group=pg)
    dsts = [t for q in small_in for t in q]
    if dsts:  # (each piece cut from the bytes received and copied into its place in one call)
        sizes = list(map(_nbytes, dsts))
        try:
            torch.split_with_sizes_copy(recv, sizes, out=[d.view(torch.uint8) for d in dsts])
        except RuntimeError:  # a piece on another device than the bytes: copied one by one
            for dst, piece in zip(dsts, recv.split(sizes)):
                dst.view(torch.uint8).copy_(piece)
    for work in works:
        work.wait()


class Exchange:
    """The moves of many units, run together: one all-to-all of the small
    pieces (and the large ones point to point) per process group, not one
    per unit. Every rank of a group adds the same units' moves in the same
    order; what a move fills is ready once :meth:`run` returns (its ``after``
    callbacks run then). Moves of more than ``limit`` bytes of flat shards
    in all (a measure every rank of a group computes alike) run as they come,
    so that no rank holds more than about one bucket in flight."""

    def __init__(self, limit: float | None = None):
        self.limit = BUCKET_BYTES if limit is None else limit
        self._pending: list[tuple[Any, list, list]] = []
        self._after: list[Callable[[], None]] = []
        self._bytes = 0

    def add(self, layout, outgoing: list[list], incoming: list[list], nbytes: int, after=None) -> None:
        """Add a unit's move: ``outgoing[q]`` to shard rank ``q``, ``incoming[r]``
        filled from rank ``r`` (as :func:`_move`); ``nbytes``, its flat shards' bytes."""
        self._pending.append((layout, outgoing, incoming))
        if after is not None:
            self._after.append(after)
        self._bytes += nbytes
        if self._bytes >= self.limit:
            self.run()

    def after(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the moves added so far have run."""
        self._after.append(fn)

    def run(self) -> None:
        pending, after = self._pending, self._after
        self._pending, self._after, self._bytes = [], [], 0
        by_pg: dict[int, tuple[Any, list, list]] = {}
        for layout, outgoing, incoming in pending:
            key = id(layout.unit.pg)
            if key not in by_pg:
                by_pg[key] = (layout, [[] for _ in range(layout.size)], [[] for _ in range(layout.size)])
            _, outs, ins = by_pg[key]
            for q in range(layout.size):
                outs[q] += outgoing[q]
                ins[q] += incoming[q]
        for layout, outs, ins in by_pg.values():
            _move(layout, outs, ins)
        for fn in after:
            fn()


def run_or_add(layout, outgoing, incoming, nbytes: int, exchange: Exchange | None, after=None) -> None:
    """Move now, or as part of ``exchange``."""
    if exchange is None:
        _move(layout, outgoing, incoming)
        if after is not None:
            after()
    else:
        exchange.add(layout, outgoing, incoming, nbytes, after)


def to_rows(layout, shard: torch.Tensor, exchange: Exchange | None = None) -> list[torch.Tensor]:
    """This rank's rows of each of the unit's parameters (new tensors), from
    ``flat``, this rank's flat shard of them (the parameter's or a state
    tensor's). A collective over the unit's ranks (or a part of ``exchange``)."""
    return to_rows_many(layout, [shard], exchange)[0]


def to_rows_many(layout, shards: list[torch.Tensor], exchange: Exchange | None = None) -> list[list[torch.Tensor]]:
    """:func:`to_rows` of each of ``shards``, in one exchange."""
    plan = layout.index_plan()
    if plan is not None:
        return _to_rows_indexed(layout, plan, shards, exchange)
    me, base = layout.index, layout.index * layout.shard
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    starts = layout.starts(me)
    sent = [layout.pieces(me, q) for q in range(layout.size)]
    plans = [layout.pieces(r, me) for r in range(layout.size)]
    result = []
    for shard in shards:
        shard = shard.detach().reshape(-1)
        out = [torch.empty(layout.local_shape(i), dtype=shard.dtype, device=shard.device) for i in range(len(starts))]
        views = [t.view(-1) for t in out]
        for q, plan in enumerate(sent):
            outgoing[q] += [shard[a - base : b - base] for _, a, b in plan]
        for r, plan in enumerate(plans):
            incoming[r] += [views[i][a - starts[i] : b - starts[i]] for i, a, b in plan]
        result.append(out)
    run_or_add(layout, outgoing, incoming, shard_bytes(layout, [f.dtype for f in shards]), exchange)
    return result


def _to_rows_indexed(layout, plan, shards: list[torch.Tensor], exchange) -> list[list[torch.Tensor]]:
    """:func:`to_rows_many` of a unit of many small parameters: what goes to
    each rank taken from the flat shard by one index, what comes from each
    put in place by another, the rows cut apart in one copy."""
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    shapes = layout.local_shapes()
    result, received = [], []
    for shard in shards:
        shard = shard.detach().reshape(-1)
        shard_at, rows_at, _ = plan.on(shard.device)
        out = [torch.empty(shape, dtype=shard.dtype, device=shard.device) for shape in shapes]
        got = [torch.empty(len(at), dtype=shard.dtype, device=shard.device) for at in rows_at]
        for q, at in enumerate(shard_at):
            outgoing[q].append(shard.index_select(0, at))
            incoming[q].append(got[q])
        result.append(out)
        received.append(got)

    def settle() -> None:
        for out, got in zip(result, received):
            rows = torch.empty(plan.total, dtype=got[0].dtype, device=got[0].device)
            rows.index_copy_(0, plan.on(rows.device)[2], torch.cat(got))
            torch.split_with_sizes_copy(rows, plan.numels, out=[t.view(-1) for t in out])

    run_or_add(layout, outgoing, incoming, shard_bytes(layout, [f.dtype for f in shards]), exchange, settle)
    return result


def shard_bytes(layout, dtypes) -> int:
    """The bytes of flat shards of ``dtypes``: the same on every rank of the unit."""
    return sum(layout.shard * dtype.itemsize for dtype in dtypes)


def _shard_target(layout, rows: list[torch.Tensor], into) -> tuple[torch.dtype, torch.device, torch.Tensor]:
    """What :func:`to_shard_many` makes of one of its ``rows_of``: the dtype they
    move in, the device they land on, and the flat shard written (``into``, or
    a new zero-padded one)."""
    dtype = rows[0].dtype if rows else into.dtype
    device = into.device if into is not None else rows[0].device
    return dtype, device, into if into is not None else torch.zeros(layout.shard, dtype=dtype, device=device)


def to_shard(
    layout, rows: list[torch.Tensor], into: torch.Tensor | None = None, exchange: Exchange | None = None
) -> torch.Tensor:
    """This rank's flat shard made from every rank's ``rows`` (this rank's rows
    of each parameter, as :func:`to_rows` gives them): written into ``into``
    (its padding left as it is) or a new zero-padded tensor. A collective
    over the unit's ranks (or a part of ``exchange``)."""
    return to_shard_many(layout, [rows], [into], exchange=exchange)[0]


def to_shard_many(
    layout,
    rows_of: list[list[torch.Tensor]],
    intos: list,
    only: set[int] | None = None,
    exchange: Exchange | None = None,
) -> list:
    """:func:`to_shard` of each of ``rows_of`` (into each of ``intos``), in one
    exchange; ``only``: of these parameters alone (the same on every rank),
    the rest of each flat shard left as it is."""
    plan = layout.index_plan() if (only is None or len(only) == len(layout.fqns)) and all(rows_of) else None
    if plan is not None:
        return _to_shard_indexed(layout, plan, rows_of, intos, exchange)
    me, base = layout.index, layout.index * layout.shard
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    starts = layout.starts(me)
    sent = [[p for p in layout.pieces(q, me) if only is None or p[0] in only] for q in range(layout.size)]
    plans = [[p for p in layout.pieces(me, r) if only is None or p[0] in only] for r in range(layout.size)]
    result, landings, dtypes = [], [], []
    for rows, into in zip(rows_of, intos):
        dtype, device, out = _shard_target(layout, rows, into)
        dtypes.append(dtype)
        shards = [r.detach().reshape(-1) for r in rows]
        for q, plan in enumerate(sent):
            outgoing[q] += [shards[i][a - starts[i] : b - starts[i]].to(device=device, dtype=dtype) for i, a, b in plan]
        direct = out.dtype == dtype and out.is_contiguous()  # else received aside, then copied in
        land = out.view(-1) if direct else torch.empty(layout.shard, dtype=dtype, device=device)
        for r, plan in enumerate(plans):
            incoming[r] += [land[a - base : b - base] for _, a, b in plan]
        result.append(out)
        landings.append(None if direct else land)

    def settle() -> None:
        for out, land in zip(result, landings):
            if land is not None:
                view = out.view(-1)
                for plan in plans:
                    for _, a, b in plan:
                        view[a - base : b - base] = land[a - base : b - base]

    run_or_add(layout, outgoing, incoming, shard_bytes(layout, dtypes), exchange, settle)
    return result


def _to_shard_indexed(layout, plan, rows_of: list[list[torch.Tensor]], intos: list, exchange) -> list:
    """:func:`to_shard_many` of every parameter of a unit of many small ones:
    this rank's rows joined, what goes to each rank taken from them by one
    index, what comes from each put in its flat shard by another."""
    outgoing: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    incoming: list[list[torch.Tensor]] = [[] for _ in range(layout.size)]
    result, received, dtypes = [], [], []
    for rows, into in zip(rows_of, intos):
        dtype, device, out = _shard_target(layout, rows, into)
        dtypes.append(dtype)
        shard_at, rows_at, _ = plan.on(device)
        mine = torch.cat([r.detach().reshape(-1) for r in rows]).to(device=device, dtype=dtype)
        got = [torch.empty(len(at), dtype=dtype, device=device) for at in shard_at]
        for q, at in enumerate(rows_at):
            outgoing[q].append(mine.index_select(0, at))
            incoming[q].append(got[q])
        result.append(out)
        received.append((got, shard_at))

    def settle() -> None:
        for out, (got, shard_at) in zip(result, received):
            view = out.view(-1)
            for at, values in zip(shard_at, got):
                view.index_copy_(0, at, values.to(view.dtype))

    run_or_add(layout, outgoing, incoming, shard_bytes(layout, dtypes), exchange, settle)
    return result
