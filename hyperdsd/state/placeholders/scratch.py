"""Placeholder state for optimizers that have never stepped, built on a copy.

Stepping a never-stepped optimizer to create state to fill (what other
implementations do) changes it. Here the placeholder state is built on a throwaway
optimizer: the same class, built by its own constructor with the same
hyperparameters over zero-filled stand-ins of the parameters, stepped once
with zero gradients. The real optimizer, its parameters and its gradients
are never touched. The placeholder state's tensors are placeholders
(:mod:`hyperdsd.state.placeholders.marks`), its ``step`` 0: saved as it is, it means "never
stepped" (:mod:`hyperdsd.state.placeholders.saved`).

A load checks each optimizer's entries against its :class:`Expectations`:
the state the optimizer keeps or, for a parameter without state, the
placeholder state's, and whether a saved entry is the placeholder state.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch.distributed.tensor import DTensor

from ... import _compat
from ...tree import rebuild
from .marks import mark_placeholder, state_tensors
from .saved import (
    is_saved_placeholder,
    is_saved_stepless_placeholder,
    placeholder_fills,
    step_is_zero,
    stepless_fills,
    surely_real,
)

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
    the copy holds these of its parameters alone (each group keeps its fields).

    For torch's own optimizers of per-parameter state (:data:`_PER_PARAMETER`)
    the copy holds one stand-in per kind of parameter in each group
    (:func:`_kind`), and each parameter gets a copy of its kind's state: a step
    over thousands of stand-ins, each a DTensor, would take seconds."""
    stand_ins: dict[torch.Tensor, torch.Tensor] = {}
    shared = type(opt) in _PER_PARAMETER
    groups = []
    for group in opt.param_groups:
        kinds: dict = {}
        for p in group["params"]:
            if only is None or p in only:
                key = _kind(p) if shared else p
                if key not in kinds:
                    kinds[key] = _zero_grad_stand_in(p)
                stand_ins[p] = kinds[key]
        groups.append({**group, "params": list(kinds.values())})
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
                f"hyperdsd: cannot build placeholder state for {type(opt).__name__} ({type(exc).__name__}: {exc}); "
                "a DCP load into this never-stepped optimizer will restore param_groups only",
                stacklevel=4,
            )
        return None
    out, taken = {}, set()
    for p, stand_in in stand_ins.items():
        entry = scratch.state.get(stand_in)
        if entry:
            out[p] = entry if id(stand_in) not in taken else _copied(entry)
            taken.add(id(stand_in))
    return out, eager


# torch's optimizers whose step makes each parameter's state from that
# parameter alone (its shape, layout, dtype, device) and its group's fields.
_PER_PARAMETER = frozenset(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)


def _kind(p: torch.Tensor) -> tuple:
    """What a per-parameter optimizer's state for ``p`` depends on, of ``p``."""
    layout = (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None
    return type(p), p.dtype, p.device, tuple(p.shape), p.stride(), layout


def _copied(entry: dict) -> dict:
    return rebuild(entry, lambda leaf, _path: _compat.cloned(leaf) if isinstance(leaf, torch.Tensor) else leaf)


# -- placeholder states ---------------------------------------------------------------


def placeholder_state_of(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
    """Placeholder state for a never-stepped optimizer (see module docstring)."""
    return _as_placeholders(scratch_state(opt) or {})


def stateless_placeholders(opt: torch.optim.Optimizer) -> dict[torch.Tensor, dict]:
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
            for t in state_tensors(value):
                mark_placeholder(t)
    return state


# -- what a load expects -------------------------------------------------------


class Expectations:
    """What one optimizer's state should look like, for one load: each
    parameter's current state or, for a parameter without state, what a step
    would create (built once, only when needed: for a stepped optimizer, over
    its parameters without state alone); and whether an entry the load holds
    is this optimizer's never-stepped placeholder state, saved."""

    def __init__(self, opt):
        self.opt = opt
        self.fresh = not opt.state
        self._found: tuple | None | bool = False
        self._fills: dict | None = None
        self._stepless: dict | None = None
        self._stateless: dict | None = None

    def _scratch_step(self) -> tuple | None:
        """The scratch step (see :func:`scratch_step`), taken once per load and optimizer."""
        if self._found is False:
            self._found = scratch_step(self.opt, warn=self.fresh)
        return self._found

    def scratch(self) -> dict | None:
        if not self.fresh:
            return None
        found = self._scratch_step()
        return found[0] if found is not None else None

    def saved_placeholder(self, p, entry: dict) -> bool:
        """Whether ``entry`` is this optimizer's never-stepped placeholder state, saved
        (see :func:`is_saved_placeholder`); the placeholder state is built on first need."""
        if not step_is_zero(entry):
            return False
        if self._fills is None:
            self._fills = placeholder_fills(self._scratch_step())
        return is_saved_placeholder(entry, self._fills.get(p))

    def stepless_placeholder(self, entries: list[tuple]) -> bool:
        """Whether every one of ``entries`` (``(param, entry)``, entries
        without ``step``) is, on this rank, this optimizer's never-stepped
        placeholder state, saved. Real values are looked for first, so a load of real
        state builds no placeholder state."""
        if any(surely_real(entry) for _, entry in entries):
            return False
        if self._stepless is None:
            self._stepless = stepless_fills(self._scratch_step())
        return all(is_saved_stepless_placeholder(entry, self._stepless.get(p)) for p, entry in entries)

    def of(self, p) -> dict | None:
        entry = self.opt.state.get(p)
        if entry:
            return entry
        if self.fresh:
            scratch = self.scratch()
        else:  # a stepped optimizer's parameter without state (frozen, or no gradient since)
            if self._stateless is None:
                self._stateless = stateless_scratch(self.opt)
            scratch = self._stateless
        return scratch.get(p) if scratch else None
