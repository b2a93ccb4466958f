"""An optimizer state dict to load, parsed against the optimizers it loads into.

A checkpoint is nested (``{"state": {fqn: ...}, "param_groups": [...]}``)
or flat (see :mod:`hyperdsd.state.keys.flat`). Either way parsing yields the same shape: the
checkpoint's param groups as :class:`SourceGroup`, each optimizer group's
match among them, state by FQN, and the names the model does not have.
Malformed input becomes problems (messages), never an exception.
"""

from __future__ import annotations

import itertools
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..keys.flat import GROUPS, STATE, is_flat, unflatten
from ..keys.fqn import ModelIndex
from ..placeholders.marks import (
    Unwritten,
    any_placeholder_values,
    any_placeholders,
    is_placeholder_value,
    unwritten_keys,
)

_ALL_WRITTEN = Unwritten(frozenset(), False)  # an entry without placeholders: every key counts as written


@dataclass
class TargetGroup:
    """One param group of one of the optimizers being loaded."""

    opt: torch.optim.Optimizer
    group: dict
    fqns: list[str]  # canonical FQN of each of ``group["params"]``
    position: int  # the optimizer's place among those loaded (its first, if it is given twice)


@dataclass(eq=False)
class SourceGroup:
    """One param group of the checkpoint: itself, however alike another is
    (compared and hashed by identity)."""

    fields: dict  # its hyperparameters (structural keys are dropped when applied)
    fqns: list[str]


@dataclass
class Source:
    groups: list[SourceGroup]  # every group the checkpoint lists
    matched: list[SourceGroup | None]  # the group each target group loads from
    state: dict  # state by FQN as the checkpoint names them
    foreign: list[str] = field(default_factory=list)  # names the model does not have
    nested: bool = True  # False: rebuilt from a flat dict, which has no list of groups
    by_name: dict[str, dict] = field(default_factory=dict)  # state by canonical FQN
    listed: set[str] = field(default_factory=set)  # canonical FQNs the checkpoint lists (in a group or with state)
    unwritten: "UnwrittenKeys" = field(default_factory=lambda: UnwrittenKeys())


class UnwrittenKeys:
    """:func:`unwritten_keys` of the state entry of each canonical FQN, worked
    out once per load (a load holds one entry per FQN)."""

    def __init__(self):
        self._by_fqn: dict[str, Unwritten] = {}
        # No placeholder state alive when the load began (the usual case): no entry holds a placeholder.
        self.none = not any_placeholders()

    def __call__(self, fqn: str, entry: dict | None) -> Unwritten:
        if not entry or self.none:
            return _ALL_WRITTEN
        found = self._by_fqn.get(fqn)
        if found is None:
            found = self._by_fqn[fqn] = unwritten_keys(entry)
        return found

    def lists(self, fqn: str, entry: dict | None) -> bool:
        """Whether the entry holds anything somebody wrote (placeholders do not list a parameter)."""
        return bool(entry) and len(self(fqn, entry).keys) < len(entry)


def target_groups(index: ModelIndex, optimizers, problems: list[str]) -> list[TargetGroup] | None:
    """Every param group of ``optimizers``, in order; None if one holds a stranger."""
    targets = []
    for opt in optimizers:
        position = next(i for i, o in enumerate(optimizers) if o is opt)
        for gi, g in enumerate(opt.param_groups):
            fqns = index.fqns_of(g["params"])
            if None in fqns:
                unknown = [i for i, fqn in enumerate(fqns) if fqn is None]
                problems.append(
                    f"the optimizer's param_groups[{gi}] holds parameters that are not the model's "
                    f"(positions {unknown})"
                )
                return None
            targets.append(TargetGroup(opt, g, fqns, position))
    return targets


def parse(osd: Any, index: ModelIndex, targets: list[TargetGroup], strict: bool, problems: list[str]) -> Source | None:
    """``osd`` parsed and matched to ``targets``; None if it is not a state dict at all."""
    unwritten = UnwrittenKeys()
    if is_flat(osd) and bool(osd):
        source = _from_flat(osd, index, targets, strict, problems, unwritten)
    else:
        source = _from_nested(osd, index, targets, problems)
    if source is not None:
        source.unwritten = unwritten
        _index_state(source, index)
    return source


