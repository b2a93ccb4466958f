"""How the ranks of a load agree, and how the data to load reaches them.

A load plans on every rank, agrees, then applies (:mod:`hyperdsd.api`).
Two agreements share one interface, so the load runs the same steps either
way:

- :class:`LocalAgreement`: every rank holds the dict it loads; one
  all-reduce tells every rank whether any found a problem.
- :class:`BroadcastAgreement` (``broadcast_from_rank0``): the root holds
  full state dicts and every rank receives only its own pieces. The root is
  rank 0 of the model's group (:mod:`.transport.group`): global rank 0 for
  a model over the whole world, the lowest rank of its meshes for a model
  on part of it. Only the group's ranks take part.

  1. :meth:`~BroadcastAgreement.manifests` - the root's dicts, each tensor
     replaced by a :class:`TensorMeta` (shape, dtype, index), broadcast in
     one collective; every rank plans its load against them.
  2. :meth:`~BroadcastAgreement.agree` - one exchange carries each rank's
     problems, its answers about placeholders, the names it loads and the
     regions it needs; every rank raises alike if any rank found a problem
     (or, with ``strict``, a name no rank loads); otherwise the root's
     tensors are scattered, each piece going straight into its destination.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from . import _compat
from .state.keys.flat import is_flat
from .state.loading.plan import ModelLoadPlan, OptimizerLoadPlan, TensorMeta
from .state.placeholders.saved import UNKNOWN, VARIES, never_stepped_tensors, tensor_fill
from .transport import collectives
from .transport.delivery import deliver, needs_for
from .transport.group import Group
from .transport.needs import PackedNeeds, ShapeDtype
from .tree import rebuild, where

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


class LocalAgreement:
    """Every rank loads its own dict: one all-reduce agrees, nothing is sent."""

    foreign_ok = False  # every name must be this rank's own

    def __init__(self, group: Group):
        self.group = group
        self.problems: list[str] = []

    def manifests(self, parts: dict[str, Any]) -> dict[str, Any]:
        """What every rank plans against: its own dicts."""
        return parts

    def agree(
        self,
        what: str,
        problems: list[str],
        model_plan: ModelLoadPlan | None,
        optim_plan: OptimizerLoadPlan | None,
        strict: bool,
    ) -> dict[str, bool]:
        """Raise on every rank if any rank has problems; returns the answers to
        this rank's open placeholder questions."""
        questions = optim_plan.questions if optim_plan is not None else {}
        confirm = optim_plan.confirm if optim_plan is not None else frozenset()
        return collectives.agree(problems, f"{what}: nothing was loaded", questions, self.group, confirm)


class _Column(NamedTuple):
    """A part of a manifest as the root sends it: a dict of the stand-ins from
    ``start`` on, under ``keys``; with ``entries``, a dict of dicts of them,
    each entry's keys in turn. Every rank makes the stand-ins themselves
    (:func:`stand_ins_of`): a list of ``(shape, dtype)`` pairs pickles in a
    fraction of the time tens of thousands of objects take, on the root,
    while every other rank waits."""

    keys: list
    start: int
    entries: list | None = None


def describe(state_dict: Any) -> tuple[Any, list[torch.Tensor], list[ShapeDtype], dict[int, Any], list[str]]:
    """The root's dict as it is sent, each tensor to be replaced by a
    :class:`TensorMeta` (:func:`stand_ins_of`); the tensors; their ``(shape,
    dtype)`` in index order; the fills known, by index; problems.

    The tensors of optimizer entries whose ``step`` is 0 carry the one value
    they hold, if they do (``TensorMeta.fill``): every rank needs it to tell
    a saved never-stepped placeholder state from real state.
    """
    found = _Description(state_dict)
    return found.walk(state_dict, ()), found.fulls, found.metas, found.fills, found.problems


