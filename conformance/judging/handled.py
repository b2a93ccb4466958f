"""What the implementation under test did to the objects it was handed (SPEC §4, 1.4).

A get or a set receives the model and its optimizers. What the call leaves
in them is input to the suite as much as what it returns: an optimizer
whose ``param_groups`` now hold tensors that are not the model's
parameters, parameters replaced by new objects, groups added or removed,
``requires_grad`` flipped, gradients dropped. The case's own code may
stumble on such objects (a parameter it cannot name, a group that is not
there); that stumble is the implementation's deviation, never the suite's
``error``.

So every call records a :class:`Handled` view before and after (identities
and flags only, no tensor is read or copied), and :func:`changes` says in
words what differs. The words are used where a case stumbles
(:meth:`conformance.judging.received.Received.surprises`); clauses that
judge these objects judge them on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _compat
from .naming import describe
from .oracle import canonical

__all__ = ["Handled", "changes"]

_SHOWN = 3


@dataclass(frozen=True)
class _Param:
    fqn: str
    obj: torch.Tensor
    requires_grad: bool
    has_grad: bool


@dataclass
class Handled:
    """The model's parameters (as the optimizers step them) and the optimizers'
    groups, by identity, when the view was taken."""

    params: dict[str, _Param]
    groups: list[list[list[torch.Tensor]]]  # per optimizer, per group, its parameters

    @classmethod
    def of(cls, model, optimizers) -> "Handled":
        params: dict[str, _Param] = {}
        if isinstance(model, torch.nn.Module):
            stepped = _compat.stepped_parameters(model)
            for prefix, module in model.named_modules(remove_duplicate=False):
                for name, p in _compat.own_parameters(module).items():
                    if p is None:
                        continue
                    p = stepped.get((id(module), name), p)
                    fqn = canonical(f"{prefix}.{name}" if prefix else name)
                    params.setdefault(fqn, _Param(fqn, p, bool(p.requires_grad), p.grad is not None))
        groups = [
            [list(g.get("params", ())) for g in getattr(o, "param_groups", ()) if isinstance(g, dict)]
            for o in _optimizer_list(optimizers)
        ]
        return cls(params, groups)

    def names(self) -> dict[int, str]:
        return {id(p.obj): p.fqn for p in self.params.values()}


def _optimizer_list(optimizers) -> list:
    if optimizers is None:
        return []
    return list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]


def _some(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def changes(before: Handled, after: Handled) -> list[str]:
    """What differs, in words naming FQNs (and tensors by their description)."""
    out = []
    replaced = [f for f, p in before.params.items() if f in after.params and after.params[f].obj is not p.obj]
    if replaced:
        out.append(f"replaced the model's parameters {_some([repr(f) for f in replaced])} by new objects")
    gone = [f for f in before.params if f not in after.params]
    if gone:
        out.append(f"removed the model's parameters {_some([repr(f) for f in gone])}")
    flags = (("changed requires_grad of", "requires_grad"), ("changed whether these hold a gradient:", "has_grad"))
    for verb, flag in flags:
        flipped = [
            f"{f!r} ({getattr(p, flag)} -> {getattr(after.params[f], flag)})"
            for f, p in before.params.items()
            if f in after.params and getattr(p, flag) != getattr(after.params[f], flag)
        ]
        if flipped:
            out.append(f"{verb} {_some(flipped)}")
    out += _group_changes(before, after)
    return out


def _group_changes(before: Handled, after: Handled) -> list[str]:
    out = []
    ours = {id(p.obj) for p in after.params.values()} | {id(p.obj) for p in before.params.values()}
    was = before.names()
    for k, (old, new) in enumerate(zip(before.groups, after.groups)):
        name = f"optimizer {k}" if len(after.groups) > 1 else "the optimizer"
        if len(old) != len(new):
            verb = "added" if len(new) > len(old) else "removed"
            out.append(f"{verb} param groups of {name}: it had {len(old)}, it has {len(new)}")
        for i, group in enumerate(new):
            strangers = [p for p in group if id(p) not in ours]
            if not strangers:
                continue
            formerly = old[i] if i < len(old) else []
            where = [was.get(id(p)) for p in formerly if id(p) in was]
            held = f", where it held {_some([repr(w) for w in where])}" if where else ""
            out.append(
                f"{name}'s param_groups[{i}] holds {len(strangers)} tensor(s) that are not the model's parameters "
                f"({_some([describe(p) for p in strangers])}){held}"
            )
    if len(before.groups) != len(after.groups):
        out.append(f"the optimizers handed over went from {len(before.groups)} to {len(after.groups)}")
    return out
