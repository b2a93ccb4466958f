"""State templates for optimizers that have never stepped.

The usual way to load a checkpoint through DCP is to ask the optimizer for
its state dict, let DCP fill it in place, and set it back. An optimizer that
has never stepped has no state to fill, and stepping it to create some (what
other implementations do) changes it. Here the template is built on a
throwaway optimizer: the same class, built by its own constructor with the
same hyperparameters over zero-filled stand-ins of the parameters, stepped
once with zero gradients. The real optimizer, its parameters and its
gradients are never touched.

Template tensors are *placeholders*: set_* recognises one that nobody wrote
into (its in-place version counter has not moved) and treats it as absent,
so what a partial load did not cover leaves the optimizer as fresh as before.

A template that was saved (a checkpoint taken before the first step, a
copy) is recognised by its values instead: ``step`` 0 and everything else
what the target optimizer's own template holds (see "saved templates"
below). Such an entry says "never stepped": the parameter ends without
state, a stepped target's own included. State without ``step`` (SGD's
momentum) is judged for all of an optimizer's entries together.
"""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from typing import Any, NamedTuple

import torch

from .. import _compat
from ..tree import is_container, leaves

# -- which objects are a template's --------------------------------------------
#
# Two registries keyed by ``id()``: placeholder tensors, with the in-place
# version counter each had when marked, and the group-field values of flat
# templates (floats and tuples that DCP and torch.load must read as they
# are, so they cannot carry a tag). Invariant: an id stays registered only
# while its object lives (a tensor's weakref callback drops it; a value is
# dropped when its template's anchor tensor is collected), and every lookup
# checks that the registered object is the very one asked about, so a
# reused id never matches. The registries keep no template alive.

_placeholders: dict[int, tuple[weakref.ref, int]] = {}  # id -> (the tensor, weakly; its version)
_template_values: dict[int, object] = {}  # id -> the value, while its template's anchor lives


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


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of one state value: itself, or the leaves of a nested one."""
    if isinstance(value, torch.Tensor):
        return [value]
    if is_container(value):
        return [leaf for _, leaf in leaves(value) if isinstance(leaf, torch.Tensor)]
    return []


def has_placeholders(entry: dict) -> bool:
    if not _placeholders:  # no template alive in this process: the usual case, one check per entry
        return False
    return any(id(t) in _placeholders for v in entry.values() for t in _tensors(v))


def _track_values(values: list, anchor: torch.Tensor) -> None:
    for v in values:
        _template_values[id(v)] = v
    weakref.finalize(anchor, _forget_values, [id(v) for v in values])


def _forget_values(ids: list[int]) -> None:
    for i in ids:
        _template_values.pop(i, None)


def is_template_value(value: Any) -> bool:
    """A group field of a flat template, still the template's own object."""
    return id(value) in _template_values and _template_values[id(value)] is value


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
        return Unwritten(set(), False)  # nothing of a template's: every key counts as written
    unwritten, empty, plain = set(), set(), set()
    for k, v in entry.items():
        tensors = _tensors(v)
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


# -- the scratch step --------------------------------------------------------


def _zero_grad_stand_in(p: torch.Tensor) -> torch.Tensor:
    stand_in = torch.zeros_like(p).requires_grad_(True)
    stand_in.grad = torch.zeros_like(p)
    return stand_in


