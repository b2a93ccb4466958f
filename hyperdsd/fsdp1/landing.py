"""A broadcast load landed straight in an FSDP1 model's flat shards, through
its twin (:class:`hyperdsd.fsdp1.twin.FSDP1Twin`).

Once a load is planned against the twin, :class:`BroadcastLanding` routes a
broadcast's pieces straight to FSDP1's flat parameters' shards (each rank is
sent its flat shard's runs of each parameter and per-element state tensor,
no rows in between) and records what it landed, which the write-back
(:mod:`.model_writeback`, :mod:`.state_writeback`) leaves where it is or
copies from.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView
from dataclasses import dataclass

import torch

from .. import _compat
from ..state import model as model_state
from ..state.loading.plan import Prepared
from ..tree import is_container, leaves
from .places import Places
from .summaries import at_path
from .twin import FSDP1Twin
from .units import stand_in


@dataclass
class LandedState:
    """Per-element state at one path of one unit that a broadcast delivered as laid out in a flat parameter's shard."""

    params: KeysView[int]  # the unit's parameters whose pieces landed
    # Laid out as this rank's flat shard: a buffer, or the flat parameter's own
    # state (in place); None: each original parameter's own state (in place).
    shard: torch.Tensor | None
    in_place: bool


def owners(twin: FSDP1Twin) -> dict[int, tuple]:
    """The id of each real parameter an optimizer steps -> (that optimizer, its twin)."""
    return {
        id(p): (opt, twin_opt)
        for opt, twin_opt in zip(twin.real_optims, twin.optims)
        for g in opt.param_groups
        for p in g["params"]
    }


class BroadcastLanding:
    """A broadcast load's pieces landed in an FSDP1 model's flat shards and its optimizers' state."""

    def __init__(self, twin: FSDP1Twin, owner: dict[int, tuple]):
        self.twin = twin
        self.units, self.params = twin.units, twin.params
        self.landed: set[tuple[int, int]] = set()  # (unit, parameter) a broadcast delivered to the flat shards
        self.state_landed: dict[int, dict[tuple, LandedState]] = {}  # unit -> path -> what a broadcast delivered
        self._stand_ins: dict[tuple, torch.Tensor] = {}
        self.places = Places(self.units)
        self.owner = owner  # (see owners)

    def land(self, model_plan, optim_plan) -> None:
        """Route a broadcast load's pieces straight into FSDP1's flat parameters' shards:
        each rank is sent the part of each parameter, and of each per-element
        state tensor, its flat shard holds (not its rows, which
        the write-back would then exchange), so it receives no more than
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
        """A hollow twin's state (:attr:`FSDP1Twin.hollow_state`): a per-element value loaded but not
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
        it and it fits, else into a buffer the write-back copies from
        (:mod:`.state_writeback`). The
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
        self.state_landed.setdefault(k, {})[path] = LandedState(leaves_of.keys(), shard, in_place)
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
