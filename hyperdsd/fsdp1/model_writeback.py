"""A load's model part written back into an FSDP1 model's flat shards, from
its twin (:class:`hyperdsd.fsdp1.twin.FSDP1Twin`), once the load is agreed and
applied to the twin; what a broadcast landed there already
(:class:`hyperdsd.fsdp1.landing.BroadcastLanding`) stays as it is."""

from __future__ import annotations

from functools import partial

import torch

from .. import _compat
from ..state import model as model_state
from . import stacks, unit_groups
from . import unit_moves as moves
from .twin import FSDP1Twin


def write_model(twin: FSDP1Twin, plan, landed: set[tuple[int, int]]) -> None:
    """Write the twin's parameters into the FSDP1 model's flat shards (after
    ``plan``, the load's, has been agreed and applied to the twin); those
    ``landed`` ((unit, parameter) a broadcast delivered there) are there already."""
    units, params = twin.units, twin.params
    # (a broadcast that landed every parameter in its flat shards, on every rank alike, has no rows to move)
    if len(landed) < sum(map(len, params)):
        only = _settle_rows(twin, plan) if twin.lazy_rows else [None] * len(units)
        batch = stacks.ShardsBatch()
        for k, (u, twins, keep) in enumerate(zip(units, params, only)):
            keep = set(range(len(twins))) if keep is None else keep
            keep = {i for i in keep if (k, i) not in landed}  # in their flat shards already
            if not keep:  # (the same on every rank: what some rank loaded, and the plan)
                continue
            rows = [_compat.local_tensor(t) for t in twins]
            if len(keep) == len(twins):
                batch.add(u, [rows], [u.unit.local], then=lambda _shards: None)  # (written: no more)
            else:
                moves.to_shard_many(u, [rows], [u.unit.local], only=keep, exchange=batch.exchange)
        batch.run()
    for u in units:
        if u.unit.unsharded:  # the copy a forward left would go on serving the old values
            _compat.fsdp1_reshard(u.unit.module)


def _settle_rows(twin: FSDP1Twin, plan) -> list[set[int]]:
    """Lazy rows: for each unit, the parameters some rank loaded (the
    rest of its flat shards stays as it is); where only some ranks did,
    the others' rows are read from the flat shards first."""
    targets, _ = model_state.load_targets(twin.model, twin.index)
    loaded = {id(targets[raw]) for raw in plan.values if raw in targets}
    mine = [[id(t) in loaded for t in twins] for twins in twin.params]
    only = []
    exchange = moves.Exchange()
    for u, twins, here, (some, lacking) in zip(twin.units, twin.params, mine, unit_groups.anywhere(twin.units, mine)):
        if any(s and n for s, n in zip(some, lacking)):
            rows = moves.to_rows(u, u.unit.local, exchange)
            exchange.after(partial(_copy_rows, [None if h else t for t, h in zip(twins, here)], rows))
        only.append({i for i, s in enumerate(some) if s})
    exchange.run()
    return only


def _copy_rows(into: list, rows: list[torch.Tensor]) -> None:
    """Copy each of ``rows`` into its tensor of ``into`` (a DTensor's local tensor; None: not copied)."""
    for target, row in zip(into, rows):
        if target is not None:
            _compat.local_tensor(target).copy_(row)
