"""The twin model of an FSDP1 model: a plain module tree under canonical
FQNs whose parameters are DTensors around each unit's rows, with the
model's own buffers and unmanaged parameters registered as they are
(:func:`twin_module`; the units' layouts: :mod:`.units`)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from .. import _compat
from .units import UnitLayout


class _ExtraState(nn.Module):
    """A twin's module in the place of one with extra state: its state dict
    reads the real module's ``get_extra_state`` and a load calls its
    ``set_extra_state`` (the value is the module's own, not FSDP1's)."""

    def __init__(self, real: nn.Module):
        super().__init__()
        self._real = (real,)  # in a tuple: not registered as a child

    def get_extra_state(self):
        return self._real[0].get_extra_state()

    def set_extra_state(self, state) -> None:
        self._real[0].set_extra_state(state)


class _Tree:
    """A module tree made from dotted names; ``extra``: the real modules with
    extra state, by path, whose places get an :class:`_ExtraState`."""

    def __init__(self, extra: dict[str, nn.Module]):
        self._extra = extra
        self.root = self._shell("")
        self._shells = {"": self.root}

    def _shell(self, path: str) -> nn.Module:
        real = self._extra.get(path)
        return _ExtraState(real) if real is not None else nn.Module()

    def owner(self, fqn: str) -> tuple[nn.Module, str]:
        path, _, name = fqn.rpartition(".")
        return self.at(path), name

    def at(self, path: str) -> nn.Module:
        shell = self._shells.get(path)
        if shell is None:
            parent, child = self.owner(path)
            shell = self._shell(path)
            parent.add_module(child, shell)
            self._shells[path] = shell
        return shell


def twin_module(index, units: list[UnitLayout], rows: list[list[torch.Tensor]]) -> tuple[nn.Module, list[list]]:
    """The twin of an FSDP1 model whose ``index`` (``fsdp1=True``) is given:
    each unit's parameters as DTensors around ``rows`` (this rank's rows of
    each), the model's other parameters and its buffers as they are, in the
    order a plain model's state dict lists them. Returns the twin and each
    unit's twin parameters."""
    managed: dict[int, nn.Parameter] = {}  # id of an original parameter (use_orig_params=True) -> its twin
    by_prefix: dict[str, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    params_of = []
    for layout, local in zip(units, rows):
        unit = layout.unit
        twins = []
        for i, (fqn, piece, grad) in enumerate(zip(layout.fqns, local, layout.requires_grad())):
            twin = _compat.as_parameter(layout.layouts[i].wrap(piece), grad)
            twins.append(twin)
            if unit.params is not None:
                managed[id(unit.params[i])] = twin
            path, _, name = fqn.rpartition(".")
            by_prefix[f"{path}." if path else ""].append((name, twin))
        for fqn, i in layout.aliases:
            path, _, name = fqn.rpartition(".")
            by_prefix[f"{path}." if path else ""].append((name, twins[i]))
        params_of.append(twins)
    extra = {prefix[:-1]: module for module, prefix in index.modules if _compat.has_extra_state(module)}
    tree = _Tree(extra)
    for module, prefix in index.modules:
        if prefix[:-1] in extra:
            tree.at(prefix[:-1])  # in the walk's order, among its siblings
        entries = by_prefix.pop(prefix, [])
        for name, param in _compat.own_parameters(module).items():
            if param is None or _compat.is_flat_param(param) or id(param) in managed:
                continue
            entries.append((name, param))
        for name, twin in entries:
            owner, leaf = tree.owner(prefix + name)
            if leaf not in _compat.own_parameters(owner):
                owner.register_parameter(leaf, twin)
        buffers, skip = _compat.own_buffers(module)
        for name, buf in buffers.items():
            if buf is not None:
                owner, leaf = tree.owner(prefix + name)
                owner.register_buffer(leaf, buf, persistent=name not in skip)
    for prefix, entries in by_prefix.items():  # names no module of the walk has (none expected)
        for name, twin in entries:
            owner, leaf = tree.owner(prefix + name)
            owner.register_parameter(leaf, twin)
    return tree.root, params_of
