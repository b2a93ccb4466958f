"""Canonical FQNs: the names a parameter has in the model as written,
without what wrappers insert (``module.`` of DDP, ``_orig_mod.`` of
``torch.compile``, ``_checkpoint_wrapped_module.`` of activation
checkpointing, children a module hides through ``_fqn_modifiers``).

A :class:`ModelIndex` is built in one pass over the modules, so that every
lookup after is a dict access; :meth:`ModelIndex.of` keeps it from one call to
the next while the model is as it was (:mod:`hyperdsd.state.keys.index_cache`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ... import _compat, wrappers
from ...errors import StateDictError
from .flat_keys import KeptFlatKeys
from .hidden import hidden_children
from .index_cache import index_of


class ModelIndex:
    """Parameters of a model by canonical FQN, and back.

    Modules of a wrapper layout (:mod:`hyperdsd.wrappers`) are listed
    (:attr:`wrapped`: module and raw path prefix, :attr:`wrapper`: their
    layout), the children they hide are hidden, and the parameters that are
    the layout's own are left out of :attr:`params` (what they hold is the
    layout's to name: a call works on the model's twin)."""

    kept_flat_keys: KeptFlatKeys | None = None  # a kept index's (see index_cache): a flat get's keys
    # A kept index's (see index_cache): what its wrapper layout works out from the
    # modules, by the layout's own keys, and the registries' fingerprint the cache read.
    kept_for_wrapper: dict | None = None
    fingerprint: list | None = None

    def __init__(self, model: nn.Module, modifiers_attr: str = "_fqn_modifiers"):
        self.model = model
        self.modifiers_attr = modifiers_attr
        # first canonical name by the parameter's id (kept alive by the index), not hashing a tensor
        self.fqn_by_id: dict[int, str] = {}
        self.params: list[nn.Parameter] = []  # each parameter once, in the order of its first name
        self.param_of: dict[str, nn.Parameter] = {}  # every canonical name
        # every canonical name -> its parameter's first: keyed by strings, so a
        # lookup does not hash a tensor (Tensor.__hash__ is Python code)
        self.first_name: dict[str, str] = {}
        self._module_paths: dict[str, tuple[nn.Module, str]] = {"": (model, "")}
        # Every module in the order state_dict() visits it (depth first, a
        # module under two names twice), with its canonical key prefix ("" or
        # ending in a dot).
        self.modules: list[tuple[nn.Module, str]] = []
        self.raw_prefixes: list[str] = []  # each of ``modules``' key prefix in ``model.state_dict()``
        # Every parameter and persistent buffer in ``modules``' order (what a
        # plain ``model.state_dict()`` holds, see ``reads_plainly``), each as the
        # optimizer steps it; its canonical key and its key in ``state_dict()``.
        self.tensors: list[torch.Tensor] = []
        self.tensor_keys: list[str] = []
        self.tensor_raw_keys: list[str] = []
        # Parameters FSDP2 left unsharded (after a forward, an ``unshard()``):
        # what the module holds by name is not what the optimizer steps.
        self._sharded: dict[nn.Module, dict[str, nn.Parameter]] = {}
        self.wrapped: list[tuple[nn.Module, str]] = []
        self.wrapper: wrappers.WrapperLayout | None = None
        self.renames = False  # a child hidden somewhere: canonical keys are not all ``state_dict()``'s
        fqn_by_id, params, param_of, first_name = self.fqn_by_id, self.params, self.param_of, self.first_name
        tensors, keys, raw_keys = self.tensors, self.tensor_keys, self.tensor_raw_keys
        # Depth first, parents before children, children in registration
        # order: a tied parameter's first name is the one state_dict() lists
        # first. An explicit stack: thousands of modules through nested
        # generators cost more than the rest of the index.
        stack = [(model, "", "")]
        layouts = wrappers.registered()
        wrapper_classes, fsdp2_class = tuple(c for x in layouts for c in _classes(x)), _compat.fsdp2_class()
        while stack:
            module, raw, canon = stack.pop()
            self.modules.append((module, canon))
            self.raw_prefixes.append(raw)
            if wrapper_classes and isinstance(module, wrapper_classes):
                self._wrapped_by(layouts, module, raw)
            if isinstance(module, fsdp2_class):
                for owner, name, sharded in _compat.fsdp2_sharded_params(module):
                    self._sharded.setdefault(owner, {})[name] = sharded
            for name, param in (
                self.own_parameters(module) if self._sharded else _compat.own_parameters(module)
            ).items():
                if param is None:
                    continue
                fqn = canon + name
                tensors.append(param)
                keys.append(fqn)
                raw_keys.append(raw + name)
                if self.wrapper is not None and self.wrapper.is_own(param):
                    continue
                first = fqn_by_id.setdefault(id(param), fqn)
                if first is fqn:  # (else tied: a second name)
                    params.append(param)
                param_of[fqn] = param
                first_name[fqn] = first
            buffers, skip = _compat.own_buffers(module)
            for name, buf in buffers.items():
                if buf is not None and name not in skip:
                    tensors.append(buf)
                    keys.append(canon + name)
                    raw_keys.append(raw + name)
            children = _compat.child_modules(module)
            if not children:
                continue
            hidden = hidden_children(module, modifiers_attr)
            self.renames = self.renames or any(name in children for name in hidden)
            for name, child in reversed(children.items()):
                if child is None:
                    continue
                child_raw = f"{raw}{name}"
                child_canon = canon[:-1] if name in hidden else f"{canon}{name}"
                self._module_paths[child_raw] = (child, child_canon)
                stack.append((child, f"{child_raw}.", f"{child_canon}." if child_canon else ""))

    def _wrapped_by(self, layouts, module: nn.Module, raw: str) -> None:
        layout = next(layout for layout in layouts if isinstance(module, _classes(layout)))
        if self.wrapper is not None and layout is not self.wrapper:
            first = self.wrapped[0][1][:-1] or "<root>"
            raise StateDictError(
                f"module {raw[:-1] or '<root>'!r} is laid out by {layout.name} and module {first!r} by "
                f"{self.wrapper.name}: hyperdsd reads one wrapper layout per model"
            )
        self.wrapper = layout
        self.wrapped.append((module, raw))

    # An index kept from the last call (:mod:`hyperdsd.state.keys.index_cache`) makes these from
    # what it kept when first read: most calls read one or two of them, each a
    # dict or list over every module or parameter.
    @functools.cached_property
    def modules(self) -> list[tuple[nn.Module, str]]:
        return self._kept.modules_of(self.module_objects)

    @functools.cached_property
    def module_objects(self) -> list[nn.Module]:
        """The modules of :attr:`modules`, without their prefixes."""
        return [module for module, _ in self.modules]

    @functools.cached_property
    def module_prefixes(self) -> list[str]:
        """The canonical key prefixes of :attr:`modules`."""
        return [prefix for _, prefix in self.modules]

    @functools.cached_property
    def registered(self) -> tuple[list, list]:
        """What the modules' registries hold (:func:`hyperdsd._compat.registered`):
        as the index read them, or when first asked. A load planned in place
        compares it with what they hold when it is applied."""
        return _compat.registered(self.module_objects)

    @functools.cached_property
    def _module_paths(self) -> dict[str, tuple[nn.Module, str]]:
        return self._kept.module_paths(self.module_objects)

    @functools.cached_property
    def fqn_by_id(self) -> dict[int, str]:
        return self._kept.fqn_by_id(self.params)

    @functools.cached_property
    def param_of(self) -> dict[str, nn.Parameter]:
        return self._kept.param_of(self.tensors)

    @classmethod
    def of(cls, model: nn.Module, modifiers_attr: str = "_fqn_modifiers") -> ModelIndex:
        """The index of ``model``: the one the last call built where the model
        is as it was then (:mod:`hyperdsd.state.keys.index_cache`), else built anew."""
        return index_of(cls, model, modifiers_attr)

    def fqn_of(self, param: torch.Tensor) -> str | None:
        """The first canonical name of ``param``; None if it is not the model's."""
        return self.fqn_by_id.get(id(param))

    def fqns_of(self, params: list[torch.Tensor]) -> list[str | None]:
        """:meth:`fqn_of` each of ``params``, looked up in C (an optimizer holds tens of thousands)."""
        return list(map(self.fqn_by_id.get, map(id, params)))

    def own_parameters(self, module: nn.Module) -> dict[str, nn.Parameter | None]:
        """``module``'s own parameters by name, each as the optimizer steps it
        (the sharded one where FSDP2 has the module unsharded)."""
        own = _compat.own_parameters(module)
        sharded = self._sharded.get(module)
        return own if sharded is None else {**own, **sharded}

    @functools.cached_property
    def reads_plainly(self) -> bool:
        """Whether every module's state dict is its parameters and buffers
        (:func:`hyperdsd._compat.all_read_plainly`): then it is read from
        the modules directly, not through ``model.state_dict()``."""
        return _compat.all_read_plainly(self.module_objects)

    @property
    def unsharded(self) -> bool:
        """Whether FSDP2 holds some module unsharded (the sharded parameters are elsewhere)."""
        return bool(self._sharded)

    def sharded_value(self, key: str, value):
        """``value``, the tensor ``model.state_dict()`` gives under ``key``, or
        the sharded parameter FSDP2 keeps for it where the module is unsharded."""
        path, _, name = key.rpartition(".")
        hit = self._module_paths.get(path)
        sharded = self._sharded.get(hit[0]) if hit is not None else None
        return sharded.get(name, value) if sharded is not None else value

    def canonical_key(self, key: str) -> str:
        """The canonical form of a ``model.state_dict()`` key.

        State-dict hooks may already have dropped some wrapper segments (the
        checkpoint wrapper does), so the key is walked against the module
        tree: a segment that names a hidden child is dropped, and a wrapper
        whose wrapped child was already dropped is stepped through.
        """
        path, _, leaf = key.rpartition(".")
        if not path:
            return key
        hit = self._module_paths.get(path)
        if hit is not None and hit[1] == path:
            return key  # no wrapper on the way: the key is canonical already
        return f"{self._canonical_path(path)}{leaf}"

    def _canonical_path(self, path: str) -> str:
        """Canonical module path with a trailing dot, memoised per path."""
        hit = self._module_paths.get(path)
        if hit is not None:
            return f"{hit[1]}." if hit[1] else ""
        parent_path, _, name = path.rpartition(".")
        self._canonical_path(parent_path)  # fills the parent's entry
        parent, parent_canon = self._module_paths[parent_path]
        # The name was not a child of ``parent`` as stored: a hook removed a
        # wrapper segment; step through hidden children until it resolves.
        current, canon = parent, parent_canon
        children = _compat.child_modules(current)
        while name not in children:
            hidden = [h for h in hidden_children(current, self.modifiers_attr) if h in children]
            if not hidden:
                raise StateDictError(f"state-dict key path {path!r} does not name a submodule of the model")
            current = children[hidden[0]]
            children = _compat.child_modules(current)
        child = children[name]
        child_canon = f"{canon}.{name}" if canon else name
        if name in hidden_children(current, self.modifiers_attr):
            child_canon = canon
        self._module_paths[path] = (child, child_canon)
        return f"{child_canon}." if child_canon else ""

    def frozen_fqns(self) -> set[str]:
        return {fqn for fqn, p in self.param_of.items() if not p.requires_grad}

    def canonical(self, fqn: str) -> str | None:
        """The first canonical name of the parameter ``fqn`` names (any alias)."""
        return self.first_name.get(fqn)


def optimizer_params(optimizers) -> tuple[torch.optim.Optimizer, ...]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return (optimizers,)
    opts = tuple(optimizers)
    for i, opt in enumerate(opts):
        if not isinstance(opt, torch.optim.Optimizer):
            raise StateDictError(f"optimizers[{i}] is a {type(opt).__name__}, not a torch.optim.Optimizer")
    return opts


def _classes(layout: wrappers.WrapperLayout) -> tuple[type, ...]:
    found = layout.module_class
    return found if isinstance(found, tuple) else (found,)
