"""Placeholders: the tensors of a never-stepped optimizer's placeholder state.

The usual way to load a checkpoint through DCP is to ask the optimizer for
its state dict, let DCP fill it in place, and set it back. An optimizer that
has never stepped has no state to fill: a get gives a placeholder state instead
(:mod:`hyperdsd.state.placeholders.scratch`), whose tensors are *placeholders*. set_* recognises one
that nobody wrote into (its in-place version counter has not moved) and
treats it as absent, so what a partial load did not cover leaves the
optimizer as fresh as before. A placeholder state that was saved comes back as
copies, and is recognised by its values instead (:mod:`hyperdsd.state.placeholders.saved`).
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from ... import _compat
from ...tree import is_container, leaves

# -- which objects are a placeholder state's --------------------------------------------
#
# Two registries keyed by ``id()``: placeholder tensors, with the in-place
# version counter each had when marked, and the group-field values of flat
# placeholder states (floats and tuples that DCP and torch.load must read as they
# are, so they cannot carry a tag). Keyed by ``id()`` because nothing of ours
# travels with a placeholder state (a get returns it, DCP fills it, set_* is handed it
# back) and tensors compare elementwise. Invariant: an id stays registered only
# while its object lives (a tensor's weakref callback drops it; a value is
# dropped when its placeholder state's anchor tensor is collected), and every lookup
# checks that the registered object is the very one asked about, so a
# reused id never matches. The registries keep no placeholder state alive.

_placeholders: dict[int, tuple[weakref.ref, int]] = {}  # id -> (the tensor, weakly; its version)
_placeholder_values: dict[int, object] = {}  # id -> the value, while its placeholder state's anchor lives


def mark_placeholder(t: torch.Tensor) -> torch.Tensor:
    key = id(t)
    _placeholders[key] = (weakref.ref(t, lambda _ref, key=key: _placeholders.pop(key, None)), _compat.version_of(t))
    return t


def is_unwritten_placeholder(value: Any) -> bool:
    """A placeholder nobody wrote into (its version counter has not moved)."""
    if not isinstance(value, torch.Tensor):
        return False
    entry = _placeholders.get(id(value))
    return entry is not None and entry[0]() is value and _compat.version_of(value) == entry[1]


def state_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of one state value: itself, or the leaves of a nested one."""
    if isinstance(value, torch.Tensor):
        return [value]
    if is_container(value):
        return [leaf for _, leaf in leaves(value) if isinstance(leaf, torch.Tensor)]
    return []


def any_placeholders() -> bool:
    """Whether any placeholder state's placeholder is alive in this process (if not, no entry holds one)."""
    return bool(_placeholders)


def has_placeholders(entry: dict) -> bool:
    if not _placeholders:  # no placeholder state alive in this process: the usual case, one check per entry
        return False
    return any(id(t) in _placeholders for v in entry.values() for t in state_tensors(v))


def _track_values(values: list, anchor: torch.Tensor) -> None:
    for v in values:
        _placeholder_values[id(v)] = v
    weakref.finalize(anchor, _forget_values, [id(v) for v in values])


def _forget_values(ids: list[int]) -> None:
    for i in ids:
        _placeholder_values.pop(i, None)


def any_placeholder_values() -> bool:
    """Whether any flat placeholder state's group fields are alive in this process (if not, no value is one)."""
    return bool(_placeholder_values)


def is_placeholder_value(value: Any) -> bool:
    """A group field of a flat placeholder state, still the placeholder state's own object."""
    return id(value) in _placeholder_values and _placeholder_values[id(value)] is value


class Unwritten(NamedTuple):
    keys: set  # keys holding only placeholders nobody wrote into
    unknown: bool  # this rank cannot tell (only empty shards of placeholders)


def unwritten_keys(entry: dict) -> Unwritten:
    """Keys of ``entry`` that are placeholders nobody wrote into, and whether
    that cannot be told here.

    A key is unwritten when it holds tensors (itself, or nested in dicts and
    lists) and every one of them is a placeholder nobody wrote into. Values
    without tensors (numbers, strings) cannot tell: they follow the rest of
    their entry. So does a placeholder with no elements (this rank's shard of
    a parameter with fewer rows than ranks), which cannot be written. When
    such empty placeholders are all the entry has, this rank cannot tell;
    ranks holding a non-empty shard of the same parameter can (the caller
    asks them, see ``collectives.agree``). Until then they count as written.
    """
    if not has_placeholders(entry):
        return Unwritten(set(), False)  # nothing of a placeholder state's: every key counts as written
    unwritten, empty, plain = set(), set(), set()
    for k, v in entry.items():
        tensors = state_tensors(v)
        if not tensors:
            plain.add(k)
        elif all(is_unwritten_placeholder(t) for t in tensors):
            unwritten.add(k)
            if all(_compat.local_tensor(t).numel() == 0 for t in tensors):
                empty.add(k)
    holding = len(entry) - len(plain)
    unknown = bool(empty) and len(empty) == len(unwritten) == holding
    if empty and (len(unwritten) < holding or unknown):
        unwritten -= empty
    if unwritten and len(unwritten) == holding:
        unwritten |= plain
    return Unwritten(unwritten, unknown)


# Group fields of a flat placeholder state are recognised by identity (see above): the
# placeholder state holds objects made for it, and anything DCP loads arrives as a new
# object.
def _fresh(value: Any) -> tuple[Any, bool]:
    """A new object equal to ``value``, and whether it is unique (not a cached singleton)."""
    if isinstance(value, float):
        return value + 0.0, True  # float arithmetic always allocates
    if isinstance(value, (tuple, list)) and value:
        return type(value)(list(value)), True
    return value, False


def track_placeholder_fields(flat: dict, anchor: torch.Tensor) -> None:
    """Replace the group fields of a flat placeholder state by tracked copies.

    The copies stay known while ``anchor`` (one of the placeholder state's
    placeholders) lives; nothing is kept after the placeholder state is gone.
    """
    tracked = []
    for key, value in flat.items():
        if isinstance(key, str) and key.startswith("param_groups."):
            copy_, unique = _fresh(value)
            if unique:
                flat[key] = copy_
                tracked.append(copy_)
    if tracked:
        _track_values(tracked, anchor)


def first_placeholder(flat: dict) -> torch.Tensor | None:
    if not _placeholders:  # none alive in this process
        return None
    for value in flat.values():
        if is_unwritten_placeholder(value):
            return value
    return None
