"""A twin's module tree, kept from one call to the next while the model is as it was.

Building the twin's module tree (a module per path, a DTensor parameter per
original parameter, the model's buffers registered in place) was a fifth of
a sharded get of an FSDP1 model of many small parameters, and its index
another tenth; a set's too. A call whose model has the same modules, in
the same places, with registries holding the same objects
(:func:`hyperdsd._compat.registries_fingerprint`, the kept index's own
test), and units of the same layout, takes the last call's tree: each twin
parameter gets this call's rows as its local tensor (a load's: empty rows
it loads into), and its ``requires_grad`` the real parameter's. Its index
is then the kept index of an unchanged tree
(:meth:`hyperdsd.state.keys.fqn.ModelIndex.of`), and the tree is taken only
while that index holds every kept parameter (:func:`intact`: a load that
replaced one of the tree's parameters leaves a tree built anew next time).

What a get returns never aliases the kept tree: the model's values are
detached DTensors around the rows they were read with (a later get gives
the tree other rows), and the optimizers' twins and state are made anew
each call. Between calls the tree holds no rows (:func:`release`: a get's
rows are the caller's alone), and a twin with a module of extra state (which
holds the real module) is not kept. Nothing here keeps the model alive; an
entry goes with its model.
"""

from __future__ import annotations

import functools
import weakref
from typing import NamedTuple

import torch

from .. import _compat

# By the id of the real model: (its weak reference, the modules' weak
# references, what the twin was built from, the tree, each unit's twin parameters).
_KEPT: dict[int, tuple] = {}


class Structure(NamedTuple):
    """What a twin's tree is built from: the real model's modules' registries,
    their canonical prefixes, each unit's layout and dtype, and the modules
    with extra state (by position)."""

    fingerprint: list
    prefixes: list[str]
    units: list[tuple]
    extra: list[int]


def structure(real, units) -> Structure:
    modules = [m for m, _ in real.modules]
    fingerprint = real.fingerprint  # (a kept index's, read as the cache compared it)
    if fingerprint is None:
        fingerprint, _, _ = _compat.registries_fingerprint(modules)
    layout = [
        (u.fqns, u.aliases, u.unit.shapes, u.unit.local.dtype, u.size, u.index, id(u.mesh))  # (shapes: torch.Size)
        for u in units
    ]
    extra = [i for i, m in enumerate(modules) if _compat.has_extra_state(m)]
    return Structure(fingerprint, [canon for _, canon in real.modules], layout, extra)


def find(model, real, key: Structure):
    """The kept ``(tree, params)`` for ``model`` if built from ``key`` on these very modules; else None."""
    entry = _KEPT.get(id(model))
    if entry is None:
        return None
    root, refs, kept_key, tree, params = entry
    if root() is not model or len(refs) != len(real.modules):
        return None
    if any(ref() is not module for ref, (module, _) in zip(refs, real.modules)):
        return None  # a module replaced (ids alone may be reused)
    return (tree, params) if kept_key == key else None


def keep(model, real, key: Structure, tree, params) -> bool:
    """Keep the tree for the next call; False where it cannot be kept."""
    if key.extra:  # a module of extra state: its twin holds the real module
        return False
    try:
        root = weakref.ref(model, functools.partial(_forget, id(model)))
        refs = [weakref.ref(m) for m, _ in real.modules]
    except TypeError:  # (a model that takes no weak reference is not kept)
        return False
    _KEPT[id(model)] = (root, refs, key, tree, params)
    return True


def refill(units, params: list[list], rows: list[list[torch.Tensor]]) -> None:
    """Give each kept twin parameter this call's rows, and its real parameter's ``requires_grad``."""
    for u, twins, local in zip(units, params, rows):
        for twin, piece, grad in zip(twins, local, u.requires_grad()):
            _compat.set_local(twin, piece)
            if twin.requires_grad != grad:
                twin.requires_grad_(grad)


def intact(index, params: list[list]) -> bool:
    """Whether the tree's index (``index``) still holds every kept parameter."""
    held = index.fqn_by_id
    return all(id(twin) in held for twins in params for twin in twins)


def forget(model) -> None:
    _KEPT.pop(id(model), None)


def release(params: list[list]) -> None:
    """Let a kept tree's parameters go of this call's rows (an empty local
    tensor each, until the next get gives them rows)."""
    empty: dict[tuple, torch.Tensor] = {}
    for twins in params:
        if not twins:
            continue
        local = _compat.local_tensor(twins[0])  # (a unit's parameters: one dtype and device)
        stand_in = empty.get((local.dtype, local.device))
        if stand_in is None:
            stand_in = empty[(local.dtype, local.device)] = torch.empty(0, dtype=local.dtype, device=local.device)
        for twin in twins:
            _compat.set_local(twin, stand_in)


def _forget(key: int, ref: weakref.ref) -> None:
    entry = _KEPT.get(key)
    if entry is not None and entry[0] is ref:
        del _KEPT[key]


def kept_models() -> int:
    """How many models have a twin kept (for tests: the store lets models go)."""
    return len(_KEPT)
