"""FSDP1 models through a twin in hyperdsd's canonical layout.

:class:`FSDP1Twin` reads an FSDP1 model and its optimizers into a twin (see
:mod:`hyperdsd.fsdp1.units`, :mod:`.twin_tree` and :mod:`.twin_entries`):
each original parameter a DTensor sharded by rows on the unit's mesh, its
optimizer state per original parameter (unflattened from the flat
parameter's under ``use_orig_params=False``), keyed by canonical FQN. Gets
read the twin as they read an FSDP2 model (a full get takes its tensors from
the flat shards: :mod:`hyperdsd.fsdp1.streaming`); a set plans, checks and
agrees against the twin, loads into it, and only then writes what changed
into FSDP1's flat shards, its optimizers' state and their param groups
(:mod:`hyperdsd.fsdp1.load`). Reading changes nothing: every tensor of the
twin that stands for a flat parameter's state is new. A set's twin does not
read what the load overwrites: its rows start empty, and what some rank's
load leaves is read from the flat shards at write-back.
"""

from __future__ import annotations

import torch

from .. import _compat
from ..errors import StateDictError
from ..state.keys.fqn import ModelIndex
from ..transport import group as groups
from . import kept as kept_twins
from . import stacks, unit_groups
from . import unit_moves as moves
from . import units as layout_of
from .summaries import (
    merge,
    per_element_paths,
    quick_summary_key,
    refuse_unflattenable,
    summarize,
    summary_key,
)
from .twin_entries import twin_entries
from .twin_tree import twin_module
from .units import UnitLayout, blank_rows, shard_state, twin_optimizer


