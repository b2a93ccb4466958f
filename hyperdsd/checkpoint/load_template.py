"""A DCP load template's optimizer state, judged against a checkpoint's metadata.

DCP flattens the state dict it loads into keys such as
``optim.state.{fqn}.{key}``; each key's path (a tuple) comes from the
planner's mappings, so FQNs, which contain dots, are never split by
guessing. Optimizer state dicts are found in the template by their shape
(nested, or flat; see :mod:`hyperdsd.state.keys.flat`), wherever the user put them.

Each parameter's state *entry* in the template is judged as a whole:

- every key of it is in the checkpoint: it loads;
- none of it is, and the template's entry is a placeholder (a never-stepped
  optimizer's, see :mod:`hyperdsd.state.placeholders.marks`): lazy state, the parameter never had a
  gradient; the entry is left out of the load and the parameter stays
  without state;
- some keys are there and others are not: corruption, a problem naming the
  FQN and the missing keys;
- none of a stepped optimizer's real entry is there: a problem under
  ``strict`` (real state is required, as everything else in the template).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..state.keys.flat import GROUPS, STATE, split_fqn
from ..state.placeholders.marks import is_placeholder_value, is_unwritten_placeholder

Path = tuple  # a DCP object path: str keys and int list indices


def dcp_key(path: Path) -> str:
    """The flat key DCP gives ``path``."""
    return ".".join(map(str, path))


@dataclass
class Entry:
    """One parameter's keys in one optimizer state dict of the template."""

    fqn: str
    prefix: str  # the DCP key of its state; each state key is ``prefix + "." + key``
    fields_prefix: str = ""  # flat layout: the same for its group fields (``param_groups.{fqn}``)
    keys: list[str] = field(default_factory=list)  # the template's DCP keys of its state
    fields: list[str] = field(default_factory=list)  # flat layout: those of its group fields
    placeholder: bool = False  # a never-stepped optimizer's template entry

    def name(self, key: str) -> str:
        return key[len(self.prefix) + 1 :]


def _is_flat_optimizer(value: Mapping) -> bool:
    prefixes = (f"{STATE}.", f"{GROUPS}.")
    return bool(value) and all(isinstance(k, str) and k.startswith(prefixes) for k in value)


def optimizer_roots(state_dict: Any) -> dict[Path, tuple[str, Mapping]]:
    """The optimizer state dicts in ``state_dict`` by path: ("nested" or "flat", the dict)."""
    roots: dict[Path, tuple[str, Mapping]] = {}
    _find_roots(roots, (), state_dict)
    return roots


