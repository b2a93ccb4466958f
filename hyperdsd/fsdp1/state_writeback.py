"""A load's optimizer part written back into an FSDP1 model's optimizers,
from its twin (:class:`hyperdsd.fsdp1.twin.FSDP1Twin`), once the load is
agreed and applied to the twin: the twin's param groups' fields, each
unit's per-element state into its flat shards' layout (what a broadcast
landed there, :class:`hyperdsd.fsdp1.landing.BroadcastLanding`, stays or is
copied from), the rest of each entry as the twin holds it."""

from __future__ import annotations

from functools import partial

import torch

from .. import _compat
from ..tree import is_container, rebuild
from . import stacks
from . import unit_moves as moves
from .landing import LandedState
from .summaries import at_path, entry_paths, per_element
from .twin import FSDP1Twin

_STRUCTURAL = ("params", "param_names")
_ABSENT = object()  # (a path no shard was made for)


class StateWriteBack:
    """The twin optimizers' groups and state written into the FSDP1 model's optimizers."""

    def __init__(self, twin: FSDP1Twin, owner: dict[int, tuple], state_landed: dict[int, dict[tuple, LandedState]]):
        self.twin = twin
        self.units, self.params = twin.units, twin.params
        self.owner = owner  # id of each real parameter an optimizer steps -> (that optimizer, its twin)
        self.state_landed = state_landed  # unit -> path -> what a broadcast delivered

    def run(self) -> None:
        """Write the twin optimizers' group fields and state into the real optimizers."""
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
