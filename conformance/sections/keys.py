"""SPEC §3 Keys (OPT-KEYS): optimizer state is keyed by canonical FQNs."""

from __future__ import annotations

from ..flows import get_options, optimizers_arg
from ..layouts import Setup, canonical
from ..oracle import check, fail_if
from ..registry import make_case

LAYOUTS = ("single", "ddp", "fsdp2", "fsdp3", "fsdp4", "hsdp2x2", "pp2", "pp2xfsdp2")
OPTS = ("adamw", "sgd")


def aliases(setup) -> dict:
    """Every canonical name of every parameter (tied parameters have several)."""
    names: dict = {}
    for name, p in setup.module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(canonical(name))
    return names


def keys_1(c, layout, opt, mode):
    s = Setup(c, layout, opt)
    s.train(2)
    osd = c.iut.get_optimizer_state_dict(s.model, optimizers_arg(s), options=get_options(c.iut, mode))
    model_keys = set(c.iut.get_model_state_dict(s.model, options=get_options(c.iut, "sharded")))
    check(isinstance(osd, dict) and set(osd) >= {"state", "param_groups"}, f"get_optimizer_state_dict returned keys {sorted(osd)[:5]}, expected 'state' and 'param_groups'")
    names = aliases(s)
    problems = []
    groups = osd["param_groups"]
    opt_groups = [g for o in s.optimizers for g in o.param_groups]
    check(len(groups) == len(opt_groups), f"{len(groups)} param groups returned, the optimizer has {len(opt_groups)}")
    for i, (got, mine) in enumerate(zip(groups, opt_groups)):
        expected = [names[p] for p in mine["params"]]
        params = got.get("params")
        if not isinstance(params, list) or len(params) != len(expected):
            problems.append(f"param_groups[{i}]['params'] = {params!r}, expected {[e[0] for e in expected]}")
            continue
        for j, (key, allowed) in enumerate(zip(params, expected)):
            if key not in allowed:
                problems.append(f"param_groups[{i}]['params'][{j}] = {key!r}, expected {allowed[0]!r} (position {j} in the optimizer's order)")
    stateful = {names[p][0] for o in s.optimizers for p, st in o.state.items() if st}
    for key in osd["state"]:
        if not isinstance(key, str):
            problems.append(f"state key {key!r} is a {type(key).__name__}, not an FQN")
        elif key not in model_keys:
            problems.append(f"state key {key!r} is not a key of get_model_state_dict")
    got_state = {k for k in osd["state"] if isinstance(k, str)}
    alias_of = {a: ns[0] for ns in names.values() for a in ns}
    missing = stateful - {alias_of.get(k, k) for k in got_state}
    problems += [f"state for {fqn!r} is missing" for fqn in sorted(missing)]
    fail_if(problems, "optimizer state dict is not keyed by canonical FQNs in the optimizer's order")


def cases():
    for layout in LAYOUTS:
        for opt in OPTS:
            for mode in ("sharded", "full"):
                yield make_case("OPT-KEYS-1", layout, keys_1, opt=opt, mode=mode)
