"""SPEC §3 Keys (OPT-KEYS): optimizer state is keyed by canonical FQNs."""

from __future__ import annotations

from dataclasses import replace

from ..kit import (
    BASE,
    DATA_PARALLEL,
    ENDS,
    FSDP1_FLAT_PARAMS,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
    FSDP1_ORIGINAL,
    HALVED,
    ONE_RANK,
    REPLICATED,
    SHARDED_STAGES,
    WRAPPER_SEGMENTS,
    WRAPPERS,
    Clause,
    ModelConfig,
    Setup,
    canonical,
    check,
    diff_snapshots,
    fail_if,
    get_options,
    grid,
    loads,
    make_case,
    optimizers_arg,
    reordered,
    resuming,
    saving,
    snapshot,
)


def aliases(setup) -> dict:
    """Every canonical name of every parameter (tied parameters have several)."""
    names: dict = {}
    for name, p in setup.module.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(canonical(name))
    return names


def keys_1(c, layout, opt, mode):
    """Groups list the FQNs of the optimizer's parameters, in its order; state keys are FQNs."""
    s = Setup(c, layout, opt)
    s.train(2)
    osd = c.iut.get_optimizer_state_dict(s.model, optimizers_arg(s), options=get_options(c.iut, mode))
    if mode.on_root and c.rank != 0:  # rank 0 holds it all (OPT-RT-3 judges the rest)
        return
    model_keys = {canonical(k) for k in s.module.state_dict()}  # what get_model_state_dict must return (MODEL-1)
    check(
        isinstance(osd, dict) and set(osd) >= {"state", "param_groups"},
        f"get_optimizer_state_dict returned keys {sorted(map(str, osd))[:5]}, expected 'state' and 'param_groups'",
    )
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
                problems.append(
                    f"param_groups[{i}]['params'][{j}] = {key!r}, expected {allowed[0]!r} "
                    f"(position {j} in the optimizer's order)"
                )
    stateful = {names[p][0] for o in s.optimizers for p, st in o.state.items() if st}
    for key in osd["state"]:
        if not isinstance(key, str):
            problems.append(f"state key {key!r} is a {type(key).__name__}, not an FQN")
        elif key not in model_keys:
            problems.append(f"state key {key!r} is not a canonical FQN of the model")
    alias_of = {a: ns[0] for ns in names.values() for a in ns}
    missing = stateful - {alias_of.get(k, k) for k in osd["state"] if isinstance(k, str)}
    problems += [f"state for {fqn!r} is missing" for fqn in sorted(missing)]
    fail_if(problems, "optimizer state dict is not keyed by canonical FQNs in the optimizer's order")


@loads
def keys_regrouped(c, layout, opt, mode, how, before=1, after=1, warm=0):
    """A checkpoint loads into an optimizer that lists its groups (and their
    parameters) in another order (``how``'s groups have ``target_reverse``):
    each group's fields follow its parameters' FQNs, never its position, and
    K more steps equal the uninterrupted run with its groups in that order."""
    r = resuming.resume(c, how, mode, before=before, after=after, warm=warm)
    want, got = saving.comparable(
        mode, r.resumed, {**r.expected, "groups": reordered(r.expected["groups"])}, snapshot(r.resumed)
    )
    fail_if(
        diff_snapshots(want, got),
        f"{mode}: loaded into an optimizer with its groups in reverse order, the run differs from the uninterrupted",
    )


def keys_2(c, layout, mode, wrappers):
    """No wrapper prefix in any optimizer key; the dict loads back into a wrapped model."""
    r = resuming.resume(c, resuming.recipe(layout, wrappers=wrappers), mode)
    osd = c.iut.get_optimizer_state_dict(r.source.model, optimizers_arg(r.source), options=get_options(c.iut, mode))
    fail_if(
        diff_snapshots(r.expected, snapshot(r.resumed)), "a wrapped model does not resume like the uninterrupted run"
    )
    keys = list(osd.get("state", {})) + [f for g in osd.get("param_groups", []) for f in g.get("params", [])]
    bad = [k for k in keys if any(seg in str(k).split(".") for seg in WRAPPER_SEGMENTS)]
    fail_if(bad, f"wrapper prefixes ({'+'.join(wrappers) or layout}) appear in optimizer keys")


def keys_3(c, layout, mode):
    """A tied parameter appears once in optimizer state; loading keeps the tie."""
    r = resuming.resume(c, resuming.recipe(layout, cfg=ModelConfig(tie=True)), mode)
    a, b = r.source, r.resumed
    check(a.module.head.weight is a.module.tok.embedding.weight, "setup error: the model is not tied")
    osd = c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, mode))
    check(b.module.head.weight is b.module.tok.embedding.weight, "loading untied the tied parameters")
    fail_if(diff_snapshots(r.expected, snapshot(b)), "a tied model does not resume like the uninterrupted run")
    tied = ("tok.embedding.weight", "head.weight")
    if mode.on_root and c.rank != 0:  # rank 0 holds it all (OPT-RT-3 judges the rest)
        return
    if mode.flat:
        appear = {f for f in tied if any(k.startswith(f"state.{f}.") for k in osd)}
        in_groups = {f for f in tied if any(k.startswith(f"param_groups.{f}.") for k in osd)}
    else:
        appear = {f for f in tied if f in osd["state"]}
        in_groups = {f for g in osd["param_groups"] for f in g["params"] if f in tied}
        listed = [f for g in osd["param_groups"] for f in g["params"] if f in tied]
        check(len(listed) == 1, f"the tied parameter is listed {len(listed)} times in param_groups: {listed}")
    check(
        len(appear) == 1,
        f"optimizer state of the tied parameter appears under {sorted(appear) or 'no name'}, "
        f"expected exactly one of {tied}",
    )
    check(len(in_groups) == 1, f"the tied parameter's group fields appear under {sorted(in_groups)}, expected one name")


