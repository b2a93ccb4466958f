"""The public functions: torch's names and signatures, correct behaviour.

Every ``set_*`` validates first and mutates after: all ranks take part in
one agreement (a single all-reduce when nothing is wrong), so bad input on
any rank raises :class:`StateDictError` on every rank before anything has
changed. With a process group initialised, call ``set_*`` on every rank.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

from . import _compat, collectives, distribute, flatten as flat_format
from . import model as model_state
from . import templates
from . import optimizer as optim_state
from .errors import StateDictError
from .fqn import ModelIndex, optimizer_params
from .options import StateDictOptions, resolve_options

Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer]


def _no_submodules(submodules) -> None:
    if submodules is not None:
        raise StateDictError("'submodules' is deprecated upstream and not supported; filter the returned dict instead")


# -- get ---------------------------------------------------------------------

def get_model_state_dict(model: nn.Module, *, submodules=None, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict by canonical FQN (see StateDictOptions)."""
    opts = resolve_options(options)
    _no_submodules(submodules)
    index = ModelIndex(model, opts.dsd_fqn_modifiers)
    with torch.no_grad():
        sd = model_state.read_state(model, index, opts.ignore_frozen_params)
        return _finish_model(sd, opts)


def _finish_model(sd: dict, opts: StateDictOptions) -> dict:
    if opts.full_state_dict:
        rank0_only = opts.cpu_offload and collectives.active()
        kept, roots = distribute.full_entries(sd, rank0_only=rank0_only, cpu=opts.cpu_offload)
        if rank0_only and roots is not None:
            received = collectives.send_to_rank0(kept if collectives.rank() != 0 else None)
            if collectives.rank() != 0:
                return {}
            for part in received[1:]:
                kept.update(part or {})
        return kept if not rank0_only or collectives.rank() == 0 else {}
    return distribute.offload(sd) if opts.cpu_offload else sd


def get_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules=None, options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state by canonical FQN, merged into one dict.

    Pure: the optimizers, parameters and gradients are left exactly as they
    were. A never-stepped optimizer gives placeholder state to load into.
    """
    opts = resolve_options(options)
    _no_submodules(submodules)
    optims = optimizer_params(optimizers)
    index = ModelIndex(model, opts.dsd_fqn_modifiers)
    with torch.no_grad():
        nested = optim_state.read_state(index, optims)
        if opts.full_state_dict:
            nested = _full_optimizer(nested, opts)
        elif opts.cpu_offload:
            nested = distribute.offload(nested)
        if opts.flatten_optimizer_state_dict and nested:
            nested = flat_format.flatten(nested)
            anchor = templates.first_placeholder(nested)
            if anchor is not None:
                templates.track_template_fields(nested, anchor)
        return nested


def _full_optimizer(nested: dict, opts: StateDictOptions) -> dict:
    rank0_only = opts.cpu_offload and collectives.active()
    state, groups = nested["state"], nested["param_groups"]
    if not rank0_only:
        kept, _ = distribute.full_entries(state, rank0_only=False, cpu=opts.cpu_offload)
        return {"state": kept, "param_groups": groups}
    # Roots are decided over every FQN this rank knows, stateless ones included.
    names = list(dict.fromkeys([*state, *(f for g in groups for f in g["params"])]))
    entries = {name: state.get(name) for name in names}
    kept, roots = distribute.full_entries(entries, rank0_only=True, cpu=True)
    me = collectives.rank()
    mine = {"state": {k: v for k, v in kept.items() if v is not None}, "param_groups": []}
    if roots is None:
        mine["param_groups"] = groups if me == 0 else []
        return mine if me == 0 else {}
    rooted = set(kept)
    mine["param_groups"] = [g for g in groups if any(f in rooted for f in g["params"]) or (not g["params"] and rooted)]
    received = collectives.send_to_rank0(mine if me != 0 else None)
    if me != 0:
        return {}
    for part in received[1:]:
        if part:
            mine["state"].update(part["state"])
            mine["param_groups"].extend(part["param_groups"])
    return mine


def get_state_dict(model: nn.Module, optimizers: Optimizers, *, submodules=None, options: StateDictOptions | None = None) -> tuple[dict, dict]:
    return (
        get_model_state_dict(model, submodules=submodules, options=options),
        get_optimizer_state_dict(model, optimizers, submodules=submodules, options=options),
    )


# -- set ---------------------------------------------------------------------

def _run_pre_hooks(optims, osd):
    for opt in optims:
        for hook in _compat.optimizer_load_hooks(opt)[0]:
            result = hook(opt, osd)
            if result is not None:
                osd = result
    return osd


def _run_post_hooks(optims) -> None:
    for opt in optims:
        for hook in _compat.optimizer_load_hooks(opt)[1]:
            hook(opt)


def _manifest_names(manifest: Any) -> list[str]:
    """The FQN-like names in rank 0's dict, in an order every rank computes alike."""
    if not isinstance(manifest, dict):
        return []
    if flat_format.is_flat(manifest):
        return [k for k in manifest if isinstance(k, str)]
    names = [k for k in manifest.get("state", {}) if isinstance(k, str)]
    for g in manifest.get("param_groups", []) or []:
        if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)):
            names += [f for f in g["params"] if isinstance(f, str)]
    return list(dict.fromkeys(names))


