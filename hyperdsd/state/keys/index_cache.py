"""The model index kept from one call to the next while the model is as it was.

Building a :class:`~hyperdsd.state.keys.fqn.ModelIndex` walks every module, parameter and buffer
in Python: on a model of many small layers a quarter of a sharded set. What
the walk reads is the modules' classes and their registries of children,
parameters and buffers (names and objects) and the buffers' persistence;
a call that finds all of them as the last call left them gets the last
call's index, its tensors read from the registries as they are (a new
object, so that nothing one call works out on it, hooks read or keys
resolved, reaches the next).

Nothing here keeps the model alive, and no tensor is referenced at all
(``torch.utils.swap_tensors`` refuses a tensor that has a weak reference):
the cache holds weak references to the modules and drops its entry when the
model goes. Registries are compared by the ids of what they hold while every
module recorded is alive: ids are unique among live objects, so the same ids
mean the same children and the same parameters shared by the same names (a
tensor freed and another made at its address is read as the new one). No
index is kept of a model that FSDP2 holds unsharded: it is built every call.
A wrapper layout's modules (:mod:`hyperdsd.wrappers`) are kept by position,
while the layouts registered are the same objects: which modules are a
layout's, which children they hide and which parameters are its own go by
their classes and the registries' objects, which the fingerprint compares.

A kept index carries the keys of the last flat get made with it
(:class:`~hyperdsd.state.keys.flat_keys.KeptFlatKeys`, no tensor of the model among them) and
what a wrapper layout worked out from its modules (``kept_for_wrapper``: its canonical names,
say), which go with it.
"""

import functools
import operator
import weakref

import torch.nn as nn

from ... import _compat, wrappers
from ...tree import has_none
from .flat_keys import KeptFlatKeys
from .hidden import hidden_children

_DEREF = weakref.ref.__call__