def keys_4(c, layout, mode):
    """Two optimizers over disjoint parameters: one merged dict, split back by group."""
    r = resuming.resume(c, resuming.recipe(layout, n_optimizers=2), mode)
    a = r.source
    osd = c.iut.get_optimizer_state_dict(a.model, a.optimizers, options=get_options(c.iut, mode))
    fail_if(
        diff_snapshots(r.expected, snapshot(r.resumed)),
        "after loading into two optimizers, the run differs from the uninterrupted one",
    )
    # FSDP1: a rank's shard of a parameter may be empty, and hold no state; the dict has every one's.
    gathered = a.gathered()
    if not mode.flat and (not mode.on_root or (c.rank == 0 and a.layout.pp == 1)):
        if gathered is not None:
            stateful = {fqn for fqn, entry in gathered["state"].items() if entry}
        else:
            stateful = {fqn for fqn, p in a.named_parameters() if any(o.state.get(p) for o in a.optimizers)}
        want_groups = sum(len(o.param_groups) for o in a.optimizers)
        check(
            len(osd["param_groups"]) == want_groups,
            f"the merged dict has {len(osd['param_groups'])} groups, the optimizers {want_groups}",
        )
        check(set(osd["state"]) == stateful, f"merged state keys differ: {sorted(set(osd['state']) ^ stateful)}")


def cases():
    yield from grid("OPT-KEYS-1", BASE, keys_1, opts=("adamw", "sgd"), modes=("sharded", "full"))
    # A get that only gathers to rank 0 (SPEC §1).
    yield from grid("OPT-KEYS-1", DATA_PARALLEL, keys_1, opts=("adamw",), modes=("full_cpu",))
    for layout, variants in WRAPPERS.items():
        for wrappers in variants:
            for mode in ("sharded", "full"):
                name = "+".join(wrappers) or "plain"
                yield make_case(
                    "OPT-KEYS-2", layout, keys_2, mode=mode, variant=name, wrappers=wrappers, deadline_s=120
                )
    # A consolidated checkpoint (rank 0 gathers, every rank loads the file): every
    # wrapper kind once, for an implementation that gets only full_cpu (SPEC §1).
    for layout, wrappers in (
        (ONE_RANK.one(), ("checkpoint", "compile")),
        (REPLICATED.one(), ()),
        (HALVED.one(), ("checkpoint",)),
    ):
        name = "+".join(wrappers) or "plain"
        yield make_case("OPT-KEYS-2", layout, keys_2, mode="file", variant=name, wrappers=wrappers, deadline_s=120)
    # FSDP1 (SPEC §2, 1.3). OPT-KEYS-1 pairs each of the optimizer's parameters with its FQN, which a flat
    # parameter has not (it holds several): the layouts with original parameters; not full_cpu, where only
    # rank 0 reads the model's own state dict, which FSDP1 gathers from every rank. Wrappers on both kinds.
    yield from grid("OPT-KEYS-1", FSDP1_ORIGINAL, keys_1, opts=("adamw",), modes=("sharded", "full"))
    for layout, variants in (
        (FSDP1_FULL.one(), (("checkpoint",), ("compile",), ("checkpoint", "compile"))),
        (FSDP1_FLAT_PARAMS.one(), ((), ("checkpoint",))),
    ):
        for wrappers in variants:
            for mode in ("sharded", "full"):
                name = "+".join(wrappers) or "plain"
                yield make_case(
                    "OPT-KEYS-2", layout, keys_2, mode=mode, variant=name, wrappers=wrappers, deadline_s=120
                )
    yield from grid(
        "OPT-KEYS-3", DATA_PARALLEL | HALVED | FSDP1_FULL_SHARD, keys_3, modes=("sharded", "full", "flat", "dcp")
    )
    yield from grid("OPT-KEYS-3", ENDS, keys_3, modes=("file",))
    # (two optimizers over disjoint parameters: a flat parameter holds a whole unit, so original ones)
    yield from grid(
        "OPT-KEYS-4",
        DATA_PARALLEL | SHARDED_STAGES | FSDP1_FULL,
        keys_4,
        modes=("sharded", "full", "full_cpu", "flat", "dcp"),
    )


def _explore_regrouped(s):
    # The target's groups in another order: only this check builds it so.
    how = resuming.recipe(s.built_on, s.optimizer, cfg=s.cfg(), groups=replace(s.groups(), target_reverse=True))
    return keys_regrouped, s.trained_args(before=s.before, after=s.after, warm=s.warm, how=how)


CLAUSES = {
    "OPT-KEYS-1": Clause(
        side="get", contains=lambda s: s.group_order == "reversed-target", check=_explore_regrouped, rank=160
    ),
    "OPT-KEYS-2": Clause(),
    "OPT-KEYS-3": Clause(),
    "OPT-KEYS-4": Clause(),
}