class _Load:
    """One model and/or optimizer load: plan everywhere, agree, then apply."""

    def __init__(self, model: nn.Module, opts: StateDictOptions):
        self.model = model
        self.opts = opts
        self.index = ModelIndex(model, opts.dsd_fqn_modifiers)
        self.problems: list[str] = []
        self.model_plan = None
        self.optim_plan = None
        self.optims: tuple = ()
        self.broadcast = opts.broadcast_from_rank0 and collectives.active()
        self._fulls: list[torch.Tensor] = []
        self._metas: list = []

    def _source(self, value: Any, what: str) -> Any:
        """The dict to plan with: as given, or rank 0's manifest when broadcasting."""
        if not self.broadcast:
            return value
        if collectives.rank() == 0:
            manifest, fulls, problems = distribute.describe(value)
        else:
            manifest, fulls, problems = None, [], []
        manifest, problems = collectives.broadcast_object((manifest, problems))
        if collectives.rank() == 0:
            self.problems += [f"{what}: {p}" for p in problems]
        # Tensors of a second dict (set_state_dict: optimizer, then model) are
        # numbered after the first's.
        offset = len(self._metas)
        self._metas += distribute.manifest_metas(manifest)
        self._fulls += fulls
        return distribute.shift_indices(manifest, offset) if offset else manifest

    def plan_model(self, sd: Any) -> None:
        source = self._source(sd, "model")
        plan, problems = model_state.plan_load(
            self.model, self.index, source, strict=self.opts.strict,
            ignore_frozen=self.opts.ignore_frozen_params, foreign_ok=self.broadcast,
        )
        self.problems += problems
        if self.broadcast and self.opts.strict and isinstance(source, dict):
            names = [k for k in source if isinstance(k, str)]
            nobody = distribute.unowned(names, plan.claimed)
            if nobody:
                self.problems.append(f"model keys that no rank has (strict=True): {nobody}")
        self.model_plan = plan

    def plan_optimizers(self, optimizers: Optimizers, osd: Any) -> None:
        self.optims = optimizer_params(optimizers)
        source = self._source(_run_pre_hooks(self.optims, osd), "optimizer")
        plan, problems = optim_state.plan_load(
            self.index, self.optims, source, strict=self.opts.strict, foreign_ok=self.broadcast
        )
        self.problems += problems
        if self.broadcast and self.opts.strict:
            names = _manifest_names(source)
            mine = set(names) - set(plan.foreign)
            nobody = distribute.unowned(names, mine)
            if nobody:
                self.problems.append(f"not parameters of any rank's model (strict=True): {nobody}")
        self.optim_plan = plan

    def commit(self, what: str) -> None:
        questions = self.optim_plan.questions if self.optim_plan is not None else None
        answers = collectives.agree(self.problems, f"{what}: nothing was loaded", questions)
        if self.optim_plan is not None:
            self.optim_plan.settle(answers)
        if self.broadcast:
            prepared = []
            if self.model_plan is not None:
                prepared += [p for p in self.model_plan.tensors() if p.meta is not None]
            if self.optim_plan is not None:
                prepared += [p for _, _, p in self.optim_plan.tensors() if p.meta is not None]
            distribute.deliver(prepared, self._fulls if collectives.rank() == 0 else None, self._metas, _compat.collective_device())
        if self.optim_plan is not None:
            optim_state.apply_load(self.optim_plan)
            _run_post_hooks(self.optims)
        if self.model_plan is not None:
            model_state.apply_load(self.model, self.model_plan)


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *, options: StateDictOptions | None = None):
    """Load a model state dict; returns (missing_keys, unexpected_keys) by canonical FQN.

    With ``strict`` (the default) missing or unexpected keys raise, naming
    them, and nothing is changed.
    """
    opts = resolve_options(options)
    with torch.no_grad():
        load = _Load(model, opts)
        load.plan_model(model_state_dict)
        load.commit("set_model_state_dict")
    return _compat.incompatible_keys(load.model_plan.missing, load.model_plan.unexpected)


def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Load optimizer state keyed by FQN (nested or flat) into ``optimizers``.

    Existing state tensors are written in place (same objects and storage)
    when their layout allows; new ones take the parameter's mesh,
    placements and device and keep their own dtype.
    """
    opts = resolve_options(options)
    with torch.no_grad():
        load = _Load(model, opts)
        load.plan_optimizers(optimizers, optim_state_dict)
        load.commit("set_optimizer_state_dict")


def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any], options: StateDictOptions | None = None):
    """Both at once: nothing is changed unless both load."""
    opts = resolve_options(options)
    with torch.no_grad():
        load = _Load(model, opts)
        load.plan_optimizers(optimizers, optim_state_dict)
        load.plan_model(model_state_dict)
        load.commit("set_state_dict")
    return _compat.incompatible_keys(load.model_plan.missing, load.model_plan.unexpected)


# Names used by some training frameworks.
get_optim_state_dict = get_optimizer_state_dict
set_optim_state_dict = set_optimizer_state_dict
