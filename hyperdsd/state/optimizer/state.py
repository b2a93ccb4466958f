"""Optimizer state by FQN: reading it (pure), and applying a checked load plan.

Reading never steps, never touches ``optimizer.state``, ``param_groups``,
parameters or gradients. Loading is planned first (:mod:`hyperdsd.state.optimizer.plan`,
which changes nothing); :func:`apply_load` then carries the plan out,
copying into existing state tensors in place where their layout allows.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from itertools import chain, compress
from operator import methodcaller
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ... import _compat
from ...blocks import blocks
from ...errors import StateDictError
from ...tree import is_container, rebuild
from ..keys.flat import GROUPS, STATE
from ..keys.fqn import ModelIndex
from ..loading.checks import fits
from ..loading.plan import OptimizerLoadPlan, Prepared, copy_all, copy_into, materialize, redistribute
from ..placeholders.scratch import placeholder_state_of, stateless_placeholders


def _own(value: Any) -> Any:
    """A copy of a group field that the optimizer cannot change under us."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_own(v) for v in value]
    return value


_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter, DTensor})


def _entry_copies(entries: list[dict]) -> Iterable[dict]:
    """A new state entry for each of ``entries``, as :func:`_entry_copy` makes
    it; one copy in C each where every value is a tensor (AdamW's, SGD's)."""
    if _TENSORS.issuperset(map(type, chain.from_iterable(map(methodcaller("values"), entries)))):
        return map(dict, entries)
    return map(_entry_copy, entries)


def _entry_copy(entry: dict) -> dict:
    """A new state entry whose containers (nested dicts and lists) are new too;
    tensors and other leaves are the optimizer's own."""
    return {k: v if isinstance(v, torch.Tensor) or not is_container(v) else rebuild(v, _same) for k, v in entry.items()}


def _same(leaf: Any, _path: tuple) -> Any:
    return leaf


def _param_fqns(index: ModelIndex, params: list, gi: int) -> list[str]:
    """The FQN of each of a group's parameters."""
    fqns = index.fqns_of(params)
    if None in fqns:  # not the model's
        pi = fqns.index(None)
        raise StateDictError(
            f"param_groups[{gi}]['params'][{pi}] (shape {tuple(params[pi].shape)}) "
            "of the optimizer is not a parameter of the model"
        )
    return fqns


def read_state(index: ModelIndex, optimizers, *, to_load: bool = False) -> dict:
    """``{"state": {fqn: {...}}, "param_groups": [{"params": [fqn, ...], ...}]}``.

    State entries are new dicts, nested containers included (changing them
    does not reach the optimizer); their tensors are the optimizer's own, as
    ``Optimizer.state_dict()`` gives them. A never-stepped optimizer yields
    placeholder state (see placeholder_state). ``to_load``: a template to load a
    checkpoint into, where a stepped optimizer's parameters without state
    get placeholder state too, so that what the checkpoint holds for them is
    checked before anything is read.
    """
    state: dict[str, dict] = {}
    groups: list[dict] = []
    for opt in optimizers:
        placeholders = placeholder_state_of(opt) if not opt.state else (stateless_placeholders(opt) if to_load else {})
        if _compat.plain_state_dict(opt):
            sd_groups, stored = opt.param_groups, opt.state  # what state_dict() would pack, read in place
        else:
            sd = opt.state_dict()  # runs the optimizer's own state-dict hooks
            sd_groups, stored = sd[GROUPS], sd[STATE]  # keyed by packed ids: ints, cheap to hash
        for g_sd, group in zip(sd_groups, opt.param_groups):
            params, keys = group["params"], g_sd["params"]
            fqns = _param_fqns(index, params, len(groups))
            for block in blocks(len(params)):  # (each entry read three times: see hyperdsd.blocks)
                entries = list(map(stored.get, keys[block]))
                if placeholders and not all(entries):
                    entries = [entry or placeholders.get(p) for entry, p in zip(entries, params[block])]
                state.update(zip(compress(fqns[block], entries), _entry_copies(list(filter(None, entries)))))
            groups.append({**{k: _own(v) for k, v in g_sd.items() if k != "params"}, "params": fqns})
    return {STATE: state, GROUPS: groups}


def _loaded(value: Any, existing: Any) -> Any:
    """The value a planned one becomes: tensors copied into the state tensor
    they fit (planned, or ``existing``) or made new; containers rebuilt
    around their loaded leaves; anything else copied."""
    if isinstance(value, Prepared):
        if value.landing is not None:  # delivered elsewhere (a wrapper layout's own): a stand-in stays
            alike = isinstance(existing, torch.Tensor) and existing.dtype == value.dtype
            return existing if alike and existing.shape == value.meta.shape else materialize(value)
        if value.dest is not None:  # planned to fit (checked when planned)
            return copy_into(value.dest, value)
        return copy_into(existing, value) if fits(existing, value) else materialize(value)
    if is_container(value):
        return rebuild(value, lambda leaf, _path: _loaded(leaf, None))
    return copy.deepcopy(value)


def apply_load(plan: OptimizerLoadPlan) -> None:
    """Carry out a checked plan: state first, then group fields."""
    redistribute(plan.tensors())
    for load in plan.params:
        if load.entry is None:
            load.opt.state.pop(load.param, None)
            continue
        if load.into is not None:  # each value into its own tensor (plan.copies, or delivered): the entry stays
            continue
        current = load.opt.state.get(load.param)
        new = {key: _loaded(value, (current or {}).get(key)) for key, value in load.entry.items()}
        if current is None:
            load.opt.state[load.param] = new
        else:
            for key in [k for k in current if k not in new]:
                del current[key]
            current.update(new)
    copy_all(plan.copies)
    for group, fields in plan.groups:
        for key, value in fields.items():
            old = group.get(key)
            if (
                isinstance(old, torch.Tensor)
                and isinstance(value, (torch.Tensor, int, float))
                and not isinstance(value, bool)
            ):
                if not isinstance(value, torch.Tensor) or value.shape == old.shape:
                    old.copy_(value) if isinstance(value, torch.Tensor) else old.fill_(value)
                    continue
            group[key] = _own(value)
