"""Where a broadcast's pieces land in an FSDP1 unit's flat shard.

A broadcast load sends each rank, of each parameter and per-element state
tensor, the run of elements its flat shard holds (:mod:`hyperdsd.fsdp1.landing`).
:class:`Places` works out those runs once per unit and the views they land in.
"""

from __future__ import annotations

import torch

from ..transport.delivery import Landing
from ..transport.needs import Need
from .units import UnitLayout

NOWHERE = Landing(None, None)  # (a piece no part of which this rank holds)


class Places:
    """The landings of one load's pieces in its units' flat shards."""

    def __init__(self, units: list[UnitLayout]):
        self.units = units
        self._runs: dict[tuple[int, int], Need] = {}  # (alike units' parameters share their runs)
        self._spans: dict[int, list] = {}  # unit -> its parameters' spans (see spans)

    def spans(self, k: int) -> list[tuple[Need, int, int] | None]:
        """For each of unit ``k``'s parameters, the run of its elements this
        rank's flat shard holds and where that lies in the shard, ``(need, lo,
        hi)``; None where it holds none. Made once a unit."""
        spans = self._spans.get(k)
        if spans is None:
            u = self.units[k]
            base = u.index * u.shard
            spans = self._spans[k] = [None] * len(u.fqns)
            for i, (a, b) in u.own_spans.items():
                run = (a - u.unit.offsets[i], b - u.unit.offsets[i])
                need = self._runs.get(run) or self._runs.setdefault(run, Need.run(*run))
                spans[i] = (need, a - base, b - base)
        return spans

    def in_shard(self, k: int, ids: list[int], shard: torch.Tensor) -> list[Landing]:
        """Where each of unit ``k``'s parameters ``ids`` lands in ``shard``, laid
        out as this rank's flat shard: the run of its elements the shard holds,
        if any. (A slice each: one ``tensor_split`` at the runs' ends took half as long again.)"""
        spans = self.spans(k)
        return [NOWHERE if spans[i] is None else Landing(spans[i][0], shard[spans[i][1] : spans[i][2]]) for i in ids]

    def in_own(self, k: int, ids, into: dict[int, tuple]) -> list[Landing]:
        """Where each of unit ``k``'s parameters ``ids`` lands in its own state
        tensor: ``into[i]`` is that tensor and where it starts in this rank's flat shard."""
        spans = self.spans(k)
        out = []
        for i in ids:
            span = spans[i]
            if span is None:
                out.append(NOWHERE)
                continue
            (need, lo, hi), (own, offset) = span, into[i]
            whole = lo == offset and hi - lo == own.numel()
            out.append(Landing(need, own if whole else own[lo - offset : hi - offset]))
        return out
