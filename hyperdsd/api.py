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
from . import optimizer_plan as optim_plan
from .errors import StateDictError
from .fqn import ModelIndex, optimizer_params
from .options import StateDictOptions, resolve_options
from .scatter import PackedNeeds

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


_ABSENT = object()


class _Load:
    """One load of a model and/or optimizers: plan on every rank, agree, apply.

    With ``broadcast_from_rank0``: one broadcast of rank 0's manifest (model
    and optimizer together), planning on every rank, then one exchange that
    carries each rank's problems, open questions, ownership and needs, then
    the transfers. Without it: planning, then one all-reduce to agree.
    """

    def __init__(self, model: nn.Module, opts: StateDictOptions, *, model_sd: Any = _ABSENT, optimizers=None, osd: Any = _ABSENT):
        self.model = model
        self.opts = opts
        self.index = ModelIndex(model, opts.dsd_fqn_modifiers)
        self.broadcast = opts.broadcast_from_rank0 and collectives.active()
        self.optims = optimizer_params(optimizers) if osd is not _ABSENT else ()
        self.model_sd = model_sd
        self.osd = _run_pre_hooks(self.optims, osd) if osd is not _ABSENT else _ABSENT
        self.problems: list[str] = []
        self.model_plan = None
        self.optim_plan = None

    def run(self, what: str) -> None:
        fulls, metas = [], []
        model_src, optim_src = self.model_sd, self.osd
        if self.broadcast:
            model_src, optim_src, fulls, metas = self._manifests()
        if model_src is not _ABSENT:
            self.model_plan, problems = model_state.plan_load(
                self.model, self.index, model_src, strict=self.opts.strict,
                ignore_frozen=self.opts.ignore_frozen_params, foreign_ok=self.broadcast,
            )
            self.problems += problems
        if optim_src is not _ABSENT:
            self.optim_plan, problems = optim_plan.plan_load(
                self.index, self.optims, optim_src, strict=self.opts.strict, foreign_ok=self.broadcast
            )
            self.problems += problems
        questions = self.optim_plan.questions if self.optim_plan is not None else {}
        if self.broadcast:
            answers = self._exchange_and_deliver(what, model_src, optim_src, questions, fulls, metas)
        else:
            answers = collectives.agree(self.problems, f"{what}: nothing was loaded", questions)
        if self.optim_plan is not None:
            self.optim_plan.settle(answers)
            optim_state.apply_load(self.optim_plan)
            _run_post_hooks(self.optims)
        if self.model_plan is not None:
            model_state.apply_load(self.model, self.model_plan)

    def _manifests(self):
        """Rank 0's dicts as manifests, on every rank; its tensors, on rank 0."""
        both = {"model": self.model_sd, "optim": self.osd}
        if collectives.rank() == 0:
            manifest, fulls, problems = distribute.describe({k: v for k, v in both.items() if v is not _ABSENT})
        else:
            manifest, fulls, problems = None, [], []
        manifest, problems = collectives.broadcast_object((manifest, problems))
        if collectives.rank() == 0:
            self.problems += problems
        metas = distribute.manifest_metas(manifest)
        return manifest.get("model", _ABSENT), manifest.get("optim", _ABSENT), fulls, metas

    def _exchange_and_deliver(self, what, model_src, optim_src, questions, fulls, metas) -> dict[str, bool]:
        # Names in rank 0's dict, the same list on every rank, and the ones this rank loads.
        model_names = [k for k in model_src if isinstance(k, str)] if isinstance(model_src, dict) else []
        optim_names = _manifest_names(optim_src) if optim_src is not _ABSENT else []
        mine_model = self.model_plan.claimed if self.model_plan is not None else set()
        mine_optim = set(optim_names) - set(self.optim_plan.foreign) if self.optim_plan is not None else set()
        prepared = self._prepared()
        needs, users = distribute.needs_for(prepared, metas)
        everyone = collectives.exchange({
            "problems": self.problems,
            "known": {k: v for k, v in questions.items() if v is not None},
            "model": [i for i, k in enumerate(model_names) if k in mine_model],
            "optim": [i for i, k in enumerate(optim_names) if k in mine_optim],
            "needs": PackedNeeds(needs),
        })
        problems = [e["problems"] for e in everyone]
        if self.opts.strict:
            owned_model = {i for e in everyone for i in e["model"]}
            owned_optim = {i for e in everyone for i in e["optim"]}
            nobody = [k for i, k in enumerate(model_names) if i not in owned_model]
            nobody_optim = [k for i, k in enumerate(optim_names) if i not in owned_optim]
            extra = []
            if nobody:
                extra.append(f"model keys that no rank has (strict=True): {nobody}")
            if nobody_optim:
                extra.append(f"not parameters of any rank's model (strict=True): {nobody_optim}")
            problems = [p + extra for p in problems]
        collectives.raise_if_any(problems, f"{what}: nothing was loaded")
        answers = collectives.answer([k for k, v in questions.items() if v is None], [e["known"] for e in everyone])
        distribute.deliver(needs, users, fulls if collectives.rank() == 0 else None, metas, _compat.collective_device(),
                           everyone_needs=[e["needs"] for e in everyone])
        return answers

    def _prepared(self) -> list:
        prepared = []
        if self.model_plan is not None:
            prepared += [p for p in self.model_plan.tensors() if p.meta is not None]
        if self.optim_plan is not None:
            prepared += [p for p in self.optim_plan.tensors() if p.meta is not None]
        return prepared


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *, options: StateDictOptions | None = None):
    """Load a model state dict; returns (missing_keys, unexpected_keys) by canonical FQN.

    With ``strict`` (the default) missing or unexpected keys raise, naming
    them, and nothing is changed.
    """
    opts = resolve_options(options)
    with torch.no_grad():
        load = _Load(model, opts, model_sd=model_state_dict)
        load.run("set_model_state_dict")
    return _compat.incompatible_keys(load.model_plan.missing, load.model_plan.unexpected)


def set_optimizer_state_dict(model: nn.Module, optimizers: Optimizers, optim_state_dict: dict[str, Any], *, options: StateDictOptions | None = None) -> None:
    """Load optimizer state keyed by FQN (nested or flat) into ``optimizers``.

    Existing state tensors are written in place (same objects and storage)
    when their layout allows; new ones take the parameter's mesh,
    placements and device and keep their own dtype.
    """
    opts = resolve_options(options)
    with torch.no_grad():
        _Load(model, opts, optimizers=optimizers, osd=optim_state_dict).run("set_optimizer_state_dict")


def set_state_dict(model: nn.Module, optimizers: Optimizers, *, model_state_dict: dict[str, Any], optim_state_dict: dict[str, Any], options: StateDictOptions | None = None):
    """Both at once: nothing is changed unless both load."""
    opts = resolve_options(options)
    with torch.no_grad():
        load = _Load(model, opts, model_sd=model_state_dict, optimizers=optimizers, osd=optim_state_dict)
        load.run("set_state_dict")
    return _compat.incompatible_keys(load.model_plan.missing, load.model_plan.unexpected)


# Names used by some training frameworks.
get_optim_state_dict = get_optimizer_state_dict
set_optim_state_dict = set_optimizer_state_dict