class _Description:
    """:func:`describe`'s walk and what it finds (an object, not closures: a
    recursive closure is a cycle, and would keep the root's tensors until the
    collector runs)."""

    def __init__(self, state_dict: Any):
        # By id(): the tensors live in ``state_dict`` for the call, and compare elementwise.
        self.summarise = never_stepped_tensors(state_dict.get("optim")) if isinstance(state_dict, dict) else set()
        self.fulls: list[torch.Tensor] = []
        self.metas: list[ShapeDtype] = []
        self.fills: dict[int, Any] = {}
        self.problems: list[str] = []
        # One object per distinct shape and per distinct (shape, dtype): pickle
        # sends a shared object once, so every rank unpickles a handful instead
        # of one per tensor.
        self.shared: dict[tuple, ShapeDtype] = {}
        self.entry_keys: dict[tuple, tuple] = {}  # (each distinct tuple of an entry's keys, shared likewise)

    def meta(self, leaf: Any, path: tuple) -> Any:
        if isinstance(leaf, DTensor):
            self.problems.append(
                f"state_dict{where(path)}: a DTensor; broadcast_from_rank0 loads full tensors "
                "(get them with full_state_dict=True)"
            )
            return None
        return self.stand_in(leaf) if isinstance(leaf, torch.Tensor) else leaf

    def stand_in(self, leaf: torch.Tensor) -> TensorMeta:
        i = self.column([leaf])
        return TensorMeta(*self.metas[i], i, self.fills.get(i))

    def column(self, leaves: list[torch.Tensor]) -> int:
        """Index ``leaves`` (tensors), a column at a time: each one's shared
        ``(shape, dtype)``, its fill; returns the first one's index."""
        shared = self.shared
        # each leaf's (shape, dtype) hashed once: by the index of the first leaf with it after
        first_of: dict[tuple, int] = {}
        firsts = list(map(first_of.setdefault, zip(map(_SHAPE, leaves), map(_DTYPE, leaves)), itertools.count()))
        for shape, dtype in first_of:
            if (shape, dtype) not in shared:
                shared[(shape, dtype)] = ShapeDtype(tuple(shape), dtype)
        of_first = {first: shared[key] for key, first in first_of.items()}
        start = len(self.fulls)
        self.fulls.extend(leaves)
        self.metas.extend(map(of_first.__getitem__, firsts))
        if self.summarise:
            for i, leaf in enumerate(leaves, start):
                fill = tensor_fill(leaf) if id(leaf) in self.summarise else None
                if fill not in (None, UNKNOWN, VARIES):
                    self.fills[i] = fill
        return start

    def walk(self, obj: Any, path: tuple) -> Any:
        # rebuild(obj, meta), a dict's plain tensors taken in place (most of a state dict's leaves):
        # a model's dict of tensors, or an optimizer's dict of entries of tensors, a column at a time
        if type(obj) is dict:
            values = list(obj.values())
            kinds = set(map(type, values))
            if kinds == {torch.Tensor}:
                return _Column(list(obj), self.column(values))
            if kinds == {dict}:
                leaves = list(itertools.chain.from_iterable(map(dict.values, values)))
                if set(map(type, leaves)) <= {torch.Tensor}:
                    keys = list(map(tuple, values))
                    entries = list(map(self.entry_keys.setdefault, keys, keys))
                    return _Column(list(obj), self.column(leaves), entries)
            return {
                k: self.stand_in(v) if type(v) is torch.Tensor else self.walk(v, path + (k,)) for k, v in obj.items()
            }
        if type(obj) is list and set(map(type, obj)) == {str}:  # a group's FQNs
            return list(obj)
        if type(obj) is list:
            return [self.walk(v, path + (i,)) for i, v in enumerate(obj)]
        return rebuild(obj, self.meta, path)


def stand_ins_of(sent: Any, metas: list[ShapeDtype], fills: dict[int, Any]) -> Any:
    """The manifest :func:`describe` sent (``sent``), its columns made into
    dicts of :class:`TensorMeta` stand-ins: alike on every rank."""
    indices = range(len(metas))
    fill_of = map(fills.get, indices) if fills else itertools.repeat(None)
    stand = list(map(TensorMeta, map(_FIRST, metas), map(_SECOND, metas), indices, fill_of))
    return _with_stand_ins(sent, stand)


def _with_stand_ins(obj: Any, stand: list[TensorMeta]) -> Any:
    """:func:`stand_ins_of`'s walk (a function of its own: a recursive closure
    is a cycle, and would keep every stand-in until the collector runs)."""
    kind = type(obj)
    if kind is _Column:
        if obj.entries is None:
            return dict(zip(obj.keys, stand[obj.start : obj.start + len(obj.keys)]))
        first = obj.entries[0] if obj.entries else ()
        if first and obj.entries.count(first) == len(obj.entries):  # (every entry of the same keys: AdamW's)
            run = iter(stand[obj.start : obj.start + len(first) * len(obj.entries)])
            entries = map(dict, map(zip, itertools.repeat(first), zip(*[run] * len(first))))
        else:
            sizes = list(map(len, obj.entries))
            run = iter(stand[obj.start : obj.start + sum(sizes)])
            entries = map(dict, map(zip, obj.entries, map(itertools.islice, itertools.repeat(run), sizes)))
        return dict(zip(obj.keys, entries))
    if kind is dict:
        return {k: _with_stand_ins(v, stand) for k, v in obj.items()}
    if kind is list and not set(map(type, obj)) <= {str}:
        return [_with_stand_ins(v, stand) for v in obj]
    return obj


def optimizer_names(manifest: Any) -> list[str]:
    """The FQN-like names in the root's optimizer dict, in an order every rank computes alike."""
    if not isinstance(manifest, dict):
        return []
    if is_flat(manifest):
        return [k for k in manifest if isinstance(k, str)]
    names = [k for k in manifest.get("state", {}) if isinstance(k, str)]
    for g in manifest.get("param_groups", []) or []:
        if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)):
            names += [f for f in g["params"] if isinstance(f, str)]
    return list(dict.fromkeys(names))


