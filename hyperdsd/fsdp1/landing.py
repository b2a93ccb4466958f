"""A load's end on an FSDP1 model, through its twin (:class:`hyperdsd.fsdp1.twin.Twin`).

Once a load is planned against the twin, :class:`TwinLoad` lands a
broadcast's pieces straight in FSDP1's flat parameters' shards (:meth:`TwinLoad.land`:
each rank is sent its flat shard's runs of each parameter and per-element
state tensor, no rows in between); once it is agreed and applied to the
twin, :meth:`TwinLoad.write_back` writes what the twin holds into FSDP1's
flat shards, its optimizers' state and their param groups.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView
from dataclasses import dataclass
from functools import partial

import torch

from .. import _compat
from ..state import model as model_state
from ..state.loading.plan import Prepared
from ..tree import is_container, leaves, rebuild
from . import stacks
from . import unit_moves as moves
from .places import Places
from .summaries import at_path, entry_paths, per_element
from .twin import Twin
from .units import stand_in

_STRUCTURAL = ("params", "param_names")
_ABSENT = object()  # (a path no shard was made for)


@dataclass
class _Landed:
    """Per-element state at one path of one unit that a broadcast delivered as laid out in a flat parameter's shard."""

    params: KeysView[int]  # the unit's parameters whose pieces landed
    # Laid out as this rank's flat shard: a buffer, or the flat parameter's own
    # state (in place); None: each original parameter's own state (in place).
    shard: torch.Tensor | None
    in_place: bool