def _index_state(source: Source, index: ModelIndex) -> None:
    """The checkpoint's state by canonical name, and the canonical names of everything it lists."""
    source.listed = set().union(*(s.fqns for s in source.groups))  # canonical as parsed
    state = source.state
    if set(map(type, state.values())) <= {dict} and list(map(index.first_name.get, state)) == list(state):
        source.by_name = dict(state)  # (every key a parameter's canonical name, every entry a dict)
    else:
        for fqn, entry in state.items():
            if isinstance(fqn, str) and isinstance(entry, dict):
                canon = index.canonical(fqn)
                if canon is not None and (canon not in source.by_name or fqn == canon):
                    source.by_name[canon] = entry
    if source.unwritten.none:  # an entry lists its parameter if it holds anything
        source.listed.update(filter(source.by_name.__getitem__, source.by_name))
    else:
        source.listed.update(f for f, e in source.by_name.items() if source.unwritten.lists(f, e))


def _from_nested(osd: Any, index: ModelIndex, targets: list[TargetGroup], problems: list[str]) -> Source | None:
    if not isinstance(osd, dict):
        problems.append(f"the optimizer state dict is a {type(osd).__name__}, expected a dict")
        return None
    missing = [k for k in (STATE, GROUPS) if k not in osd]
    if missing:
        problems.append(f"the optimizer state dict has no {' or '.join(repr(k) for k in missing)} entry")
        return None
    state, groups = osd[STATE], osd[GROUPS]
    if not isinstance(state, dict):
        problems.append(f"'state' is a {type(state).__name__}, expected a dict keyed by FQN")
        return None
    if not isinstance(groups, (list, tuple)):
        problems.append(f"'param_groups' is a {type(groups).__name__}, expected a list")
        return None
    sources = []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            problems.append(f"param_groups[{gi}] has no 'params'")
            continue
        params = g["params"]
        if not isinstance(params, (list, tuple)) or not all(map(isinstance, params, itertools.repeat(str))):
            problems.append(f"param_groups[{gi}]['params'] must be a list of FQNs (strings), got {params!r:.80}")
            continue
        # each name's canonical one, or itself (asked in C: tens of thousands of names)
        canonical = list(map(index.first_name.get, params))
        sources.append(SourceGroup(g, canonical if all(canonical) else [c or f for c, f in zip(canonical, params)]))
    keyed = all(map(isinstance, state, itertools.repeat(str)))
    if not keyed or not all(map(isinstance, state.values(), itertools.repeat(dict))):
        for fqn, entry in state.items():
            if not isinstance(fqn, str):
                problems.append(f"state key {fqn!r} is not an FQN; optimizer state must be keyed by parameter names")
            elif not isinstance(entry, dict):
                problems.append(f"state[{fqn!r}] is a {type(entry).__name__}, expected a dict of state values")
    known = index.param_of.__contains__
    foreign = list(itertools.chain.from_iterable(itertools.filterfalse(known, s.fqns) for s in sources))
    foreign += itertools.filterfalse(known, state if keyed else filter(_is_str, state))
    matched = [sources[j] if j is not None else None for j in _match_groups(targets, sources)]
    return Source(sources, matched, state, foreign)


def _is_str(obj: Any) -> bool:
    return isinstance(obj, str)


def _match_groups(targets: list[TargetGroup], sources: list[SourceGroup]) -> list[int | None]:
    """For each target group, the index of its source group (or None)."""
    if len(targets) == len(sources) and all(set(t.fqns) == set(s.fqns) for t, s in zip(targets, sources)):
        return list(range(len(targets)))
    owner: dict[str, int] = {}
    for j, s in enumerate(sources):
        for f in s.fqns:
            owner.setdefault(f, j)
    matches: list[int | None] = []
    for t in targets:
        votes = Counter(owner[f] for f in t.fqns if f in owner)
        matches.append(min(votes, key=lambda j: (-votes[j], j)) if votes else None)
    # Groups without parameters have nothing to match by: they pair up in order.
    empty_t = [i for i, t in enumerate(targets) if not t.fqns]
    empty_s = [j for j, s in enumerate(sources) if not s.fqns]
    for i, j in zip(empty_t, empty_s):
        matches[i] = j
    return matches


