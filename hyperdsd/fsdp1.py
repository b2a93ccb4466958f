"""FSDP1 models through a twin in hyperdsd's canonical layout.

:class:`Twin` reads an FSDP1 model and its optimizers into a twin (see
:mod:`hyperdsd.state.fsdp1`): each original parameter a DTensor sharded by
rows on the unit's mesh, its optimizer state per original parameter
(unflattened from the flat parameter's under ``use_orig_params=False``),
keyed by canonical FQN. Gets read the twin as they read an FSDP2 model (a
full get takes its tensors from the flat shards: :mod:`hyperdsd.fsdp1_stream`); a
set plans, checks and agrees against the twin, loads into it, and only then
:meth:`Twin.write_back` writes what changed into FSDP1's flat shards, its
optimizers' state and their param groups. Reading changes nothing: every
tensor of the twin that stands for flat state is new. A set's twin does not
read what the load overwrites: its rows start empty, and what some rank's
load leaves is read from the flat shards at write-back.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from . import _compat
from .errors import StateDictError
from .state import fsdp1 as layout_of
from .state.fqn import ModelIndex
from .state.fsdp1 import RowsAt, UnitLayout, at_path, merge, per_element_paths, summarize, twin_module, twin_optimizer
from .state.load_plan import Prepared
from .transport import fsdp1 as moves
from .transport.delivery import Landing
from .transport.scatter import Need
from .tree import leaves, rebuild

_STRUCTURAL = ("params", "param_names")


class Twin:
    """An FSDP1 model and its optimizers, in the canonical layout."""

    def __init__(self, model: torch.nn.Module, optimizers: tuple, modifiers_attr: str, to_load=False, stream=False):
        self.real_model = model
        self.real_optims = tuple(optimizers)
        # A full get's twin reads no rows: the gather takes the full tensors
        # from the flat shards (:mod:`hyperdsd.fsdp1_stream`). Optimizers whose
        # state_dict() runs hooks have their rows read, for the hooks to see.
        self.stream_rows = stream
        self.stream_state = stream and bool(self.real_optims) and all(map(_compat.plain_state_dict, self.real_optims))
        self.hollow: dict[int, tuple[int, int]] = {}  # id of a streamed state DTensor -> (key, parameter) in its unit
        # A load overwrites what it loads: the twin's flat state then starts
        # empty, and what a load leaves is read from the flat shards at write-back
        # only where some rank did not load it (:meth:`write_back`). An optimizer
        # load reads no parameter values (a scratch step steps zeros like them),
        # but its load hooks, which see the twin, might: the rows are read for them.
        hooked = any(h.pre or h.post for h in map(_compat.optimizer_load_hooks, self.real_optims))
        self.lazy_rows = to_load and not hooked
        self.lazy_state = to_load
        self.state_plans: list[tuple[list, list]] = []  # per unit: (targets, [(path, dtype)]) of its state rows
        self.landed: set[tuple[int, int]] = set()  # (unit, parameter) a broadcast delivered to the flat shards
        # unit -> path -> (flat buffer, parameters): per-element state a broadcast delivered in the flat layout
        self.state_landed: dict[int, dict[tuple, tuple[torch.Tensor, set[int]]]] = {}
        real = ModelIndex(model, modifiers_attr, fsdp1=True)
        self.units: list[UnitLayout] = []
        for module, raw in real.fsdp1_modules:
            unit = _compat.fsdp1_unit(module)
            if unit is None:
                continue
            if not unit.sharded:
                raise StateDictError(
                    f"FSDP1 module {raw[:-1] or '<root>'!r} uses NO_SHARD; hyperdsd reads FSDP1's sharded strategies "
                    "(use DDP for replicated training)"
                )
            fqns, aliases = layout_of.canonical_names(real, raw, unit)
            size, index = moves.shard_index(unit)
            mesh = moves.unit_mesh(unit, unit.flat.device.type)
            self.units.append(UnitLayout(unit, fqns, aliases, mesh, size, index))
        if self.lazy_rows or self.stream_rows:
            rows = [_blank_rows(u, u.unit.local.dtype, self.stream_rows) for u in self.units]
        else:
            rows = [moves.to_rows(u, u.unit.local) for u in self.units]
        self.model, self.params = twin_module(real, self.units, rows)
        self.index = ModelIndex(self.model, modifiers_attr)
        self.optims = self._twin_optimizers() if self.real_optims else ()

    # -- reading -------------------------------------------------------------

    def _optimizer_params(self) -> list[list]:
        """For each unit, the real parameters its optimizer state is keyed by:
        the flat parameter, or each original parameter (use_orig_params=True)."""
        return [[u.unit.flat] if u.unit.params is None else list(u.unit.params) for u in self.units]

    def _twin_optimizers(self) -> tuple:
        names = {id(t): fqn for u, twins in zip(self.units, self.params) for fqn, t in zip(u.fqns, twins)}
        expand: dict[int, list] = {}
        for u, twins in zip(self.units, self.params):
            if u.unit.params is None:
                expand[id(u.unit.flat)] = twins
            else:
                for p, t in zip(u.unit.params, twins):
                    expand[id(p)] = [t]
        owner = {id(p): opt for opt in self.real_optims for g in opt.param_groups for p in g["params"]}
        twins_of = {id(opt): twin_optimizer(opt, expand, names) for opt in self.real_optims}
        self._read_state(owner, twins_of)
        for opt in self.real_optims:  # parameters FSDP1 does not manage: their state as it is
            twin = twins_of[id(opt)]
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in expand and p in opt.state:
                        twin.state[p] = opt.state[p]
        return tuple(twins_of[id(opt)] for opt in self.real_optims)

    def _read_state(self, owner: dict, twins_of: dict) -> None:
        """Each unit's state, unflattened into the twin optimizers: what every
        rank holds is exchanged first (a rank without an original parameter's
        elements has no state for it), then per-element state moves to rows."""
        per_unit = self._optimizer_params()
        mine = []
        for u, params in zip(self.units, per_unit):
            summaries = []
            for j, p in enumerate(params):
                opt = owner.get(id(p))
                entry = opt.state.get(p) if opt is not None else None
                numel = u.shard if u.unit.params is None else (u.unit.in_shard[j] or (0, 0))[1]
                if not entry or (u.unit.params is not None and not numel):
                    # (use_orig_params=True: a rank without the parameter's elements never steps it;
                    # what it holds, such as Adagrad's state from its constructor, tells nothing)
                    summaries.append(None)
                    continue
                summaries.append(summarize(entry, numel))
            mine.append(summaries)
        everyone = moves.exchange_by_group(mine, [u.unit.pg for u in self.units])
        for u, params, twins, ranks in zip(self.units, per_unit, self.params, everyone):
            merged = [merge([r[j] for r in ranks]) for j in range(len(params))]
            for j, summary in enumerate(merged):
                if summary is None:
                    continue
                for key, (kind, detail) in summary.items():
                    if kind == "shape":
                        what = detail if isinstance(detail, str) else f"of shape {detail}"
                        owner_of = u.fqns if u.unit.params is None else u.fqns[j]
                        raise StateDictError(
                            f"optimizer state {key!r} of {owner_of} (an FSDP1 unit) is {what}: only "
                            "per-element and scalar state can be unflattened"
                        )
            targets = [(j, p, owner.get(id(p))) for j, p in enumerate(params)]
            found: dict[tuple, torch.dtype] = {}
            for summary in merged:
                for path, dtype in per_element_paths(summary or {}):
                    found.setdefault(path, dtype)
            typed = sorted(found.items(), key=lambda item: str(item[0]))  # (path, dtype): the same on every rank
            self.state_plans.append((targets, typed))
            if self.lazy_state or self.stream_state:
                by_key = [_blank_rows(u, dtype, self.stream_state) for _, dtype in typed]
            else:
                by_key = self._state_rows(u, targets, typed)
            placed: dict[tuple, Any] = {}  # (parameter, path) -> the twin's DTensor of those rows
            has = [{path for path, _ in per_element_paths(summary or {})} for summary in merged]
            for k, ((path, _), rows) in enumerate(zip(typed, by_key)):
                for i in range(len(twins)):
                    if path in has[0 if u.unit.params is None else i]:
                        value = placed[(i, path)] = u.layouts[i].wrap(rows[i])
                        if self.stream_state:
                            self.hollow[id(value)] = (k, i)
            for i, twin in enumerate(twins):
                j = 0 if u.unit.params is None else i
                summary, (_, p, opt) = merged[j], targets[j]
                if summary is None:
                    continue
                here = u.unit.params is None or (u.unit.in_shard[j] or (0, 0))[1]
                own = (opt.state.get(p) or {}) if here else {}  # a rank that never steps it: the holders' values
                twins_of[id(opt)].state[twin] = _twin_entry(summary, own, lambda path, i=i: placed[(i, path)])

    def _state_rows(self, u: UnitLayout, targets: list, typed: list) -> list[list[torch.Tensor]]:
        """This rank's rows of each state tensor ``typed`` names (path, dtype), in one exchange."""
        return moves.to_rows_many(u, [self._flat_state(u, targets, path, dtype) for path, dtype in typed])

    @staticmethod
    def _flat_state(u: UnitLayout, targets: list, path: tuple, dtype) -> torch.Tensor:
        """This rank's flat shard of the state at ``path``: the flat parameter's own, or
        assembled from the original parameters' pieces (zeros where none)."""
        if u.unit.params is None:
            _, p, opt = targets[0]
            value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
            if value is not None:
                return value
        flat = torch.zeros(u.shard, dtype=dtype, device=u.unit.local.device)
        if u.unit.params is not None:
            for j, p, opt in targets:
                value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
                where = u.unit.in_shard[j]
                if value is not None and where is not None and where[1]:
                    flat[where[0] : where[0] + where[1]] = value.reshape(-1)
        return flat

    # -- landing a broadcast ----------------------------------------------------

    def land(self, model_plan, optim_plan) -> None:
        """Route a broadcast load's pieces straight into FSDP1's flat layout:
        each rank is sent the part of each parameter, and of each per-element
        state tensor, its flat shard holds (not its rows, which
        :meth:`write_back` would then exchange), so it receives no more than
        its shard. Called after planning, before the agreement; the pieces
        arrive only once every rank has agreed."""
        where = {id(t): (k, i) for k, twins in enumerate(self.params) for i, t in enumerate(twins)}
        if model_plan is not None:
            targets = self.model.state_dict(keep_vars=True)
            for raw, value in model_plan.values.items():
                hit = where.get(id(targets.get(raw)))
                if hit is None or getattr(value, "meta", None) is None or raw in model_plan.on_meta:
                    continue
                k, i = hit
                value.landing = self._landing(k, i, self.units[k].unit.local.view(-1))
                self.landed.add((k, i))
        if optim_plan is not None:
            for load in optim_plan.params:
                hit = where.get(id(load.param))
                if hit is not None:
                    self._land_state(*hit, load.entry or {})

    def _land_state(self, k: int, i: int, entry: dict) -> None:
        """Land the per-element state of parameter ``i`` of unit ``k`` in a flat
        buffer per path (:attr:`state_landed`), which :meth:`_write_unit` writes
        into the optimizers. The twin's state becomes a stand-in of no memory."""
        u = self.units[k]
        shape = tuple(u.unit.shapes[i])
        for path, leaf in leaves(entry):
            if not isinstance(leaf, Prepared) or leaf.meta is None or leaf.layout is None:
                continue
            if not shape or tuple(leaf.meta.shape) != shape:
                continue
            by_path = self.state_landed.setdefault(k, {})
            if path not in by_path:
                by_path[path] = (torch.zeros(u.shard, dtype=leaf.meta.dtype, device=u.unit.local.device), set())
            buffer, landed = by_path[path]
            leaf.landing = self._landing(k, i, buffer)
            leaf.local = torch.zeros((), dtype=leaf.meta.dtype, device=leaf.device).expand(leaf.layout.local_shape)
            leaf.dest, leaf.owned = None, True
            landed.add(i)

    def _landing(self, k: int, i: int, flat: torch.Tensor) -> Landing:
        """Where parameter ``i`` of unit ``k`` lands in ``flat``, laid out as this
        rank's flat shard: the run of its elements the shard holds, if any."""
        u = self.units[k]
        held = u.held(u.index, [i])
        if not held:
            return Landing(None, None)
        _, a, b = held[0]
        start, base = u.unit.offsets[i], u.index * u.shard
        return Landing(Need.run(a - start, b - start), flat[a - base : b - base])

    # -- writing back ----------------------------------------------------------

    def write_back(self, model_plan, optim_plan) -> None:
        """Write what the twin now holds into the FSDP1 model and optimizers
        (after a load, whose plans are given, has been agreed and applied to
        the twin; None: that part was not loaded)."""
        if model_plan is not None:
            only = self._settle_rows(model_plan) if self.lazy_rows else [None] * len(self.units)
            for k, (u, twins, keep) in enumerate(zip(self.units, self.params, only)):
                keep = set(range(len(twins))) if keep is None else keep
                keep = {i for i in keep if (k, i) not in self.landed}  # in their flat shards already
                moves.to_flat_many(u, [[_compat.local_tensor(t) for t in twins]], [u.unit.local], only=keep)
                if u.unit.unsharded:  # the copy a forward left would go on serving the old values
                    _compat.fsdp1_reshard(u.unit.module)
        if optim_plan is not None:
            if self.lazy_state:
                self._refill_state(optim_plan)
            self._write_optimizers()

    def _settle_rows(self, plan) -> list[set[int]]:
        """Lazy rows: for each unit, the parameters some rank loaded (the
        rest of its flat shards stays as it is); where only some ranks did,
        the others' rows are read from the flat shards first."""
        targets = self.model.state_dict(keep_vars=True)
        loaded = {id(targets[raw]) for raw in plan.values if raw in targets}
        mine = [[id(t) in loaded for t in twins] for twins in self.params]
        only = []
        for u, twins, here, (some, lacking) in zip(self.units, self.params, mine, self._anywhere(mine)):
            if any(s and n for s, n in zip(some, lacking)):
                rows = moves.to_rows(u, u.unit.local)
                for i, twin in enumerate(twins):
                    if not here[i]:
                        _compat.local_tensor(twin).copy_(rows[i])
            only.append({i for i, s in enumerate(some) if s})
        return only

    def _refill_state(self, plan) -> None:
        """Lazy state: the twin's per-element state of parameters the load left
        untouched on some rank is read from the optimizers now (unit by unit,
        where any rank needs it), as an eager twin would have read it."""
        touched = {id(load.param) for load in plan.params}
        opt_of = {id(p): twin for twin in self.optims for g in twin.param_groups for p in g["params"]}
        mine = [
            [id(t) not in touched and bool(opt_of[id(t)].state.get(t)) if id(t) in opt_of else False for t in twins]
            for twins in self.params
        ]
        for u, twins, here, (some, _), (targets, typed) in zip(
            self.units, self.params, mine, self._anywhere(mine), self.state_plans
        ):
            if not typed or not any(some):
                continue
            for (path, _), rows in zip(typed, self._state_rows(u, targets, typed)):
                for i, twin in enumerate(twins):
                    value = at_path(opt_of[id(twin)].state[twin], path) if here[i] else None
                    if _per_element(value):
                        _compat.local_tensor(value).copy_(rows[i])

    def _anywhere(self, flags: list[list[bool]]) -> list[tuple[list[bool], list[bool]]]:
        """For each unit's ``flags`` (one per parameter, this rank's): whether
        any rank of the unit's group has it set, and whether any has it clear
        (one all-reduce per group)."""
        by_pg: dict[int, list[int]] = {}
        for k, u in enumerate(self.units):
            by_pg.setdefault(id(u.unit.pg), []).append(k)
        out: list = [None] * len(self.units)
        for ks in by_pg.values():
            mine = [f for k in ks for f in flags[k]]
            both = torch.tensor([int(f) for f in mine] + [int(not f) for f in mine], dtype=torch.int32)
            if self.units[ks[0]].size > 1 and mine:
                dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.units[ks[0]].unit.pg)
            at = 0
            for k in ks:
                n = len(flags[k])
                out[k] = (
                    [bool(x) for x in both[at : at + n]],
                    [bool(x) for x in both[len(mine) + at : len(mine) + at + n]],
                )
                at += n
        return out

    def _write_optimizers(self) -> None:
        for opt, twin in zip(self.real_optims, self.optims):
            for real_group, twin_group in zip(opt.param_groups, twin.param_groups):
                for key, value in twin_group.items():
                    if key not in _STRUCTURAL:
                        real_group[key] = value
        managed = set()
        owner = {
            id(p): (opt, twin)
            for opt, twin in zip(self.real_optims, self.optims)
            for g in opt.param_groups
            for p in g["params"]
        }
        for k, (twins, params) in enumerate(zip(self.params, self._optimizer_params())):
            managed.update(id(p) for p in params)
            self._write_unit(k, twins, params, owner)
        for opt, twin in zip(self.real_optims, self.optims):
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) in managed:
                        continue
                    if p in twin.state and twin.state[p]:
                        opt.state[p] = twin.state[p]
                    else:
                        opt.state.pop(p, None)

    def _write_unit(self, k: int, twins: list, params: list, owner: dict) -> None:
        u = self.units[k]
        flat_mode = u.unit.params is None
        entries = []
        for i, twin in enumerate(twins):
            opt_twin = owner.get(id(params[0 if flat_mode else i]), (None, None))[1]
            entries.append(opt_twin.state.get(twin) if opt_twin is not None else None)
        found: dict[tuple, torch.dtype] = {}  # path of each per-element tensor (nested too) -> its dtype
        for e in entries:
            for path, value in leaves(e or {}):
                if _per_element(value):
                    found.setdefault(path, _compat.local_tensor(value).dtype)
        flats = {}
        for path, dtype in sorted(found.items(), key=lambda item: str(item[0])):
            flats[path] = self._flat_of(k, path, dtype, entries)
        for j, p in enumerate(params):
            opt, _ = owner.get(id(p), (None, None))
            if opt is None:
                continue
            mine = [e for i, e in enumerate(entries) if (flat_mode or i == j) and e]
            where = (0, u.shard) if flat_mode else u.unit.in_shard[j]
            if not flat_mode and (where is None or not where[1]):
                continue  # none of its elements here: this rank never steps it, and the load has nothing for it
            if not mine:
                opt.state.pop(p, None)
                continue
            current = opt.state.get(p) or {}
            # A flat shard's padding belongs to no parameter: a load leaves what the optimizer holds there.
            valid = self._unpadded(u) if flat_mode else where[1]

            def written(value, path, current=current, where=where, valid=valid):
                old = at_path(current, path)
                if path in flats:
                    piece = flats[path][where[0] : where[0] + where[1]]
                    if isinstance(old, torch.Tensor) and old.shape == piece.shape and old.dtype == piece.dtype:
                        old[:valid].copy_(piece[:valid])
                        return old
                    return piece.clone()
                if isinstance(old, torch.Tensor) and isinstance(value, torch.Tensor) and old.shape == value.shape:
                    return old.copy_(value)
                return value

            opt.state[p] = {key: rebuild(value, written, (key,)) for key, value in mine[0].items()}

    def _flat_of(self, k: int, path: tuple, dtype: torch.dtype, entries: list) -> torch.Tensor:
        """This rank's flat shard of the state at ``path`` of unit ``k``, from the
        twin's ``entries`` (one per parameter; zeros where one has none): what a
        broadcast landed there already, the rest through one exchange of rows."""
        u = self.units[k]
        buffer, landed = self.state_landed.get(k, {}).get(path, (None, set()))
        rows, others = [], set()
        for i, e in enumerate(entries):
            value = at_path(e or {}, path)
            if _per_element(value):
                rows.append(_compat.local_tensor(value))
                others.add(i)
            else:
                rows.append(torch.zeros(u.local_shape(i), dtype=dtype, device=u.unit.local.device))
                if i in landed:  # landed, then dropped (a template nobody filled): zeros, as if never landed
                    for _, a, b in u.held(u.index, [i]):
                        buffer[a - u.index * u.shard : b - u.index * u.shard].zero_()
        if buffer is None:
            return moves.to_flat(u, rows)
        others -= landed  # the same on every rank: the plan and its answers are
        if others:
            moves.to_flat_many(u, [rows], [buffer], only=others)
        return buffer if buffer.dtype == dtype else buffer.to(dtype)

    @staticmethod
    def _unpadded(u: UnitLayout) -> int:
        """Elements of this rank's flat shard that belong to a parameter (the rest pads the last shards)."""
        total = max((off + math.prod(shape) for off, shape in zip(u.unit.offsets, u.unit.shapes)), default=0)
        return max(0, min(u.shard, total - u.index * u.shard))


def _blank_rows(u: UnitLayout, dtype: torch.dtype, hollow: bool) -> list[torch.Tensor]:
    """Rows of each of the unit's parameters not read now: empty, to be
    filled, or ``hollow``, stand-ins of one element's memory (a full get's,
    which gathers from the flat shards instead)."""
    device = u.unit.local.device
    if hollow:
        return [torch.zeros((), dtype=dtype, device=device).expand(u.local_shape(i)) for i in range(len(u.fqns))]
    return [torch.empty(u.local_shape(i), dtype=dtype, device=device) for i in range(len(u.fqns))]


def _twin_entry(summary: dict, own: dict, rows_at) -> dict:
    """A twin parameter's state entry: per-element state (nested too) as the
    twin's rows, ``rows_at(path)``; the rest this rank's own values where it
    has them, else the holders' (``summary``'s)."""

    def value(leaf, path):
        if isinstance(leaf, RowsAt):
            return rows_at(path)
        leaf = at_path(own, path, leaf)
        return leaf.clone() if isinstance(leaf, torch.Tensor) else leaf

    return {key: rebuild(detail, value, (key,)) for key, (kind, detail) in summary.items() if kind != "shape"}


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0
