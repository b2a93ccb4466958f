"""Implementations that surprise the suite: each wraps hyperdsd and twists one
thing in what its functions return (SPEC §4, 1.3: what the IUT returns is
input) or in what its sets do to the model and optimizers they are handed
(1.4: that is input too). The suite must judge every case of theirs
``passed``, ``failed`` or ``not applicable``, never ``error``.

``--impl tools.perverse.twists:NAME`` (the repository root on the path), for
each NAME in :data:`PERVERSE`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from conformance.adapters import load_adapter

PREFIX = "module."


def _prefixed(sd):
    return {PREFIX + k: v for k, v in sd.items()}


def _optim_prefixed(osd):
    if "state" not in osd:  # flat: state.{fqn}.{name}
        return {k.replace(".", "." + PREFIX, 1): v for k, v in osd.items()}
    groups = [dict(g, params=[PREFIX + p for p in g["params"]]) for g in osd["param_groups"]]
    return {"state": _prefixed(osd["state"]), "param_groups": groups}


def _drop_last(sd):
    keys = list(sd)
    return {k: v for k, v in sd.items() if k != keys[-1]} if keys else sd


def _optim_dropped(osd):
    if "state" not in osd:
        last = sorted(osd)[-1] if osd else None
        return {k: v for k, v in osd.items() if k != last}
    return {"state": _drop_last(osd["state"]), "param_groups": osd["param_groups"]}


def _added(sd):
    return {**sd, "not.a.parameter": torch.zeros(2)}


def _optim_added(osd):
    if "state" not in osd:
        return {**osd, "state.not.a.parameter.exp_avg": torch.zeros(2)}
    return {"state": _added(osd["state"]), "param_groups": osd["param_groups"]}


def _tensors_for_dicts(osd):
    if "state" not in osd:
        return {k: torch.zeros(1) for k in osd}
    return {"state": {k: torch.zeros(1) for k in osd["state"]}, "param_groups": osd["param_groups"]}


def _without_groups(osd):
    if "state" not in osd:
        return {k: v for k, v in osd.items() if not k.startswith("param_groups.")}
    return {"state": osd["state"]}


def _items(sd):
    return list(sd.items())


def _none(_sd):
    return None


def _optimizers(optims) -> list:
    if optims is None:  # set_model_state_dict hands over no optimizer
        return []
    return list(optims) if isinstance(optims, (list, tuple)) else [optims]


def _swap_params(model, optims) -> None:
    """The optimizers step copies: every group's parameters become new
    tensors (not the model's), their state moved along, as a library that
    rebuilt its optimizers from a state dict of copies leaves them."""
    for opt in _optimizers(optims):
        for group in opt.param_groups:
            copies = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in group["params"]]
            for old, new in zip(group["params"], copies):
                if old in opt.state:
                    opt.state[new] = opt.state.pop(old)
            group["params"] = copies


def _replace_params(model, optims) -> None:
    """Each module's own parameters become new objects holding the same
    values (``load_state_dict(assign=True)``'s way): the optimizer keeps
    stepping the old ones."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not isinstance(p, torch.distributed.tensor.DTensor):
                setattr(module, name, torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


def _drop_group(model, optims) -> None:
    """The last param group (and its parameters' state) removed."""
    for opt in _optimizers(optims):
        if opt.param_groups:
            for p in opt.param_groups.pop()["params"]:
                opt.state.pop(p, None)


def _add_group(model, optims) -> None:
    """A param group added, stepping a tensor the model does not have."""
    for opt in _optimizers(optims):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


def _clear_grads(model, optims) -> None:
    for p in model.parameters():
        p.grad = None


def _freeze(model, optims) -> None:
    """Every parameter stops requiring gradients."""
    for p in model.parameters():
        p.requires_grad_(False)


@dataclass(frozen=True)
class Twist:
    what: str
    model_get: Callable | None = None  # applied to what a model get returns
    optim_get: Callable | None = None  # ... an optimizer get returns
    set_returns: str | None = None  # what every set returns instead of its keys
    after_set: Callable | None = None  # done to (model, optimizers) after every set loaded
    after_get: Callable | None = None  # ... after every get


PERVERSE = {
    "prefixed": Twist("keys under a wrapper prefix", _prefixed, _optim_prefixed),
    "dropped": Twist("one key dropped", _drop_last, _optim_dropped),
    "added": Twist("one key added", _added, _optim_added),
    "none": Twist("gets return None", _none, _none),
    "items": Twist("gets return a list of items", _items, _items),
    "tensors": Twist("tensors where the state's dicts belong", optim_get=_tensors_for_dicts),
    "no_groups": Twist("optimizer gets without param_groups", optim_get=_without_groups),
    "set_returns": Twist("sets return nothing or the wrong type", set_returns="wrong"),
    # What the calls do to the objects they are handed (SPEC §4, 1.4).
    "swapped_params": Twist("sets leave the optimizers stepping copies", after_set=_swap_params),
    "replaced_params": Twist("sets replace the model's parameters", after_set=_replace_params),
    "dropped_group": Twist("sets drop the last param group", after_set=_drop_group),
    "added_group": Twist("sets add a param group", after_set=_add_group),
    "cleared_grads": Twist("gets and sets clear the gradients", after_set=_clear_grads, after_get=_clear_grads),
    "frozen": Twist("sets freeze every parameter", after_set=_freeze),
}


def _gets(base, t: Twist) -> dict:
    """The get functions ``t`` twists."""
    model_twist, optim_twist = t.model_get or _same, t.optim_get or _same
    effect = t.after_get or _nothing

    def get_model_state_dict(model, **kw):
        sd = base.get_model_state_dict(model, **kw)
        effect(model, None)
        return model_twist(sd)

    def get_optimizer_state_dict(model, optims, **kw):
        osd = base.get_optimizer_state_dict(model, optims, **kw)
        effect(model, optims)
        return optim_twist(osd)

    def get_state_dict(model, optims, **kw):
        msd, osd = base.get_state_dict(model, optims, **kw)
        effect(model, optims)
        return model_twist(msd), optim_twist(osd)

    return dict(
        get_model_state_dict=get_model_state_dict,
        get_optimizer_state_dict=get_optimizer_state_dict,
        get_state_dict=get_state_dict,
    )


def _sets(base, t: Twist) -> dict:
    """The set functions ``t`` twists."""
    effect = t.after_set or _nothing

    def after(model, optims, result):
        effect(model, optims)
        return t.set_returns if t.set_returns else result

    def set_model_state_dict(model, sd, **kw):
        result = base.set_model_state_dict(model, sd, **kw)
        if t.set_returns:
            return None  # the keys it returns are dropped
        return after(model, None, result)

    def set_optimizer_state_dict(model, optims, sd, **kw):
        return after(model, optims, base.set_optimizer_state_dict(model, optims, sd, **kw))

    def set_state_dict(model, optims, **kw):
        return after(model, optims, base.set_state_dict(model, optims, **kw))

    return dict(
        set_model_state_dict=set_model_state_dict,
        set_optimizer_state_dict=set_optimizer_state_dict,
        set_state_dict=set_state_dict,
    )


def _same(x):
    return x


def _nothing(model, optims) -> None:
    pass


def _twisted(name: str):
    t = PERVERSE[name]
    base = load_adapter("hyperdsd")
    changes = {}
    if t.model_get or t.optim_get or t.after_get:
        changes.update(_gets(base, t))
    if t.set_returns or t.after_set:
        changes.update(_sets(base, t))
    # The wrappers are the implementation under test: their twist is its deviation.
    return replace(base, name=f"perverse-{name}", version="0", functions_are_iut=True, **changes)


def _factory(name: str):
    def make():
        return _twisted(name)

    make.__doc__ = f"hyperdsd with {PERVERSE[name].what}."
    make.__name__ = name
    return make


globals().update({name: _factory(name) for name in PERVERSE})
