"""Saved placeholder states: a never-stepped optimizer's placeholder state, told by its values.

A placeholder state that was copied (torch.save, a DCP round trip, a clone) is no
longer the object that was marked as a placeholder (:mod:`hyperdsd.state.placeholders.marks`);
what survives is its values. ``step`` is 0 (zeroed when the placeholder state is
made: "never stepped"), which no optimizer that counts its steps holds after
a step of its own; every other value is what the class's first
zero-gradient step leaves (zeros for Adam's moments). An entry counts as a
saved placeholder state only when both hold: ``step`` is 0 and every other value
equals, key for key, the placeholder state the target optimizer itself would give for
that parameter (:mod:`hyperdsd.state.placeholders.scratch`). Such an entry says "never stepped": the
parameter ends without state, a stepped target's own included. Optimizers
whose constructor makes state (Adagrad's ``sum``) have none: their
never-stepped state is real and loads as such.

State without ``step`` (SGD's momentum buffer) has no count to tell it by,
and one such entry cannot be told from a real one (a parameter whose
gradients were all zero keeps a zero buffer). So these entries are judged
together, optimizer by optimizer: they are a saved placeholder state only if every
one of them the load holds for that optimizer equals, key for key, its own
placeholder state, on every rank. A checkpoint taken after a real step has real
values in some of them, and then all load as state.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, NamedTuple

import torch

from ... import _compat
from ..loading.plan import TensorMeta
from .marks import state_tensors


class _Fill(NamedTuple):
    """A placeholder state tensor, summarised: its global shape and the one value all
    its elements hold (``UNKNOWN``: this rank's shard has no elements;
    ``VARIES``: not one value)."""

    shape: tuple
    value: Any


UNKNOWN = object()
VARIES = object()


def tensor_fill(t: torch.Tensor) -> Any:
    """The one value every element of ``t`` (this rank's shard) holds, ``UNKNOWN`` or ``VARIES``."""
    local = _compat.local_tensor(t)
    if local.numel() == 0:
        return UNKNOWN
    flat = local.reshape(-1)
    first = flat[0]
    if local.numel() > 1 and bool(flat[-1] != first):
        return VARIES  # real state, told without a pass over all of it
    return first.item() if bool((local == first).all()) else VARIES


def step_is_zero(entry: dict) -> bool:
    """Whether ``entry`` holds ``step`` 0 (a tensor, a number, or a broadcast
    manifest's stand-in carrying the root's value as ``fill``)."""
    step = entry.get("step")
    if isinstance(step, bool) or step is None:
        return False
    if isinstance(step, (int, float)):
        return step == 0
    if isinstance(step, torch.Tensor):
        local = _compat.local_tensor(step)
        return local.numel() == 1 and local.item() == 0  # item(): a twentieth of a comparison's cost
    fill = getattr(step, "fill", None)
    return fill is not None and fill == 0 and _numel(step.shape) == 1


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Fill(tuple(value.shape), tensor_fill(value))
    if isinstance(value, dict):
        return {k: _summary(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_summary(v) for v in value)
    return copy.deepcopy(value)


def placeholder_fills(found: tuple[dict, set] | None) -> dict:
    """What an optimizer's never-stepped placeholder state holds, by parameter, each
    tensor summarised (:class:`_Fill`), from :func:`scratch_step`'s result.
    Parameters whose state the constructor makes, and optimizers that cannot
    be stepped on a copy (``found`` None), have no entry."""
    if found is None:
        return {}
    state, eager = found
    return {
        p: {k: _summary(v) for k, v in entry.items() if k != "step"}
        for p, entry in state.items()
        if p not in eager and "step" in entry
    }


def stepless_fills(found: tuple[dict, set] | None) -> dict:
    """Like :func:`placeholder_fills`, for the entries without ``step`` (SGD's
    momentum buffer): what the never-stepped placeholder state holds, by parameter."""
    if found is None:
        return {}
    state, eager = found
    return {
        p: {k: _summary(v) for k, v in entry.items()}
        for p, entry in state.items()
        if p not in eager and "step" not in entry
    }


def surely_real(entry: dict) -> bool:
    """Whether this rank's part of ``entry`` holds a tensor that is not one
    value throughout (no placeholder state holds such): a cheap first look that spares
    building the placeholder state for a load of real state."""
    for v in entry.values():
        for t in state_tensors(v):
            if tensor_fill(t) is VARIES:
                return True
        if not isinstance(v, torch.Tensor) and getattr(v, "shape", None) is not None and getattr(v, "fill", 0) is None:
            return True  # a broadcast manifest's stand-in the root found not to be one value
    return False


def is_saved_stepless_placeholder(entry: dict, fills: dict | None) -> bool:
    """Whether ``entry`` (no ``step``) equals, as far as this rank can see, the
    target optimizer's own placeholder state for its parameter (``fills``:
    :func:`stepless_fills`'s entry). Only all of an optimizer's such entries
    together, on every rank, make a saved placeholder state (the caller agrees)."""
    return fills is not None and entry.keys() == fills.keys() and all(_matches(v, fills[k]) for k, v in entry.items())


def _matches(value: Any, summary: Any) -> bool:
    """Whether this rank's part of ``value`` holds what ``summary`` says
    (parts this rank cannot see do not contradict it: other ranks check them)."""
    if isinstance(summary, _Fill):
        if isinstance(value, torch.Tensor):
            if tuple(value.shape) != summary.shape:
                return False
            local = _compat.local_tensor(value)
            if local.numel() == 0 or summary.value is UNKNOWN:
                return True
            return summary.value is not VARIES and bool((local == summary.value).all())
        fill = getattr(value, "fill", None)  # a broadcast manifest's stand-in
        if fill is None or tuple(getattr(value, "shape", ())) != summary.shape:
            return False
        return summary.value is UNKNOWN or (summary.value is not VARIES and fill == summary.value)
    if isinstance(summary, dict):
        return (
            isinstance(value, dict)
            and value.keys() == summary.keys()
            and all(_matches(value[k], summary[k]) for k in value)
        )
    if isinstance(summary, (list, tuple)):
        return (
            type(value) is type(summary)
            and len(value) == len(summary)
            and all(_matches(v, s) for v, s in zip(value, summary))
        )
    if isinstance(value, torch.Tensor):
        return False
    try:
        return bool(value == summary)
    except Exception:  # noqa: BLE001 - an odd value is not the placeholder state's
        return False


def is_saved_placeholder(entry: dict, fills: dict | None) -> bool:
    """Whether ``entry`` is, as far as this rank can see, a never-stepped
    optimizer's placeholder state that was saved: ``step`` 0 and every other value the
    target optimizer's own placeholder state (``fills``: :func:`placeholder_fills`'s entry
    for the parameter). Ranks see different shards: the caller agrees across
    ranks (real if any rank sees real state)."""
    if fills is None or not step_is_zero(entry):
        return False
    rest = {k: v for k, v in entry.items() if k != "step"}
    return rest.keys() == fills.keys() and all(_matches(v, fills[k]) for k, v in rest.items())


def steps_nonzero(entries: list[dict]) -> bool:
    """Whether every entry's ``step`` is a one-element tensor that is not 0 (a stand-in without a fill)
    (so that none is a saved placeholder state, see :func:`~hyperdsd.state.placeholders.saved.step_is_zero`),
    told for all at once; False where not, or not told so."""
    try:
        steps = list(map(operator.itemgetter("step"), entries))
    except KeyError:
        return False
    kinds = set(map(type, steps))
    if kinds == {TensorMeta}:  # a broadcast's: the root worked out the value of the entries that may be 0
        return set(map(operator.attrgetter("fill"), steps)) == {None}
    if kinds != {torch.Tensor}:
        return False
    try:
        values = list(map(torch.Tensor.item, steps))  # (one-element tensors only)
    except (RuntimeError, ValueError):
        return False
    return 0 not in values


def never_stepped_tensors(osd: Any) -> set[int]:
    """The ids of the tensors of every entry of ``osd`` (nested or flat)
    that may be a saved placeholder state (``step`` 0, or no ``step`` at all): what a
    broadcast's root summarises (:func:`tensor_fill`) so that every rank can
    tell a saved placeholder state from its manifest."""
    if not isinstance(osd, dict):
        return set()
    out: set[int] = set()
    state = osd.get("state")
    if isinstance(state, dict):
        entries = list(state.values())
        if set(map(type, entries)) <= {dict} and steps_nonzero(entries):
            return out  # a stepped optimizer's (told for all entries at once)
        for entry in entries:
            if isinstance(entry, dict) and ("step" not in entry or step_is_zero(entry)):
                out.update(id(t) for v in entry.values() for t in state_tensors(v))
        return out
    stepped = {
        k[: -len(".step")]
        for k, v in osd.items()
        if isinstance(k, str) and k.startswith("state.") and k.endswith(".step") and not step_is_zero({"step": v})
    }
    for k, v in osd.items():
        if isinstance(v, torch.Tensor) and isinstance(k, str) and k.startswith("state."):
            if not stepped or not any(k[:i] in stepped for i, ch in enumerate(k) if ch == "."):
                out.add(id(v))
    return out