class _Snapshot:
    """One model's index, its objects held weakly, and what its walk read."""

    def __init__(self, index, forget):
        model = index.model
        self.root = weakref.ref(model, forget)
        self.modifiers_attr = index.modifiers_attr
        modules = [m for m, _ in index.modules]
        self.module_refs = list(map(weakref.ref, modules))
        self.fingerprint, held, _ = _compat.registries_fingerprint(modules)
        slot = {id(t): i for i, t in enumerate(held)}
        self.tensor_slots = [slot[id(t)] for t in index.tensors]  # where each of the index's tensors is held
        # The classes that rename children (``_fqn_modifiers``, which a class may
        # be given later), and what each of their modules hides: asked again.
        self.renaming = self._renaming(self.fingerprint[0])
        self.modifiers = [
            (i, hidden_children(m, self.modifiers_attr)) for i, m in enumerate(modules) if type(m) in self.renaming
        ]
        # FSDP2's units: asked again whether they hold a parameter unsharded (see the module docstring).
        self.fsdp2_units = [i for i, m in enumerate(modules) if isinstance(m, _compat.fsdp2_class())]
        self.canon_prefixes = [canon for _, canon in index.modules]
        self.raw_prefixes = list(index.raw_prefixes)
        self.tensor_keys, self.tensor_raw_keys = list(index.tensor_keys), list(index.tensor_raw_keys)
        position = {id(t): i for i, t in enumerate(index.tensors)}
        self.param_positions = [position[id(p)] for p in index.params]
        self.first_fqns = list(map(index.fqn_by_id.__getitem__, map(id, index.params)))
        self._fqn_by_id: dict | None = None  # (made when a kept index is first asked for it)
        self.param_names = list(index.param_of)
        self.named_positions = [position[id(p)] for p in index.param_of.values()]
        self.first_name = dict(index.first_name)
        at = {id(m): i for i, m in enumerate(modules)}
        self.paths = list(index._module_paths)
        self.path_positions = [at[id(m)] for m, _ in index._module_paths.values()]
        self.path_canons = [canon for _, canon in index._module_paths.values()]
        self.renames = index.renames
        self.layouts = wrappers.registered()
        self.wrapped = [(at[id(m)], raw) for m, raw in index.wrapped]
        self.wrapper = index.wrapper
        self.kept_flat_keys = KeptFlatKeys()  # a flat get's keys (see KeptFlatKeys): the model's while it is as it was
        self.kept_for_wrapper: dict = {}  # what a wrapper layout works out from the modules (see ModelIndex)

    def _renaming(self, classes: list[type]) -> set[type]:
        return {c for c in set(classes) if callable(getattr(c, self.modifiers_attr, None))}

    def index_for(self, cls, model: nn.Module):
        """The index of ``model`` as it is now, if the walk would read what it
        read; None otherwise."""
        modules = list(map(_DEREF, self.module_refs))
        if has_none(modules):
            return None  # a module it recorded is gone: ids may have been reused
        fingerprint, held, registered = _compat.registries_fingerprint(modules)
        if fingerprint != self.fingerprint:
            return None
        if not all(map(_compat.fsdp2_resharded, map(modules.__getitem__, self.fsdp2_units))):
            return None  # unsharded since (its parameter objects may have been freed, their ids reused)
        tensors = list(map(held.__getitem__, self.tensor_slots))
        layouts = wrappers.registered()
        if len(layouts) != len(self.layouts) or not all(map(operator.is_, layouts, self.layouts)):
            return None  # another layout registered since: the walk would read other modules as wrapped
        if self._renaming(fingerprint[0]) != self.renaming or any(
            hidden_children(modules[i], self.modifiers_attr) != hidden for i, hidden in self.modifiers
        ):
            return None
        index = cls.__new__(cls)
        index.model, index.modifiers_attr = model, self.modifiers_attr
        # (``modules``, ``fqn_by_id``, ``param_of`` and the module paths made when first read, see ModelIndex)
        index._kept, index.module_objects, index.module_prefixes = self, modules, list(self.canon_prefixes)
        index.registered = registered  # (read as the fingerprint was)
        index.raw_prefixes = list(self.raw_prefixes)
        index.tensors = tensors
        index.tensor_keys, index.tensor_raw_keys = list(self.tensor_keys), list(self.tensor_raw_keys)
        index.params = list(map(tensors.__getitem__, self.param_positions))
        index.first_name = dict(self.first_name)
        index._sharded, index.renames = {}, self.renames
        index.wrapped, index.wrapper = [(modules[i], raw) for i, raw in self.wrapped], self.wrapper
        index.kept_flat_keys, index.kept_for_wrapper = self.kept_flat_keys, self.kept_for_wrapper
        index.fingerprint = fingerprint
        return index

    # What an index this snapshot made reads when it first needs it (new objects each time).

    def modules_of(self, modules: list) -> list:
        return list(zip(modules, self.canon_prefixes))

    def module_paths(self, modules: list) -> dict:
        return dict(zip(self.paths, zip(map(modules.__getitem__, self.path_positions), self.path_canons)))

    def fqn_by_id(self, params: list) -> dict:
        # ``params`` are the objects the registries held when the first was made
        # (the fingerprint compares their ids): the same dict, copied (a copy of
        # its table, where making it inserts each id anew).
        if self._fqn_by_id is None:
            self._fqn_by_id = dict(zip(map(id, params), self.first_fqns))
        return self._fqn_by_id.copy()

    def param_of(self, tensors: list) -> dict:
        return dict(zip(self.param_names, map(tensors.__getitem__, self.named_positions)))


# By the id of the model; an entry goes with its model (see _forget).
_SNAPSHOTS: dict[int, _Snapshot] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    snapshot = _SNAPSHOTS.get(key)
    if snapshot is not None and snapshot.root is ref:
        del _SNAPSHOTS[key]


def index_of(cls, model: nn.Module, modifiers_attr: str):
    """``cls(model, modifiers_attr)``, or the same index kept from the last call
    (see the module docstring)."""
    snapshot = _SNAPSHOTS.get(id(model))
    if snapshot is not None and snapshot.root() is model and snapshot.modifiers_attr == modifiers_attr:
        index = snapshot.index_for(cls, model)
        if index is not None:
            return index
    index = cls(model, modifiers_attr)
    if not index.unsharded:
        try:
            snapshot = _SNAPSHOTS[id(model)] = _Snapshot(index, functools.partial(_forget, id(model)))
            index.kept_flat_keys, index.kept_for_wrapper = snapshot.kept_flat_keys, snapshot.kept_for_wrapper
            index.fingerprint = snapshot.fingerprint
        except TypeError:  # (a model that takes no weak reference is indexed every call)
            _SNAPSHOTS.pop(id(model), None)
    return index


def cached_models() -> int:
    """How many models have an index kept (for tests: the cache lets models go)."""
    return len(_SNAPSHOTS)