def _find_roots(roots: dict[Path, tuple[str, Mapping]], path: Path, value: Any) -> None:
    """:func:`optimizer_roots`' walk (not a closure: a recursive one is a cycle)."""
    if isinstance(value, Mapping):
        if STATE in value and GROUPS in value:
            roots[path] = ("nested", value)
        elif _is_flat_optimizer(value):
            roots[path] = ("flat", value)
        else:
            for k, v in value.items():
                _find_roots(roots, path + (str(k),), v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _find_roots(roots, path + (i,), v)


def _flat_fqns(flat: Mapping) -> set[str]:
    """The FQNs a flat optimizer dict names in its group fields (``param_groups.{fqn}.{field}``)."""
    head = f"{GROUPS}."
    return {k[len(head) :].rpartition(".")[0] for k in flat if k.startswith(head)}


def optimizer_entries(original: Any, flat: dict[str, Any], mappings: dict[str, Path]) -> list[Entry]:
    """Every parameter's entry in the template's optimizer state dicts, with its DCP keys.

    ``original`` is the template as the user passed it; ``flat`` and
    ``mappings`` are DCP's flattening of it (flat key -> value, flat key -> path).
    """
    roots = optimizer_roots(original)
    if not roots:
        return []
    fqns_of: dict[Path, set[str]] = {}
    entries: dict[str, Entry] = {}
    for key, path in mappings.items():
        found = _entry_of(path, roots, fqns_of)
        if found is None:
            continue
        fqn, root, is_field = found
        prefix = dcp_key(root + (STATE, fqn))
        entry = entries.setdefault(prefix, Entry(fqn, prefix, dcp_key(root + (GROUPS, fqn))))
        value = flat.get(key)
        (entry.fields if is_field else entry.keys).append(key)
        entry.placeholder = (
            entry.placeholder or is_unwritten_placeholder(value) or (is_field and is_placeholder_value(value))
        )
    return list(entries.values())


def _entry_of(
    path: Path, roots: dict[Path, tuple[str, Mapping]], fqns_of: dict[Path, set[str]]
) -> tuple[str, Path, bool] | None:
    """(FQN, root path, whether a group field) of a key's path, for the state
    of a parameter (and, in the flat layout, its group fields); None for any other key."""
    for i in range(len(path)):
        if path[:i] not in roots:
            continue
        kind, root = roots[path[:i]]
        rest = path[i:]
        if kind == "nested":
            if len(rest) >= 3 and rest[0] == STATE:
                return str(rest[1]), path[:i], False
            return None
        head, _, inner = str(rest[0]).partition(".")
        if len(rest) != 1 or head not in (STATE, GROUPS):
            return None
        if path[:i] not in fqns_of:
            fqns_of[path[:i]] = _flat_fqns(root)
        split = split_fqn(inner, fqns_of[path[:i]])
        fqn = split[0] if split is not None else inner.rpartition(".")[0]
        return fqn, path[:i], head == GROUPS
    return None


def judge(entries: list[Entry], in_checkpoint: Mapping[str, Any], *, strict: bool) -> tuple[list[str], list[str]]:
    """(keys to leave out of the load, problems) for the template's entries."""
    ordered = sorted(in_checkpoint)
    drop: list[str] = []
    problems: list[str] = []
    for entry in entries:
        missing = [k for k in entry.keys if k not in in_checkpoint]
        if not missing:
            continue
        present = [entry.name(k) for k in entry.keys if k in in_checkpoint]
        others = _keys_under(ordered, entry.prefix + ".") if not present else []
        lacking = sorted(entry.name(k) for k in missing)
        if present:
            problems.append(f"state[{entry.fqn!r}] is incomplete: lacks {lacking}, has {sorted(present)}")
        elif others:
            problems.append(
                f"state[{entry.fqn!r}] holds {sorted(entry.name(k) for k in others)[:8]}, "
                f"not the keys this optimizer keeps ({lacking}): saved by another optimizer?"
            )
        elif entry.placeholder:
            drop += entry.keys  # lazy state: the parameter never had a gradient
            if entry.fields and not _keys_under(ordered, entry.fields_prefix + "."):
                # Flat layout, and nothing of the parameter in the checkpoint:
                # set decides (strict names it; otherwise it stays fresh).
                drop += entry.fields
        elif strict:
            problems.append(
                f"state[{entry.fqn!r}] is not in the checkpoint (lacks {lacking}), but the optimizer has state for it"
            )
    return drop, problems


def _keys_under(ordered: list[str], prefix: str) -> list[str]:
    """Keys of the sorted list ``ordered`` that start with ``prefix``."""
    i = bisect.bisect_left(ordered, prefix)
    out = []
    while i < len(ordered) and ordered[i].startswith(prefix):
        out.append(ordered[i])
        i += 1
    return out


def unexpected(asked: set[str], tops: set[str], in_checkpoint: Mapping[str, Any]) -> list[str]:
    """Checkpoint keys under the top-level names ``tops`` that are not in ``asked``."""
    heads = tuple(f"{t}." for t in tops)
    return sorted(k for k in in_checkpoint if k not in asked and (k in tops or k.startswith(heads)))


# -- state the checkpoint holds for parameters the template has none for -------
#
# A stepped optimizer's state dict has entries only for parameters with state
# (torch's shape); a parameter without any (frozen, or without a gradient so
# far) has none, while the checkpoint may hold state for it: real state, or a
# never-stepped template saved before the first step. The optimizer lists the
# parameter in its groups, so the entry is its own, not another model's: the
# template gets one, allocated from the checkpoint's metadata, and set judges
# what was loaded as it judges any entry (a saved template: no state).


def _fqns_without_state(kind: str, root: Mapping) -> list[str]:
    """The FQNs an optimizer state dict lists in its groups but holds no state for."""
    if kind == "nested":
        groups = root.get(GROUPS)
        state = root.get(STATE)
        if not isinstance(groups, list) or not isinstance(state, Mapping):
            return []
        listed = [f for g in groups if isinstance(g, Mapping) for f in (g.get("params") or ()) if isinstance(f, str)]
        return [f for f in dict.fromkeys(listed) if f not in state]
    fqns = _flat_fqns(root)
    head = f"{STATE}."
    with_state = set()
    for key in root:
        if key.startswith(head) and (split := split_fqn(key[len(head) :], fqns)) is not None:
            with_state.add(split[0])
    return sorted(fqns - with_state)


def _tail(saved: Any, head: Path, rest: str) -> Path | None:
    """The path below ``head`` (a parameter's state entry) of a checkpoint key:
    from the path DCP saved with the key where it has one under ``head``, else
    ``rest`` (the key's remainder) if it has no dots; None: cannot be told."""
    if isinstance(saved, (tuple, list)) and len(saved) > len(head):
        saved = tuple(saved)
        if dcp_key(saved[: len(head)]) == dcp_key(head) and saved[len(head) - 1] == head[-1]:
            return saved[len(head) :]
    return (rest,) if "." not in rest else None


def _put(container: Any, path: Path, value: Any) -> None:
    """``container[path[0]]...[path[-1]] = value``, making the dicts and lists on the way."""
    for step, after in zip(path, path[1:]):
        if isinstance(container, list):
            while len(container) <= step:
                container.append(None)
            if container[step] is None:
                container[step] = [] if isinstance(after, int) else {}
            container = container[step]
        else:
            container = container.setdefault(step, [] if isinstance(after, int) else {})
    if isinstance(container, list):
        while len(container) <= path[-1]:
            container.append(None)
    container[path[-1]] = value


def _empty_like_saved(md: Any) -> Any:
    """What a saved value loads into: a tensor of its global shape and dtype (on the CPU), or None for an object."""
    if isinstance(md, TensorStorageMetadata):
        return torch.empty(md.size, dtype=md.properties.dtype)
    return None


def add_saved_state(original: Any, metadata: Any) -> dict[str, tuple[Path, Any]]:
    """Entries in the template's optimizer state dicts for the parameters they
    list but hold no state for, where the checkpoint holds state for them.

    Each gets every key the checkpoint holds under it, as a new value to load
    into (a tensor of the saved global shape, on the CPU; set lays it out like
    its parameter). Changes ``original`` in place; returns the DCP keys added,
    each with its path and value. A parameter whose keys' paths cannot be told
    gets none.
    """
    roots = optimizer_roots(original)
    if not roots:
        return {}
    in_checkpoint = metadata.state_dict_metadata
    saved = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    ordered = sorted(in_checkpoint)
    added: dict[str, tuple[Path, Any]] = {}
    for path, (kind, root) in roots.items():
        base = dcp_key(path) + "." if path else ""
        for fqn in _fqns_without_state(kind, root):
            if kind == "nested":
                head = path + (STATE, fqn)
                prefix = dcp_key(head) + "."
                found = {k: _tail(saved.get(k), head, k[len(prefix) :]) for k in _keys_under(ordered, prefix)}
                if not found or any(t is None for t in found.values()):
                    continue
                entry: dict = {}
                for key, tail in found.items():
                    value = _empty_like_saved(in_checkpoint[key])
                    _put(entry, tail, value)
                    added[key] = (head + tail, value)
                root[STATE][fqn] = entry
            else:
                for key in _keys_under(ordered, f"{base}{STATE}.{fqn}."):
                    name = key[len(base) :]
                    value = root[name] = _empty_like_saved(in_checkpoint[key])
                    added[key] = (path + (name,), value)
    return added
