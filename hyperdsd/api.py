"""The public functions: torch's names and signatures, correct behaviour.

Every ``set_*`` validates first and mutates after: all ranks take part in
one agreement (a single all-reduce when nothing is wrong), so bad input on
any rank raises :class:`StateDictError` on every rank before anything has
changed. With a process group initialised, call ``set_*`` on every rank of
the model's group: the whole world, or for a model whose meshes were built
over part of it, exactly those ranks (:mod:`hyperdsd.transport.group`).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterable

import torch
import torch.nn as nn

from . import _compat, wrappers
from .agreement import BroadcastAgreement, LocalAgreement
from .errors import StateDictError
from .fsdp1.layout import FSDP1Layout
from .options import StateDictOptions, resolve_options
from .state import model as model_state
from .state.keys import flat as flat_format
from .state.keys.fqn import ModelIndex, optimizer_params
from .state.loading.plan import ModelLoadPlan, OptimizerLoadPlan
from .state.optimizer import plan as optim_plan
from .state.optimizer import state as optim_state
from .state.placeholders import marks as placeholders
from .transport import consolidate
from .transport import group as groups

# The wrapper layouts hyperdsd reads through a twin (:mod:`.wrappers`).
wrappers.register(FSDP1Layout())

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


@contextlib.contextmanager
def _working():
    """What every call runs under: no autograd, and Python's cyclic garbage
    collector paused until the call returns.

    A call on a model with many parameters allocates hundreds of thousands
    of short-lived objects (freed by reference counting, no cycles); each
    allocation burst makes the collector walk every object of the process,
    the model's included: on a 10,000-parameter model that was 60% of a
    sharded set. Collection resumes on return, where it was. What the call
    made and no longer needs is released before that (the calls below work
    in functions of their own): objects still alive when the collector
    resumes are walked at its next allocation, a tenth of a broadcast load.
    """
    paused = gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            yield
    finally:
        if paused:
            gc.enable()


def _no_submodules(submodules) -> None:
    if submodules is not None:
        raise StateDictError("'submodules' is deprecated upstream and not supported; filter the returned dict instead")


@contextlib.contextmanager
def _reading(model: nn.Module, optims: tuple, opts: StateDictOptions):
    """A get's :func:`_target`, let go of when the get is done (a kept twin holds no rows between calls)."""
    target = _target(model, optims, opts)
    try:
        yield target
    finally:
        if target.release is not None:
            target.release()


def _target(
    model: nn.Module, optims: tuple, opts: StateDictOptions, to_load: frozenset[str] = frozenset()
) -> wrappers.Twin:
    """What a call reads or loads: the model and optimizers themselves, or
    for a model a wrapper layout wraps (:mod:`.wrappers`) their twin in the
    canonical layout, which a load (of the parts ``to_load``) writes back into them."""
    index = ModelIndex.of(model, opts.dsd_fqn_modifiers)
    if index.wrapper is None:
        return wrappers.canonical(model, index, optims)
    return index.wrapper.twin(model, index, optims, opts.dsd_fqn_modifiers, to_load=to_load, full=opts.full_state_dict)


# -- get ---------------------------------------------------------------------