class FSDP1Twin:
    """An FSDP1 model and its optimizers, in the canonical layout."""

    def __init__(
        self, model: torch.nn.Module, real, optimizers: tuple, modifiers_attr: str, to_load=frozenset(), stream=False
    ):
        self.real_model = model
        self.real_optims = tuple(optimizers)
        # A full get's twin reads no rows: the gather takes the full tensors
        # from the flat shards (:mod:`hyperdsd.fsdp1.streaming`). Optimizers whose
        # state_dict() runs hooks have their rows read, for the hooks to see.
        self.stream_rows = stream
        self.stream_state = stream and bool(self.real_optims) and all(map(_compat.plain_state_dict, self.real_optims))
        # A full get's state stands in hollow: one DTensor per layout and dtype, shared
        # (the gather fills each entry by its FQN and path: :mod:`hyperdsd.fsdp1.streaming`).
        self.hollow_ids: set[int] = set()
        self._hollows: dict[tuple, torch.Tensor] = {}
        # A load overwrites what it loads: the twin's sharded state then starts
        # empty, and what a load leaves is read from the flat shards at write-back
        # only where some rank did not load it (:mod:`hyperdsd.fsdp1.model_writeback`,
        # :mod:`hyperdsd.fsdp1.state_refill`). An optimizer
        # load reads no parameter values (a scratch step steps zeros like them),
        # but its load hooks, which see the twin, might: the rows are read for them.
        self.load_hooked = any(h.pre or h.post for h in map(_compat.optimizer_load_hooks, self.real_optims))
        self.lazy_rows = bool(to_load) and not self.load_hooked
        self.lazy_state = bool(to_load)
        hollow_rows = self.stream_rows or (self.lazy_rows and "model" not in to_load)  # (see blank_rows)
        self.state_plans: list[tuple[list, list]] = []  # per unit: (targets, [(path, dtype)]) of its state rows
        self.units: list[UnitLayout] = []
        places: dict[tuple, tuple] = {}  # by group and device type: (size, index, mesh), asked once
        for module, raw in real.wrapped:  # (``real``: the model's index, listing its FSDP1 modules)
            unit = _compat.fsdp1_unit(module)
            if unit is None:
                continue
            if not unit.sharded:
                raise StateDictError(
                    f"FSDP1 module {raw[:-1] or '<root>'!r} uses NO_SHARD; hyperdsd reads FSDP1's sharded strategies "
                    "(use DDP for replicated training)"
                )
            fqns, aliases = layout_of.canonical_names(real, raw, unit)
            key = (id(unit.pg), id(unit.mesh), id(unit.replicate_pg), unit.flat_param.device.type)
            if key not in places:  # (each of torch's group queries costs tens of us)
                places[key] = (*unit_groups.shard_index(unit), unit_groups.unit_mesh(unit, key[3]))
            size, index, mesh = places[key]
            self.units.append(UnitLayout(unit, fqns, aliases, mesh, size, index))
        # Every unit's rows, of its parameters and of its state, move in one batch (:mod:`.stacks`).
        owner = {id(p): opt for opt in self.real_optims for g in opt.param_groups for p in g["params"]}
        batch = stacks.RowsBatch()
        tickets = None if self.lazy_rows or self.stream_rows else [batch.add(u, [u.unit.local]) for u in self.units]
        state = self._plan_state(owner, batch) if self.real_optims else []
        batch.run()
        if tickets is None:
            rows = blank_rows([(u, u.unit.local.dtype) for u in self.units], hollow_rows)
        else:
            rows = [batch.rows(t)[0] for t in tickets]
        self.kept = False
        self.model, self.params, self.index = self._tree(model, real, rows, modifiers_attr)
        # A broadcast load lands per-element state in the flat shards (:meth:`.load.FSDP1Load.land`, called
        # wherever the model's group has peers): the twin's stands in hollow, and what a load does not
        # land gets rows of its own there. Load hooks see the twin's state: it is real for them.
        broadcast = "broadcast" in to_load and bool(self.real_optims) and not self.load_hooked
        self.hollow_state = broadcast and groups.of_params(self.index.params).has_peers
        self.optims = self._twin_optimizers(owner, state, batch) if self.real_optims else ()

    def _tree(self, model, real, rows: list, modifiers_attr: str) -> tuple:
        """The twin module, its parameters by unit, and its index: the last
        call's tree given these rows where the model is as it was (:mod:`.kept`),
        else new (and kept)."""
        key = kept_twins.structure(real, self.units)
        found = kept_twins.find(model, real, key)
        if found is not None:
            tree, params = found
            kept_twins.refill(self.units, params, rows)
            index = ModelIndex.of(tree, modifiers_attr)
            if kept_twins.intact(index, params):
                self.kept = True
                return tree, params, index
            kept_twins.forget(model)  # (a load replaced a parameter of the tree)
        tree, params = twin_module(real, self.units, rows)
        self.kept = kept_twins.keep(model, real, key, tree, params)
        return tree, params, ModelIndex.of(tree, modifiers_attr) if self.kept else ModelIndex(tree, modifiers_attr)

    def release(self) -> None:
        """The call is done with the twin: a kept tree lets go of its rows (:mod:`.kept`)."""
        if self.kept:
            kept_twins.release(self.params)

    # -- reading -------------------------------------------------------------

    def optimizer_params(self) -> list[list]:
        """For each unit, the real parameters its optimizer state is keyed by:
        the flat parameter, or each original parameter (use_orig_params=True)."""
        return [[u.unit.flat_param] if u.unit.params is None else list(u.unit.params) for u in self.units]

    def _twin_optimizers(self, owner: dict, state: list, batch) -> tuple:
        names = {id(t): fqn for u, twins in zip(self.units, self.params) for fqn, t in zip(u.fqns, twins)}
        expand: dict[int, list] = {}
        for u, twins in zip(self.units, self.params):
            if u.unit.params is None:
                expand[id(u.unit.flat_param)] = twins
            else:
                for p, t in zip(u.unit.params, twins):
                    expand[id(p)] = [t]
        twins_of = {id(opt): twin_optimizer(opt, expand, names) for opt in self.real_optims}
        self._fill_state(owner, twins_of, state, batch)
        for opt in self.real_optims:  # parameters FSDP1 does not manage: their state as it is
            twin = twins_of[id(opt)]
            for g in opt.param_groups:
                for p in g["params"]:
                    if id(p) not in expand and p in opt.state:
                        twin.state[p] = opt.state[p]
        return tuple(twins_of[id(opt)] for opt in self.real_optims)

    def _plan_state(self, owner: dict, batch) -> list[tuple]:
        """What each unit's state is, from every rank's summary (a rank without
        an original parameter's elements has no state for it), and its rows
        asked of ``batch`` (unless a load or a full get reads none):
        per unit, (merged summaries, their paths, the batch's ticket)."""
        per_unit = self.optimizer_params()
        everyone = unit_groups.exchange_by_group(self._summaries(owner, per_unit), [u.unit.pg for u in self.units])
        paths_of: dict[int, list] = {}  # by the summary's id: summaries repeat (see _summaries)
        planned = []
        for u, params, ranks in zip(self.units, per_unit, everyone):
            merged = list(map(merge, zip(*ranks)))
            paths = []
            for j, summary in enumerate(merged):
                if id(summary) not in paths_of:
                    refuse_unflattenable(summary, u.fqns if u.unit.params is None else u.fqns[j])
                    paths_of[id(summary)] = per_element_paths(summary or {})
                paths.append(paths_of[id(summary)])
            targets = [(j, p, owner.get(id(p))) for j, p in enumerate(params)]
            found: dict[tuple, torch.dtype] = {}
            for named in {id(named): named for named in paths}.values():  # (each distinct list once)
                for path, dtype in named:
                    found.setdefault(path, dtype)
            typed = sorted(found.items(), key=lambda item: str(item[0]))  # (path, dtype): the same on every rank
            self.state_plans.append((targets, typed))
            ticket = None
            if typed and not (self.lazy_state or self.stream_state):
                ticket = batch.add(u, [shard_state(u, targets, path, dtype) for path, dtype in typed])
            planned.append((merged, paths, ticket))
        return planned

    def _fill_state(self, owner: dict, twins_of: dict, planned: list, batch) -> None:
        """Each unit's state, unflattened into the twin optimizers: per-element
        state as DTensors of its rows, the rest as this rank (or a holder) has it."""
        # (nested state is never hollow: what stands in is made real by its key)
        hollow = [
            bool(self.stream_state or (self.hollow_state and all(len(p) == 1 for p, _ in typed)))
            for _, typed in self.state_plans
        ]
        asked = [
            (n, u, d)
            for n, (u, (_, _, t), (_, typed)) in enumerate(zip(self.units, planned, self.state_plans))
            if t is None
            for _, d in typed
        ]
        blank = [iter(blank_rows([(u, d) for n, u, d in asked if hollow[n] == h], h)) for h in (False, True)]
        sets: dict[int, set] = {}  # by the id of a list of paths (shared: see _plan_state)
        for n, (u, twins, (merged, paths, ticket)) in enumerate(zip(self.units, self.params, planned)):
            targets, typed = self.state_plans[n]
            by_key = [next(blank[hollow[n]]) for _ in typed] if ticket is None else batch.rows(ticket)
            # (one flat parameter's state, or original parameters' of one list of paths: each path held by all, or none)
            alike = u.unit.params is None or all(named is paths[0] for named in paths)
            everyone = range(len(twins))
            has = [_path_set(named, sets) for named in (paths[:1] if alike else paths)]
            placed: dict[tuple, list] = {}  # path -> the twin's DTensor of each parameter's rows (None: no such state)
            for (path, _), rows in zip(typed, by_key):
                if alike:
                    held = everyone if path in has[0] else ()
                else:
                    held = [i for i, named in enumerate(has) if path in named]
                placed[path] = column = [None] * len(twins)
                for i, value in zip(held, (self._hollow if hollow[n] else _wrap_rows)(u, rows, held)):
                    column[i] = value
            # (a full get's gather copies what its rank hands out: :mod:`hyperdsd.fsdp1.streaming`)
            entries = twin_entries(u, merged, targets, placed, copies=not (self.stream_state and typed))
            owners = targets * len(twins) if u.unit.params is None else targets  # (a flat parameter's, every one's)
            for twin, (_, p, opt), entry in zip(twins, owners, entries):
                if entry is not None:
                    twins_of[id(opt)].state[twin] = entry

    def _hollow(self, u: UnitLayout, rows: list, held: list[int]) -> list:
        """Stand-ins for the state rows of the parameters ``held`` (a full get's,
        or a broadcast load's): nothing reads them, so each layout and dtype has
        one, shared (no DTensor per value, where the call holds none of its state)."""
        out = []
        for i in held:
            key = (id(u.layouts[i]), rows[i].dtype)
            value = self._hollows.get(key)
            if value is None:
                value = self._hollows[key] = _wrap_rows(u, rows, [i])[0]
                self.hollow_ids.add(id(value))
            out.append(value)
        return out

    def real_rows(self, k: int, i: int, dtype: torch.dtype, row: torch.Tensor | None = None) -> torch.Tensor:
        """A DTensor of parameter ``i`` of unit ``k``'s own rows (``row``, or
        zeros): for a value that stood in hollow."""
        u = self.units[k]
        row = row if row is not None else torch.zeros(u.local_shape(i), dtype=dtype, device=u.unit.local.device)
        return u.layouts[i].wrap(row)

    def _summaries(self, owner: dict, per_unit: list) -> list[list]:
        """This rank's summary of each unit's parameters' state (None where it
        holds none). Equal summaries are one object: parameters stepped alike
        have equal ones, and the exchange pickles each object once."""
        interned: dict = {}

        def summary_of(p, numel: int):
            opt = owner.get(id(p))
            entry = opt.state.get(p) if opt is not None else None
            if not entry:
                return None
            key = quick_summary_key(entry, numel)
            summary = interned.get(key) if key is not None else None
            if summary is None:
                summary = summarize(entry, numel)
                key = summary_key(summary)
                summary = summary if key is None else interned.setdefault(key, summary)
            return summary

        mine = []
        for u, params in zip(self.units, per_unit):
            if u.unit.params is None:
                mine.append([summary_of(params[0], u.shard)])
                continue
            # (use_orig_params=True: a rank without the parameter's elements never steps it;
            # what it holds, such as Adagrad's state from its constructor, tells nothing)
            summaries = [None] * len(params)
            for j, _, numel in u.here:
                summaries[j] = summary_of(params[j], numel)
            mine.append(summaries)
        return mine

    def state_rows(self, u: UnitLayout, targets: list, typed: list, exchange=None) -> list[list[torch.Tensor]]:
        """This rank's rows of each state tensor ``typed`` names (path, dtype), in one
        exchange (or as part of ``exchange``: filled when it runs)."""
        shards = [shard_state(u, targets, path, dtype) for path, dtype in typed]
        return moves.to_rows_many(u, shards, exchange)


def _path_set(named: list, sets: dict) -> set:
    """The paths of ``named`` (a list of (path, dtype)) as a set, made once per list."""
    hit = sets.get(id(named))
    return hit if hit is not None else sets.setdefault(id(named), {path for path, _ in named})


def _wrap_rows(u: UnitLayout, rows: list[torch.Tensor], held: list[int]) -> list:
    """DTensors of the rows of the parameters ``held``, each in its parameter's layout."""
    if not held:
        return []
    local = rows[held[0]]
    if u.mesh.device_type != local.device.type:  # (moved to the mesh's device as DTensorLayout.wrap moves it)
        return [u.layouts[i].wrap(rows[i]) for i in held]
    specs = u.specs(local.dtype)
    if len(held) == len(rows):  # (every parameter's: a flat parameter's state, most of all)
        return _compat.dtensors_of(rows, specs)
    return _compat.dtensors_of([rows[i] for i in held], [specs[i] for i in held])