class BroadcastAgreement:
    """One broadcast load of a model's and/or optimizers' state dicts."""

    foreign_ok = True  # the root's dict names what other ranks (pipeline stages) load

    def __init__(self, group: Group):
        self.group = group
        self.problems: list[str] = []  # the root's: tensors it cannot broadcast
        self.fulls: list[torch.Tensor] = []
        self.metas: list[ShapeDtype] = []
        self.model_names: list[str] = []
        self.optim_names: list[str] = []

    def manifests(self, parts: dict[str, Any]) -> dict[str, Any]:
        """The root's dicts as manifests, on every rank (its tensors stay on the root).

        ``parts`` maps "model" and/or "optim" to the caller's dict; only the
        root's are read, but every rank of the group passes the same keys.
        """
        sent, problems, metas, fills = None, [], None, None
        if self.group.is_root:
            # metas sent along: no rank walks the manifest for them
            sent, self.fulls, metas, fills, problems = describe(parts)
        sent, problems, metas, fills = collectives.broadcast_object((sent, problems, metas, fills), self.group)
        if self.group.is_root:
            self.problems = problems
        self.metas = metas
        manifest = stand_ins_of(sent, metas, fills)
        model, optim = manifest.get("model"), manifest.get("optim")
        self.model_names = [k for k in model if isinstance(k, str)] if isinstance(model, dict) else []
        self.optim_names = optimizer_names(optim)
        return manifest

    def agree(
        self,
        what: str,
        problems: list[str],
        model_plan: ModelLoadPlan | None,
        optim_plan: OptimizerLoadPlan | None,
        strict: bool,
    ) -> dict[str, bool]:
        """Raise on every rank if any rank has problems; else deliver every rank's pieces.

        Returns the answers to this rank's open placeholder questions.
        """
        questions = optim_plan.questions if optim_plan is not None else {}
        mine_model = model_plan.claimed if model_plan is not None else set()
        mine_optim = set(self.optim_names) - set(optim_plan.foreign) if optim_plan is not None else set()
        plans = [plan for plan in (model_plan, optim_plan) if plan is not None]
        prepared = [p for plan in plans for p in plan.tensors() if p.meta is not None]
        columns = [column for plan in plans for column in plan.columns]
        needs, users, cut, dests = needs_for(prepared, self.metas, columns)
        everyone = collectives.exchange(
            {
                "problems": problems,
                "known": {k: v for k, v in questions.items() if v is not None},
                "model": _positions(self.model_names, mine_model),
                "optim": _positions(self.optim_names, mine_optim),
                "needs": needs if isinstance(needs, PackedNeeds) else PackedNeeds(needs),
            },
            self.group,
        )
        by_rank = [e["problems"] for e in everyone]
        if strict:
            extra = self._unowned(everyone)
            by_rank = [p + extra for p in by_rank]
        collectives.raise_if_any(by_rank, f"{what}: nothing was loaded", self.group)
        confirm = optim_plan.confirm if optim_plan is not None else frozenset()
        answers = collectives.answer(collectives.open_questions(questions, confirm), [e["known"] for e in everyone])
        deliver(
            needs,
            users,
            cut,
            self.fulls if self.group.is_root else None,
            self.metas,
            _compat.collective_device(),
            everyone_needs=[e["needs"] for e in everyone],
            group=self.group,
            dests=dests,
        )
        return answers

    def _unowned(self, everyone: list[dict]) -> list[str]:
        """Names in the root's dicts that no rank loads (problems under ``strict``)."""
        nobody = _unclaimed(self.model_names, [e["model"] for e in everyone])
        nobody_optim = _unclaimed(self.optim_names, [e["optim"] for e in everyone])
        extra = []
        if nobody:
            extra.append(f"model keys that no rank has (strict=True): {nobody}")
        if nobody_optim:
            extra.append(f"not parameters of any rank's model (strict=True): {nobody_optim}")
        return extra


def _positions(names: list[str], mine: set[str]) -> range | list[int]:
    """The positions in ``names`` of those in ``mine``, as every rank sends
    them: a range where it is all of them (each rank of a sharded model loads
    every name), not a list of tens of thousands of numbers."""
    found = list(map(mine.__contains__, names))
    return range(len(names)) if all(found) else list(itertools.compress(range(len(names)), found))


def _unclaimed(names: list[str], claimed: list[range | list[int]]) -> list[str]:
    """Those of ``names`` at no position any rank claimed (:func:`_positions`)."""
    if any(type(c) is range and len(c) == len(names) for c in claimed):
        return []
    owned = set().union(*claimed)
    return [k for i, k in enumerate(names) if i not in owned]
