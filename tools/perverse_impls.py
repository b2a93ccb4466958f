"""Implementations whose output surprises the suite: each wraps hyperdsd and
twists one thing in what its functions return (SPEC §4, 1.3: what the IUT
returns is input). The suite must judge every case of theirs ``passed``,
``failed`` or ``not applicable``, never ``error``.

``--impl tools.perverse_impls:NAME`` (the repository root on the path), for
each NAME in :data:`PERVERSE`.
"""

from __future__ import annotations

from dataclasses import replace

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


# name: (what is twisted, model get's twist, optimizer get's twist, set's return)
PERVERSE = {
    "prefixed": ("keys under a wrapper prefix", _prefixed, _optim_prefixed, None),
    "dropped": ("one key dropped", _drop_last, _optim_dropped, None),
    "added": ("one key added", _added, _optim_added, None),
    "none": ("gets return None", _none, _none, None),
    "items": ("gets return a list of items", _items, _items, None),
    "tensors": ("tensors where the state's dicts belong", None, _tensors_for_dicts, None),
    "no_groups": ("optimizer gets without param_groups", None, _without_groups, None),
    "set_returns": ("sets return nothing or the wrong type", None, None, "wrong"),
}


def _twisted(name: str):
    what, model_twist, optim_twist, set_return = PERVERSE[name]
    base = load_adapter("hyperdsd")
    changes = {}
    if model_twist:
        changes["get_model_state_dict"] = lambda model, **kw: model_twist(base.get_model_state_dict(model, **kw))
    if optim_twist:
        changes["get_optimizer_state_dict"] = lambda model, optims, **kw: optim_twist(
            base.get_optimizer_state_dict(model, optims, **kw)
        )
    if model_twist or optim_twist:

        def get_state_dict(model, optims, **kw):
            msd, osd = base.get_state_dict(model, optims, **kw)
            return (model_twist or (lambda x: x))(msd), (optim_twist or (lambda x: x))(osd)

        changes["get_state_dict"] = get_state_dict
    if set_return:

        def set_model_state_dict(model, sd, **kw):
            base.set_model_state_dict(model, sd, **kw)  # noqa: B018 - the keys it returns are dropped

        def set_optimizer_state_dict(model, optims, sd, **kw):
            base.set_optimizer_state_dict(model, optims, sd, **kw)
            return set_return

        def set_state_dict(model, optims, **kw):
            base.set_state_dict(model, optims, **kw)
            return set_return

        changes.update(
            set_model_state_dict=set_model_state_dict,
            set_optimizer_state_dict=set_optimizer_state_dict,
            set_state_dict=set_state_dict,
        )
    # The wrappers are the implementation under test: their twist is its deviation.
    return replace(base, name=f"perverse-{name}", version="0", functions_are_iut=True, **changes)


def _factory(name: str):
    def make():
        return _twisted(name)

    make.__doc__ = f"hyperdsd with {PERVERSE[name][0]}."
    make.__name__ = name
    return make


globals().update({name: _factory(name) for name in PERVERSE})