class TwinLoad:
    """One load into an FSDP1 model and its optimizers, through their twin."""

    def __init__(self, twin: Twin):
        self.twin = twin
        self.units, self.params = twin.units, twin.params
        self.landed: set[tuple[int, int]] = set()  # (unit, parameter) a broadcast delivered to the flat shards
        self.state_landed: dict[int, dict[tuple, _Landed]] = {}  # unit -> path -> what a broadcast delivered
        self._stand_ins: dict[tuple, torch.Tensor] = {}
        self.places = Places(self.units)
        # id of each real parameter an optimizer steps -> (that optimizer, its twin)
        self.owner = {
            id(p): (opt, twin_opt)
            for opt, twin_opt in zip(twin.real_optims, twin.optims)
            for g in opt.param_groups
            for p in g["params"]
        }

    # -- landing a broadcast ----------------------------------------------------

    def land(self, model_plan, optim_plan) -> None:
        """Route a broadcast load's pieces straight into FSDP1's flat parameters' shards:
        each rank is sent the part of each parameter, and of each per-element
        state tensor, its flat shard holds (not its rows, which
        :meth:`write_back` would then exchange), so it receives no more than
        its shard. Called after planning, before the agreement; the pieces
        arrive only once every rank has agreed."""
        where = {id(t): (k, i) for k, twins in enumerate(self.params) for i, t in enumerate(twins)}
        for plan in (model_plan, optim_plan):
            if plan is not None:
                plan.expand()  # (a receiver per tensor, each routed on its own)
        if model_plan is not None:
            targets, _ = model_state.load_targets(self.twin.model, self.twin.index)
            by_unit: dict[int, list[tuple[int, Prepared]]] = {}
            for raw, value in model_plan.values.items():
                hit = where.get(id(targets.get(raw)))
                if hit is None or getattr(value, "meta", None) is None or raw in model_plan.on_meta:
                    continue
                by_unit.setdefault(hit[0], []).append((hit[1], value))
            for k, values in by_unit.items():
                ids = [i for i, _ in values]
                for (_, value), landing in zip(values, self.places.in_shard(k, ids, self.units[k].unit.local.view(-1))):
                    value.landing = landing
                self.landed.update((k, i) for i in ids)
        if optim_plan is not None and not self.twin.load_hooked:  # (load hooks see the twin's state: it stays there)
            found: dict[tuple[int, tuple], dict[int, Prepared]] = {}  # (unit, path) -> per-element leaf by parameter
            for load in optim_plan.params:
                hit = where.get(id(load.param))
                if hit is None or not load.entry:
                    continue
                k, i = hit
                shape = self.units[k].unit.shapes[i]  # (a torch.Size)
                for key, value in load.entry.items():
                    if isinstance(value, Prepared):  # (most state: no walk)
                        pairs: Iterable = (((key,), value),)
                    elif is_container(value):
                        pairs = leaves(value, (key,))
                    else:
                        continue
                    for path, leaf in pairs:
                        planned = isinstance(leaf, Prepared) and leaf.meta is not None and leaf.layout is not None
                        if planned and shape and tuple(leaf.meta.shape) == shape:
                            found.setdefault((k, path), {})[i] = leaf
            for (k, path), leaves_of in found.items():
                self._land_state(k, path, leaves_of)
            if self.twin.hollow_state:
                self._make_real(optim_plan, where)

    def _make_real(self, plan, where: dict[int, tuple[int, int]]) -> None:
        """A hollow twin's state (:attr:`Twin.hollow_state`): a per-element value loaded but not
        landed in the flat shards gets rows of its own, in its entry and as its receiver's dest."""
        for load in plan.params:
            hit, entry = where.get(id(load.param)), load.opt.state.get(load.param)
            if hit is None or not entry or not load.entry:
                continue  # (not a twin parameter's, or nothing loaded or held)
            for key, value in entry.items():
                leaf = load.entry.get(key)
                if id(value) not in self.twin.hollow_ids or getattr(leaf, "landing", None) is not None:
                    continue
                entry[key] = real = self.twin.real_rows(*hit, value.dtype)
                if isinstance(leaf, Prepared) and leaf.dest is not None:
                    leaf.dest = real if leaf.dest is value else _compat.local_tensor(real)

    def _land_state(self, k: int, path: tuple, leaves_of: dict[int, Prepared]) -> None:
        """Land the per-element state at ``path`` of unit ``k``'s parameters
        (``leaves_of``, by parameter) as laid out in the flat parameters' shards (:attr:`state_landed`):
        straight into the optimizer's own state where the load replaces all of
        it and it fits, else into a buffer :meth:`_write_unit` copies from. The
        twin's state becomes a stand-in of no memory."""
        u = self.units[k]
        dtype = next(iter(leaves_of.values())).meta.dtype
        whole = len(leaves_of) == len(u.fqns) and all(leaf.meta.dtype == dtype for leaf in leaves_of.values())
        into = self._in_place(k, path, dtype) if whole else None
        in_place = into is not None
        if in_place:
            shard = into[0][0] if u.unit.params is None else None
        else:
            shard = torch.zeros(u.shard, dtype=dtype, device=u.unit.local.device)
        self.state_landed.setdefault(k, {})[path] = _Landed(leaves_of.keys(), shard, in_place)
        if in_place and shard is None:  # (each original parameter's own state)
            landings = self.places.in_own(k, leaves_of, into)
        else:
            landings = self.places.in_shard(k, list(leaves_of), shard)
        made: dict[tuple, torch.Tensor] = {}  # (a stand-in by layout, dtype and device: a few a unit)
        for leaf, landing in zip(leaves_of.values(), landings):
            kind = (id(leaf.layout), leaf.meta.dtype, leaf.device)
            local = made.get(kind)
            if local is None:
                local = made[kind] = stand_in(self._stand_ins, *kind[1:], leaf.layout.local_shape)
            leaf.landing, leaf.local, leaf.dest, leaf.owned = landing, local, None, True

    def _in_place(self, k: int, path: tuple, dtype: torch.dtype) -> dict[int, tuple] | None:
        """For each of unit ``k``'s parameters, the optimizer's own state at
        ``path`` its piece lands in, and where that starts in this rank's flat
        shard: the flat parameter's (use_orig_params=False) or each original
        parameter's (True). None if any is missing or does not fit."""
        u = self.units[k]

        def own(p, numel):
            opt = self.owner.get(id(p), (None, None))[0]
            value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
            fits = isinstance(value, torch.Tensor) and value.dtype == dtype and value.is_contiguous()
            if not fits or value.numel() != numel:
                return None
            return value if value.dim() == 1 else value.view(-1)

        if u.unit.params is None:
            shard = own(u.unit.flat_param, u.shard)
            return None if shard is None else dict.fromkeys(range(len(u.fqns)), (shard, 0))
        out = dict.fromkeys(range(len(u.fqns)), (None, 0))  # (none of its elements here: nothing lands)
        for i, start, numel in u.here:
            mine = own(u.unit.params[i], numel)
            if mine is None:
                return None
            out[i] = (mine, start)
        return out

    # -- writing back ----------------------------------------------------------

    def write_back(self, model_plan, optim_plan) -> None:
        """Write what the twin now holds into the FSDP1 model and optimizers
        (after a load, whose plans are given, has been agreed and applied to
        the twin; None: that part was not loaded)."""
        if model_plan is not None:
            # (a broadcast that landed every parameter in its flat shards, on every rank alike, has no rows to move)
            if len(self.landed) < sum(map(len, self.params)):
                only = self._settle_rows(model_plan) if self.twin.lazy_rows else [None] * len(self.units)
                batch = stacks.ShardsBatch()
                for k, (u, twins, keep) in enumerate(zip(self.units, self.params, only)):
                    keep = set(range(len(twins))) if keep is None else keep
                    keep = {i for i in keep if (k, i) not in self.landed}  # in their flat shards already
                    if not keep:  # (the same on every rank: what some rank loaded, and the plan)
                        continue
                    rows = [_compat.local_tensor(t) for t in twins]
                    if len(keep) == len(twins):
                        batch.add(u, [rows], [u.unit.local], then=lambda _shards: None)  # (written: no more)
                    else:
                        moves.to_shard_many(u, [rows], [u.unit.local], only=keep, exchange=batch.exchange)
                batch.run()
            for u in self.units:
                if u.unit.unsharded:  # the copy a forward left would go on serving the old values
                    _compat.fsdp1_reshard(u.unit.module)
        if optim_plan is not None:
            if self.twin.lazy_state:
                self._refill_state(optim_plan)
            self._write_optimizers()

    def _settle_rows(self, plan) -> list[set[int]]:
        """Lazy rows: for each unit, the parameters some rank loaded (the
        rest of its flat shards stays as it is); where only some ranks did,
        the others' rows are read from the flat shards first."""
        targets, _ = model_state.load_targets(self.twin.model, self.twin.index)
        loaded = {id(targets[raw]) for raw in plan.values if raw in targets}
        mine = [[id(t) in loaded for t in twins] for twins in self.params]
        only = []
        exchange = moves.Exchange()
        for u, twins, here, (some, lacking) in zip(self.units, self.params, mine, moves.anywhere(self.units, mine)):
            if any(s and n for s, n in zip(some, lacking)):
                rows = moves.to_rows(u, u.unit.local, exchange)
                exchange.after(partial(_copy_rows, [None if h else t for t, h in zip(twins, here)], rows))
            only.append({i for i, s in enumerate(some) if s})
        exchange.run()
        return only

    def _refill_state(self, plan) -> None:
        """Lazy state: the twin's per-element state of parameters the load left
        untouched on some rank is read from the optimizers now (unit by unit,
        where any rank needs it), as an eager twin would have read it."""
        touched = {id(load.param) for load in plan.params}
        opt_of = {id(p): twin for twin in self.twin.optims for g in twin.param_groups for p in g["params"]}
        mine = [
            [id(t) not in touched and bool(opt_of[id(t)].state.get(t)) if id(t) in opt_of else False for t in twins]
            for twins in self.params
        ]
        exchange = moves.Exchange()
        for k, (u, twins, here, (some, _), (targets, typed)) in enumerate(
            zip(self.units, self.params, mine, moves.anywhere(self.units, mine), self.twin.state_plans)
        ):
            if not typed or not any(some):
                continue
            for (path, _), rows in zip(typed, self.twin.state_rows(u, targets, typed, exchange)):
                entries = [opt_of[id(t)].state[t] if here[i] else None for i, t in enumerate(twins)]
                exchange.after(partial(self._refilled, k, path, entries, rows))
        exchange.run()

    def _refilled(self, k: int, path: tuple, entries: list, rows: list[torch.Tensor]) -> None:
        """Copy each of ``rows`` into the per-element value at ``path`` of its twin entry (None: not
        refilled); a hollow one, shared, is replaced there by its own (hollow state is never nested)."""
        for i, (entry, row) in enumerate(zip(entries, rows)):
            value = at_path(entry, path) if entry is not None else None
            if id(value) in self.twin.hollow_ids:
                entry[path[0]] = self.twin.real_rows(k, i, value.dtype, row)
            elif per_element(value):
                _compat.local_tensor(value).copy_(row)

    def _write_optimizers(self) -> None:
        for opt, twin in zip(self.twin.real_optims, self.twin.optims):
            for real_group, twin_group in zip(opt.param_groups, twin.param_groups):
                for key, value in twin_group.items():
                    if key not in _STRUCTURAL:
                        real_group[key] = value
        managed = set()
        per_unit = list(zip(self.params, self.twin.optimizer_params()))
        # Units' sharded state moves a bucket at a time (alike units stacked,
        # :mod:`.stacks`), and each unit is written once its own has come: a rank
        # never holds more than about a bucket of sharded state beside the optimizer's.
        batch = stacks.ShardsBatch()
        for k, (twins, params) in enumerate(per_unit):
            managed.update(id(p) for p in params)
            entries, found = self._unit_entries(k, twins, params)
            if k in self.state_landed:  # (some state landed in its flat shards: path by path)
                shards = {path: self._shard_of(k, path, dtype, entries, batch.exchange) for path, dtype in found}
                batch.exchange.after(partial(self._write_unit, k, params, entries, shards))
            else:
                rows_of = [self._rows_of(k, path, dtype, entries) for path, dtype in found]
                write = partial(self._write_shards, k, params, entries, found)
                batch.add(self.units[k], rows_of, [None] * len(found), then=write)
        batch.run()
        for opt, twin in zip(self.twin.real_optims, self.twin.optims):
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) in managed:
                        continue
                    if p in twin.state and twin.state[p]:
                        opt.state[p] = twin.state[p]
                    else:
                        opt.state.pop(p, None)

    def _unit_entries(self, k: int, twins: list, params: list) -> tuple[list, list]:
        """Unit ``k``'s twin state entries (one per parameter), and the path and
        dtype of each per-element tensor among them (nested too), in order."""
        if self.units[k].unit.params is None:  # (every parameter's state in the flat parameter's optimizer)
            opt_twin = self.owner.get(id(params[0]), (None, None))[1]
            entries = list(map(opt_twin.state.get, twins)) if opt_twin is not None else [None] * len(twins)
        else:
            entries = []
            for p, twin in zip(params, twins):
                opt_twin = self.owner.get(id(p), (None, None))[1]
                entries.append(opt_twin.state.get(twin) if opt_twin is not None else None)
        return entries, entry_paths(entries)

    def _write_shards(self, k: int, params: list, entries: list, found: list, shards: list) -> None:
        self._write_unit(k, params, entries, {path: (shard, dtype) for (path, dtype), shard in zip(found, shards)})

    def _write_unit(self, k: int, params: list, entries: list, shards: dict) -> None:
        u = self.units[k]
        by_flat_param = u.unit.params is None
        shards = {path: None if f is None else f[0].to(f[1]) for path, f in shards.items()}  # (.to: the same if equal)
        every = [e for e in entries if e]  # (a flat parameter's: its parameters' entries, any will do)
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        # (use_orig_params=True: a parameter with none of its elements here is never stepped
        # by this rank, and the load has nothing for it)
        for j, start, numel in ((0, 0, u.shard),) if by_flat_param else u.here:
            p = params[j]
            opt, _ = self.owner.get(id(p), (None, None))
            if opt is None:
                continue
            mine = every if by_flat_param else [e for e in entries[j : j + 1] if e]
            where = (start, numel)
            if not mine:
                opt.state.pop(p, None)
                continue
            current = opt.state.get(p) or {}
            # A flat shard's padding belongs to no parameter: a load leaves what the optimizer holds there.
            valid = u.unpadded if by_flat_param else where[1]

            def written(value, path, current=current, where=where, valid=valid):
                old = current.get(path[0]) if len(path) == 1 else at_path(current, path)
                shard = shards.get(path, _ABSENT)
                if shard is None:
                    return old  # landed in place
                if shard is not _ABSENT:
                    piece = shard[where[0] : where[0] + where[1]]
                    if isinstance(old, torch.Tensor) and old.shape == piece.shape and old.dtype == piece.dtype:
                        whole = valid == piece.shape[0]  # (else the padding at the end stays as it is)
                        dests.append(old if whole else old[:valid])
                        sources.append(piece if whole else piece[:valid])
                        return old
                    return piece.clone()
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                    dests.append(old)
                    sources.append(value)
                    return old
                return value

            opt.state[p] = {
                key: rebuild(value, written, (key,)) if is_container(value) else written(value, (key,))
                for key, value in mine[0].items()
            }
        if dests:  # (each into the optimizer's own tensor, in one call)
            _compat.copy_each(dests, sources)

    def _rows_of(self, k: int, path: tuple, dtype: torch.dtype, entries: list) -> list[torch.Tensor]:
        """This rank's rows of the state at ``path`` of each of unit ``k``'s
        parameters, from the twin's ``entries`` (zeros where one has none)."""
        u = self.units[k]
        rows = []
        for i, e in enumerate(entries):
            value = e.get(path[0]) if e and len(path) == 1 else at_path(e or {}, path)
            if per_element(value):
                rows.append(_compat.local_tensor(value))
            else:
                rows.append(torch.zeros(u.local_shape(i), dtype=dtype, device=u.unit.local.device))
        return rows

    def _shard_of(self, k: int, path: tuple, dtype: torch.dtype, entries: list, exchange) -> tuple | None:
        """This rank's flat shard of the state at ``path`` of unit ``k``, some of
        which a broadcast landed there already: the rest through ``exchange``
        (filled when it runs), with the dtype it is to have. None: it landed
        in the optimizer's own state, which holds it now."""
        u = self.units[k]
        landed = self.state_landed.get(k, {}).get(path)
        if landed is None:
            return moves.to_shard(u, self._rows_of(k, path, dtype, entries), exchange=exchange), dtype
        others = {i for i, e in enumerate(entries) if per_element(at_path(e or {}, path))}
        for i in set(range(len(entries))) - others:
            if i in landed.params and landed.shard is not None:
                # landed, then dropped (a placeholder state nobody filled): zeros, as if never landed
                for _, a, b in u.held(u.index, [i]):
                    landed.shard[a - u.index * u.shard : b - u.index * u.shard].zero_()
        others.difference_update(landed.params)  # the same on every rank: the plan and its answers are
        if others:  # (never in place: every parameter landed there)
            rows = self._rows_of(k, path, dtype, entries)
            moves.to_shard_many(u, [rows], [landed.shard], only=others, exchange=exchange)
        if landed.in_place:
            return None
        return landed.shard, dtype


def _copy_rows(into: list, rows: list[torch.Tensor]) -> None:
    """Copy each of ``rows`` into its tensor of ``into`` (a DTensor's local tensor; None: not copied)."""
    for target, row in zip(into, rows):
        if target is not None:
            _compat.local_tensor(target).copy_(row)