def _scratch_optimizer(opt: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A new optimizer of ``opt``'s class and hyperparameters over ``groups``.

    Built by its own constructor, so it is exactly what its class makes:
    empty state, no hooks of ``opt``'s, no instance-level ``step`` wrapper
    (an LR scheduler's). The groups carry every hyperparameter; the defaults
    the constructor accepts are passed for what a step might read from them.
    A constructor that asks for more than its defaults (a subclass with
    arguments of its own) gets the base constructor and ``opt``'s other
    attributes instead.
    """
    cls = type(opt)
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    kwargs = {k: v for k, v in opt.defaults.items() if takes_any or k in accepted}
    try:
        return cls(groups, **kwargs)
    except TypeError:
        scratch = cls.__new__(cls)
        torch.optim.Optimizer.__init__(scratch, groups, copy.copy(opt.defaults))
        for name, value in vars(opt).items():
            if name != "step":  # an instance-level wrapper belongs to the real optimizer
                vars(scratch).setdefault(name, value)
        return scratch


def scratch_state(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict] | None:
    """The state ``opt`` would have after its first step, built on a copy.

    Returns ``{param: {key: value}}`` for the parameters that would get state,
    or None (with a warning) if this optimizer cannot be stepped on a copy.
    """
    found = scratch_step(opt, warn=True)
    return found[0] if found is not None else None


def scratch_step(opt: torch.optim.Optimizer, warn: bool, only: set | None = None) -> tuple[dict, set] | None:
    """The state of a scratch copy of ``opt`` after one zero-gradient step, by
    parameter, and the parameters whose state its constructor already made
    (state a never-stepped optimizer really has, as Adagrad's). ``only``:
    the copy holds these of its parameters alone (each group keeps its fields)."""
    stand_ins: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in opt.param_groups:
        mine = [p for p in group["params"] if only is None or p in only]
        for p in mine:
            stand_ins[p] = _zero_grad_stand_in(p)
        groups.append({**group, "params": [stand_ins[p] for p in mine]})
    if not stand_ins:
        return {}, set()
    try:
        scratch = _scratch_optimizer(opt, groups)
        eager = {p for p, stand_in in stand_ins.items() if scratch.state.get(stand_in)}
        with torch.enable_grad():
            _compat.unhooked_step(type(opt))(scratch)
    except Exception as exc:  # noqa: BLE001 - any optimizer may refuse a bare step
        if warn:
            warnings.warn(
                f"hyperdsd: cannot build a state template for {type(opt).__name__} ({type(exc).__name__}: {exc}); "
                "a DCP load into this never-stepped optimizer will restore param_groups only",
                stacklevel=4,
            )
        return None
    out = {}
    for p, stand_in in stand_ins.items():
        entry = scratch.state.get(stand_in)
        if entry:
            out[p] = entry
    return out, eager


# -- templates ---------------------------------------------------------------


def template_state(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
    """Placeholder state for a never-stepped optimizer (see module docstring)."""
    return _as_placeholders(scratch_state(opt) or {})


def stateless_template(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
    """Placeholder state for the parameters a stepped optimizer holds no state
    for (frozen, or without a gradient since): what a load checks a
    checkpoint's entries for them against, as a never-stepped optimizer's."""
    return _as_placeholders(stateless_scratch(opt))


def stateless_scratch(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
    """What a step would create for the parameters ``opt`` holds no state for, on a copy ({} if it cannot step)."""
    stateless = {p for g in opt.param_groups for p in g["params"] if not opt.state.get(p)}
    found = scratch_step(opt, warn=False, only=stateless) if stateless else None
    return found[0] if found is not None else {}


def _as_placeholders(state: dict[torch.Tensor, dict]) -> dict[torch.Tensor, dict]:
    for entry in state.values():
        for key, value in entry.items():
            if key == "step" and isinstance(value, torch.Tensor):
                value.zero_()  # a placeholder that is saved as is means "never stepped"
            for t in _tensors(value):
                mark_placeholder(t)
    return state


# Group fields of a flat template are recognised by identity (see above): the
# template holds objects made for it, and anything DCP loads arrives as a new
# object.
def _fresh(value: Any) -> tuple[Any, bool]:
    """A new object equal to ``value``, and whether it is unique (not a cached singleton)."""
    if isinstance(value, float):
        return value + 0.0, True  # float arithmetic always allocates
    if isinstance(value, (tuple, list)) and value:
        return type(value)(list(value)), True
    return value, False


def track_template_fields(flat: dict, anchor: torch.Tensor) -> None:
    """Replace the group fields of a flat template by tracked copies.

    The copies stay known while ``anchor`` (one of the template's
    placeholders) lives; nothing is kept after the template is gone.
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
    for value in flat.values():
        if is_unwritten_placeholder(value):
            return value
    return None


# -- saved templates -----------------------------------------------------------
#
# A template that was copied (torch.save, a DCP round trip, a clone) is no
# longer the object that was registered above; what survives is its values.
# ``step`` is 0 (zeroed when the template is made: "never stepped"), which
# no optimizer that counts its steps holds after a step of its own; every
# other value is what the class's first zero-gradient step leaves (zeros for
# Adam's moments). An entry counts as a saved template only when both hold:
# ``step`` is 0 and every other value equals, key for key, the template the
# target optimizer itself would give for that parameter. Optimizers whose
# constructor makes state (Adagrad's ``sum``) have none: their never-stepped
# state is real and loads as such.
#
# State without ``step`` (SGD's momentum buffer) has no count to tell it by,
# and one such entry cannot be told from a real one (a parameter whose
# gradients were all zero keeps a zero buffer). So these entries are judged
# together, optimizer by optimizer: they are a saved template only if every
# one of them the load holds for that optimizer equals, key for key, its own
# template, on every rank. A checkpoint taken after a real step has real
# values in some of them, and then all load as state.


class _Fill(NamedTuple):
    """A template tensor, summarised: its global shape and the one value all
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


def template_fills(found: tuple[dict, set] | None) -> dict:
    """What an optimizer's never-stepped template holds, by parameter, each
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
    """Like :func:`template_fills`, for the entries without ``step`` (SGD's
    momentum buffer): what the never-stepped template holds, by parameter."""
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
    value throughout (no template holds such): a cheap first look that spares
    building the template for a load of real state."""
    for v in entry.values():
        for t in _tensors(v):
            if tensor_fill(t) is VARIES:
                return True
        if not isinstance(v, torch.Tensor) and getattr(v, "shape", None) is not None and getattr(v, "fill", 0) is None:
            return True  # a broadcast manifest's stand-in the root found not to be one value
    return False


def is_saved_stepless_template(entry: dict, fills: dict | None) -> bool:
    """Whether ``entry`` (no ``step``) equals, as far as this rank can see, the
    target optimizer's own template for its parameter (``fills``:
    :func:`stepless_fills`'s entry). Only all of an optimizer's such entries
    together, on every rank, make a saved template (the caller agrees)."""
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
    except Exception:  # noqa: BLE001 - an odd value is not the template's
        return False


def is_saved_template(entry: dict, fills: dict | None) -> bool:
    """Whether ``entry`` is, as far as this rank can see, a never-stepped
    optimizer's template that was saved: ``step`` 0 and every other value the
    target optimizer's own template (``fills``: :func:`template_fills`'s entry
    for the parameter). Ranks see different shards: the caller agrees across
    ranks (real if any rank sees real state)."""
    if fills is None or not step_is_zero(entry):
        return False
    rest = {k: v for k, v in entry.items() if k != "step"}
    return rest.keys() == fills.keys() and all(_matches(v, fills[k]) for k, v in rest.items())


def never_stepped_tensors(osd: Any) -> set[int]:
    """The ids of the tensors of every entry of ``osd`` (nested or flat)
    that may be a saved template (``step`` 0, or no ``step`` at all): what a
    broadcast's root summarises (:func:`tensor_fill`) so that every rank can
    tell a saved template from its manifest."""
    if not isinstance(osd, dict):
        return set()
    out: set[int] = set()
    state = osd.get("state")
    if isinstance(state, dict):
        for entry in state.values():
            if isinstance(entry, dict) and ("step" not in entry or step_is_zero(entry)):
                out.update(id(t) for v in entry.values() for t in _tensors(v))
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