def unpaired_groups(targets: list[TargetGroup], source: Source) -> list[str]:
    """Groups of the checkpoint and of the optimizers that do not pair up one
    to one, empty groups counted (a problem under ``strict``).

    A flat dict has no list of groups (its groups follow the parameters), so
    it has nothing to count. A dict gathered from pipeline stages holds each
    stage's groups: groups with none of this rank's parameters belong to
    another stage (and its empty groups cannot be told apart), and a group
    whose parameters load with another group of the same fields is the
    same group of another stage.
    """
    if not source.nested:
        return []
    foreign = set(source.foreign)
    others = {s for s in source.groups if s.fqns and all(f in foreign for f in s.fqns)}
    uses = Counter(m for m in source.matched if m is not None)
    target_of = {f: i for i, t in enumerate(targets) for f in t.fqns}

    def same_as_matched(s: SourceGroup) -> bool:
        homes = {target_of.get(f) for f in s.fqns}
        return (
            bool(s.fqns)
            and None not in homes
            and all(
                source.matched[i] is not None
                and not _differs(_group_fields(source.matched[i].fields), _group_fields(s.fields))
                for i in homes
            )
        )

    problems = []
    for j, s in enumerate(source.groups):
        if uses[s] > 1:
            shared = [i for i, m in enumerate(source.matched) if m is s]
            problems.append(
                f"the checkpoint's param_groups[{j}] ({_describe(s.fields, s.fqns)}) "
                f"holds the parameters of the optimizer's groups {shared}"
            )
        elif not uses[s] and not (others and (s in others or not s.fqns)) and not same_as_matched(s):
            problems.append(
                f"the checkpoint's param_groups[{j}] ({_describe(s.fields, s.fqns)}) matches no group of the optimizer"
            )
    for i, (t, m) in enumerate(zip(targets, source.matched)):
        if m is None and not (others and not t.fqns):
            problems.append(
                f"the optimizer's param_groups[{i}] ({_describe(t.group, t.fqns)}) has no group in the checkpoint"
            )
    if not problems:
        return []
    counts = (
        f"the checkpoint has {len(source.groups)} param groups, the optimizer {len(targets)} "
        "(empty groups counted, strict=True)"
    )
    return [f"{counts}: " + "; ".join(problems)]


def _group_fields(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def _describe(fields: dict, fqns: list[str]) -> str:
    what = f"{len(fqns)} parameters: {fqns[:3]}{' ...' if len(fqns) > 3 else ''}" if fqns else "empty"
    name = fields.get("name")
    return f"{what}, name {name!r}" if isinstance(name, str) else what


def _from_flat(
    osd: dict,
    index: ModelIndex,
    targets: list[TargetGroup],
    strict: bool,
    problems: list[str],
    unwritten: UnwrittenKeys,
) -> Source:
    """Source groups aligned with the target's groups, rebuilt from a flat dict."""
    read = index.kept_flat_keys.read(osd) if index.kept_flat_keys is not None else None
    state, fields, unknown, clashes = (*read, [], []) if read is not None else unflatten(osd, set(index.param_of))
    problems += clashes
    listed = _listed(state, fields, unwritten)
    aligned: list[SourceGroup | None] = []
    for t in targets:
        present = listed(t.fqns)
        if not present:
            aligned.append(None)
            continue
        # Parameters of one group often share one dict of fields (see unflatten):
        # each distinct dict is compared once, under the first FQN that has it.
        others = list(map(fields.get, present))
        ids = list(map(id, others))
        chosen = next((o for o in others if o is not None), {})
        first = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))  # where each distinct dict is first
        for at in sorted(first.values()):
            other, f = others[at], present[at]
            if other is None or other is chosen:
                continue
            if other.keys() == chosen.keys() and all(map(operator.is_, other.values(), chosen.values())):
                continue  # one group's own values, as a get writes them
            if _differs(other, chosen):
                differing = sorted(k for k in set(other) | set(chosen) if _differs(other.get(k), chosen.get(k)))
                if strict:
                    problems.append(
                        f"param_groups fields of {f!r} differ from {present[0]!r} in the same group: {differing}"
                    )
                break
        aligned.append(SourceGroup(chosen, present))
    return Source([s for s in aligned if s is not None], aligned, state, unknown, nested=False)


def _listed(state: dict, fields: dict, unwritten: UnwrittenKeys):
    """The FQNs among those given that a flat checkpoint lists: with state or
    group fields that somebody wrote (placeholder state lists nothing)."""
    alive = any_placeholder_values()
    if unwritten.none and not alive:  # (no placeholder state alive: anything there lists it)
        return lambda fqns: list(
            itertools.compress(
                fqns, map(operator.or_, map(bool, map(state.get, fqns)), map(bool, map(fields.get, fqns)))
            )
        )

    def lists(f: str) -> bool:
        if unwritten.lists(f, state.get(f)):
            return True
        # Group fields count unless they are still the placeholder state's own objects
        # (DCP replaces every value it loads; some it copies even when not).
        if not alive:
            return bool(fields.get(f))
        values = list(fields.get(f, {}).values())
        return bool(values) and not any(is_placeholder_value(v) for v in values)

    return lambda fqns: list(filter(lists, fqns))


def _differs(a, b) -> bool:
    if a is b:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return True
        if all(map(operator.is_, a.values(), map(b.__getitem__, a))):  # one group's own values, as a get writes them
            return False
        return any(_differs(a[k], b[k]) for k in a)
    try:
        return bool(a != b)
    except Exception:
        return True