def get_model_state_dict(
    model: nn.Module, *, submodules=None, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """The model's state dict by canonical FQN (see StateDictOptions)."""
    opts = resolve_options(options)
    _no_submodules(submodules)
    with _working():
        return _model_only(model, opts)


def _model_only(model: nn.Module, opts: StateDictOptions) -> dict[str, Any]:
    with _reading(model, (), opts) as target:
        return _model_state(target.model, target.index, opts, target.model_rounds)


def _model_state(model: nn.Module, index: ModelIndex, opts: StateDictOptions, rounds=None) -> dict[str, Any]:
    sd = model_state.read_state(model, index, opts.ignore_frozen_params)
    if opts.full_state_dict:
        return consolidate.full_model(sd, groups.of_params(index.params), cpu=opts.cpu_offload, rounds=rounds)
    return consolidate.offload(sd) if opts.cpu_offload else sd


def get_optimizer_state_dict(
    model: nn.Module, optimizers: Optimizers, *, submodules=None, options: StateDictOptions | None = None
) -> dict[str, Any]:
    """The optimizers' state by canonical FQN, merged into one dict.

    Pure: the optimizers, parameters and gradients are left exactly as they
    were. A never-stepped optimizer gives placeholder state to load into.
    """
    opts = resolve_options(options)
    _no_submodules(submodules)
    optims = optimizer_params(optimizers)
    with _working():
        return _optimizers_only(model, optims, opts)


def _optimizers_only(model: nn.Module, optims: tuple, opts: StateDictOptions) -> dict[str, Any]:
    with _reading(model, optims, opts) as target:
        return _optimizer_state(target.index, target.optims, opts, rounds=target.optim_rounds)


def _optimizer_state(
    index: ModelIndex, optims, opts: StateDictOptions, *, to_load: bool = False, rounds=None
) -> dict[str, Any]:
    nested = optim_state.read_state(index, optims, to_load=to_load)
    if opts.full_state_dict:
        group = groups.of_params(index.params)
        nested = consolidate.full_optimizer(nested, group, cpu=opts.cpu_offload, rounds=rounds)
    elif opts.cpu_offload:
        nested = consolidate.offload(nested)
    if opts.flatten_optimizer_state_dict and nested:
        nested = flat_format.flatten(nested, index.kept_flat_keys)
        # A never-stepped optimizer's placeholder state; a stepped one's has none to search for.
        anchor = placeholders.first_placeholder(nested) if any(not opt.state for opt in optims) else None
        if anchor is not None:
            placeholders.track_placeholder_fields(nested, anchor)
    return nested


def get_state_dict(
    model: nn.Module, optimizers: Optimizers, *, submodules=None, options: StateDictOptions | None = None
) -> tuple[dict, dict]:
    """Both at once, the model indexed once."""
    opts = resolve_options(options)
    _no_submodules(submodules)
    with _working():
        return _both(model, optimizer_params(optimizers), opts)


def _both(model: nn.Module, optims: tuple, opts: StateDictOptions, to_load: bool = False) -> tuple[dict, dict]:
    with _reading(model, optims, opts) as target:
        return (
            _model_state(target.model, target.index, opts, target.model_rounds),
            _optimizer_state(target.index, target.optims, opts, to_load=to_load, rounds=target.optim_rounds),
        )


def load_template(model: nn.Module, optimizers: Optimizers, options: StateDictOptions) -> tuple[dict, dict]:
    """What :func:`get_state_dict` gives, as a template to load a checkpoint
    into: a stepped optimizer's parameters without state have placeholder
    state too (see ``read_state``), so that DCP's planning checks the
    checkpoint's entries for them whole before anything is read."""
    opts = resolve_options(options)
    with _working():
        return _both(model, optimizer_params(optimizers), opts, to_load=True)


# -- set ---------------------------------------------------------------------


def _run_pre_hooks(optims, osd):
    """The optimizers' load-state-dict pre-hooks, as ``Optimizer.load_state_dict`` runs them."""
    for opt in optims:
        for hook in _compat.optimizer_load_hooks(opt).pre:
            result = hook(opt, osd)
            if result is not None:
                osd = result
    return osd


def _run_post_hooks(optims) -> None:
    for opt in optims:
        for hook in _compat.optimizer_load_hooks(opt).post:
            hook(opt)


class _Load:
    """One load of a model and/or optimizers: plan on every rank, agree, apply,
    in one pass (:meth:`run`): the optimizers' load pre-hooks, the dicts to
    plan against, a plan per part that changes nothing, one agreement, and
    the plans applied with the optimizers' post-hooks.

    The agreement (:mod:`.agreement`) says what the plans are made against and
    how the ranks agree: with ``broadcast_from_rank0`` the root's manifests,
    agreement coming with the transfers; without it, each rank's own dicts
    and one all-reduce. Both run in the model's group.
    """

    def __init__(self, model: nn.Module, opts: StateDictOptions, optimizers=(), parts=frozenset(("model", "optim"))):
        self.opts = opts
        how = {"broadcast"} if opts.broadcast_from_rank0 else set()  # (rank 0's dicts, sent to the others)
        target = _target(model, optimizer_params(optimizers), opts, to_load=frozenset(parts) | how)
        self.model, self.index, self.optims = target.model, target.index, target.optims
        self.twin_load = target.load  # a wrapped model's: the load lands in its twin and is written back
        self.release = target.release
        self.group = groups.of_params(self.index.params)
        self.problems: list[str] = []
        self.model_plan: ModelLoadPlan | None = None
        self.optim_plan: OptimizerLoadPlan | None = None

    def run(self, what: str, parts: dict[str, Any]) -> None:
        """Load ``parts``, "model" and/or "optim" mapped to the state dict to load, in one pass."""
        if "optim" in parts:
            parts = {**parts, "optim": _run_pre_hooks(self.optims, parts["optim"])}
        broadcast = self.opts.broadcast_from_rank0 and self.group.has_peers
        agreement = (BroadcastAgreement if broadcast else LocalAgreement)(self.group)
        parts = agreement.manifests(parts)
        self.problems += agreement.problems
        self._plan(parts, foreign_ok=agreement.foreign_ok)
        if broadcast and self.twin_load is not None:
            self.twin_load.land(self.model_plan, self.optim_plan)
        self._apply(agreement.agree(what, self.problems, self.model_plan, self.optim_plan, self.opts.strict))

    def _plan(self, parts: dict[str, Any], foreign_ok: bool) -> None:
        """Check everything against this rank's model and optimizers; change nothing."""
        if "model" in parts:
            self.model_plan, problems = model_state.plan_load(
                self.model,
                self.index,
                parts["model"],
                strict=self.opts.strict,
                ignore_frozen=self.opts.ignore_frozen_params,
                foreign_ok=foreign_ok,
            )
            self.problems += problems
        if "optim" in parts:
            self.optim_plan, problems = optim_plan.plan_load(
                self.index, self.optims, parts["optim"], strict=self.opts.strict, foreign_ok=foreign_ok
            )
            self.problems += problems

    def _apply(self, answers: dict[str, bool]) -> None:
        if self.optim_plan is not None:
            self.optim_plan.settle(answers)
            optim_state.apply_load(self.optim_plan)
            _run_post_hooks(self.optims)
        if self.model_plan is not None:
            model_state.apply_load(self.model, self.model_plan, self.index)
        if self.twin_load is not None:
            self.twin_load.write_back(self.model_plan, self.optim_plan)


def _load(model: nn.Module, opts: StateDictOptions, optimizers, what: str, parts: dict) -> tuple[list, list]:
    """One load (:class:`_Load`); its plans are released on return. Returns
    the model plan's missing and unexpected keys (none without a model)."""
    load = _Load(model, opts, optimizers, parts)
    try:
        load.run(what, parts)
    finally:
        if load.release is not None:
            load.release()
    plan = load.model_plan
    return (plan.missing, plan.unexpected) if plan is not None else ([], [])


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, Any], *, options: StateDictOptions | None = None
):
    """Load a model state dict; returns (missing_keys, unexpected_keys) by canonical FQN.

    With ``strict`` (the default) missing or unexpected keys raise, naming
    them, and nothing is changed.
    """
    opts = resolve_options(options)
    with _working():
        missing, unexpected = _load(model, opts, (), "set_model_state_dict", {"model": model_state_dict})
    return _compat.incompatible_keys(missing, unexpected)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    optim_state_dict: dict[str, Any],
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load optimizer state keyed by FQN (nested or flat) into ``optimizers``.

    Existing state tensors are written in place (same objects and storage)
    when their layout allows; new ones take the parameter's mesh,
    placements and device and keep their own dtype.
    """
    opts = resolve_options(options)
    with _working():
        _load(model, opts, optimizers, "set_optimizer_state_dict", {"optim": optim_state_dict})


def set_state_dict(
    model: nn.Module,
    optimizers: Optimizers,
    *,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any],
    options: StateDictOptions | None = None,
):
    """Both at once: nothing is changed unless both load."""
    opts = resolve_options(options)
    with _working():
        missing, unexpected = _load(
            model, opts, optimizers, "set_state_dict", {"model": model_state_dict, "optim": optim_state_dict}
        )
    return _compat.incompatible_keys(missing, unexpected)


# Names used by some training frameworks.
get_optim_state_dict = get_optimizer_state_dict
set_optim_state_dict = set_optimizer_state_dict
