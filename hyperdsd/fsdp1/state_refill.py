"""Lazy state refilled: a load's twin (:class:`hyperdsd.fsdp1.twin.FSDP1Twin`)
reads no per-element optimizer state up front; what the load leaves
untouched on some rank is read from the optimizers before the write-back
(:mod:`.state_writeback`), as an eager twin would have read it."""

from __future__ import annotations

from functools import partial

import torch

from .. import _compat
from . import unit_groups
from . import unit_moves as moves
from .summaries import at_path, per_element
from .twin import FSDP1Twin


def refill_state(twin: FSDP1Twin, plan) -> None:
    """Lazy state: the twin's per-element state of parameters the load left
    untouched on some rank is read from the optimizers now (unit by unit,
    where any rank needs it), as an eager twin would have read it."""
    touched = {id(load.param) for load in plan.params}
    opt_of = {id(p): opt for opt in twin.optims for g in opt.param_groups for p in g["params"]}
    mine = [
        [id(t) not in touched and bool(opt_of[id(t)].state.get(t)) if id(t) in opt_of else False for t in twins]
        for twins in twin.params
    ]
    exchange = moves.Exchange()
    for k, (u, twins, here, (some, _), (targets, typed)) in enumerate(
        zip(twin.units, twin.params, mine, unit_groups.anywhere(twin.units, mine), twin.state_plans)
    ):
        if not typed or not any(some):
            continue
        for (path, _), rows in zip(typed, twin.state_rows(u, targets, typed, exchange)):
            entries = [opt_of[id(t)].state[t] if here[i] else None for i, t in enumerate(twins)]
            exchange.after(partial(_refilled, twin, k, path, entries, rows))
    exchange.run()


def _refilled(twin: FSDP1Twin, k: int, path: tuple, entries: list, rows: list[torch.Tensor]) -> None:
    """Copy each of ``rows`` into the per-element value at ``path`` of its twin entry (None: not
    refilled); a hollow one, shared, is replaced there by its own (hollow state is never nested)."""
    for i, (entry, row) in enumerate(zip(entries, rows)):
        value = at_path(entry, path) if entry is not None else None
        if id(value) in twin.hollow_ids:
            entry[path[0]] = twin.real_rows(k, i, value.dtype, row)
        elif per_element(value):
            _compat.local_tensor(value).copy_(row)
