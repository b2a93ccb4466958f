"""State templates for optimizers that have never stepped.

The usual way to load a checkpoint through DCP is to ask the optimizer for
its state dict, let DCP fill it in place, and set it back. An optimizer that
has never stepped has no state to fill, and stepping it to create some (what
other implementations do) changes it. Here the template is built on a
throwaway copy: the same class and hyperparameters over zero-filled stand-ins
of the parameters, stepped once with zero gradients. The real optimizer, its
parameters and its gradients are never touched.

Template tensors are *placeholders*: set_* recognises one that nobody wrote
into (its in-place version counter has not moved) and treats it as absent,
so what a partial load did not cover leaves the optimizer as fresh as before.
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections import OrderedDict, defaultdict
from typing import Any

import torch

from . import _compat

_placeholders: dict[int, tuple[weakref.ref, int]] = {}


def _forget(key: int) -> None:
    _placeholders.pop(key, None)


def mark_placeholder(t: torch.Tensor) -> torch.Tensor:
    key = id(t)
    _placeholders[key] = (weakref.ref(t, lambda _ref, key=key: _forget(key)), _compat.version_of(t))
    return t


def is_unwritten_placeholder(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    entry = _placeholders.get(id(value))
    return entry is not None and entry[0]() is value and _compat.version_of(value) == entry[1]


def unwritten_keys(entry: dict) -> tuple[set, bool]:
    """Keys of ``entry`` that are placeholders nobody wrote into, and whether
    that cannot be told here.

    A placeholder with no elements (this rank's shard of a parameter with
    fewer rows than ranks) cannot be written and says nothing: it follows the
    rest of its entry. When it is all the entry has, this rank cannot tell;
    ranks holding a non-empty shard of the same parameter can (the caller
    asks them, see ``collectives.agree``). Until then it counts as written.
    """
    unwritten = {k for k, v in entry.items() if is_unwritten_placeholder(v)}
    empty = {k for k in unwritten if _local_numel(entry[k]) == 0}
    unknown = bool(empty) and empty == unwritten == set(entry)
    if empty and (len(unwritten) < len(entry) or unknown):
        unwritten -= empty
    return unwritten, unknown


def has_placeholders(entry: dict) -> bool:
    return any(id(v) in _placeholders for v in entry.values())


def _local_numel(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (_compat.local_tensor(t) if isinstance(t, DTensor) else t).numel()


def _zero_grad_stand_in(p: torch.Tensor) -> torch.Tensor:
    stand_in = torch.zeros_like(p).requires_grad_(True)
    stand_in.grad = torch.zeros_like(p)
    return stand_in


def scratch_state(opt: torch.optim.Optimizer, only_trainable: bool = False) -> dict[torch.Tensor, dict] | None:
    """The state ``opt`` would have after its first step, built on a copy.

    Returns ``{param: {key: value}}`` for the parameters that would get state,
    or None (with a warning) if this optimizer cannot be stepped on a copy.
    """
    stand_ins: dict[torch.Tensor, torch.Tensor] = {}
    groups = []
    for group in opt.param_groups:
        params = [p for p in group["params"] if p.requires_grad or not only_trainable]
        for p in params:
            stand_ins[p] = _zero_grad_stand_in(p)
        groups.append({**group, "params": [stand_ins[p] for p in params]})
    scratch = object.__new__(type(opt))
    scratch.__dict__.update(opt.__dict__)
    scratch.__dict__.pop("step", None)  # an instance-level wrapper belongs to the real optimizer
    scratch.defaults = copy.copy(opt.defaults)
    scratch.state = defaultdict(dict)
    scratch.param_groups = groups
    scratch._optimizer_step_pre_hooks = OrderedDict()
    scratch._optimizer_step_post_hooks = OrderedDict()
    try:
        with torch.enable_grad():
            _compat.unhooked_step(type(opt))(scratch)
    except Exception as exc:  # noqa: BLE001 - any optimizer may refuse a bare step
        warnings.warn(
            f"hyperdsd: cannot build a state template for {type(opt).__name__} ({type(exc).__name__}: {exc}); "
            "a DCP load into this never-stepped optimizer will restore param_groups only",
            stacklevel=3,
        )
        return None
    out = {}
    for p, stand_in in stand_ins.items():
        entry = scratch.state.get(stand_in)
        if entry:
            out[p] = entry
    return out


def template_state(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
    """Placeholder state for a never-stepped optimizer (see module docstring)."""
    state = scratch_state(opt) or {}
    for entry in state.values():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                if key == "step":
                    value.zero_()  # a placeholder that is saved as is means "never stepped"
                mark_placeholder(value)
    return state


# Group fields of a flat template are plain values (DCP and torch.load must
# read them), so they are recognised by identity instead: the template holds
# objects made for it, and anything DCP loads arrives as a new object.
_template_values: dict[int, object] = {}


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
    ids = []
    for key, value in flat.items():
        if isinstance(key, str) and key.startswith("param_groups."):
            copy_, unique = _fresh(value)
            if unique:
                flat[key] = copy_
                _template_values[id(copy_)] = copy_
                ids.append(id(copy_))
    if ids:
        weakref.finalize(anchor, _drop_values, ids)


def _drop_values(ids: list[int]) -> None:
    for i in ids:
        _template_values.pop(i, None)


def is_template_value(value: Any) -> bool:
    return id(value) in _template_values and _template_values[id(value)] is value


def first_placeholder(flat: dict) -> torch.Tensor | None:
    for value in flat.values():
        if is_unwritten_placeholder(value):
            return value
    return None
