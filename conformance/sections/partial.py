"""SPEC §3 Partial state (OPT-PART).

Through DCP (the ``dcp`` mode) the load template is the target's own get,
loaded with the implementation's documented load planner and nothing
relaxed (SPEC §2). A template entry the checkpoint has no state for at all
is what lazy state looks like to a load path: OPT-PART-1's new parameters
(an adapter) and OPT-PART-5's never-stepped routers alike. A load path
that leaves such entries out lets set decide from the param groups:
with ``strict=False`` the new parameters stay fresh, with ``strict=True``
set names them (the checkpoint's groups do not list them).
"""

from __future__ import annotations

from ..kit import (
    BASE,
    DATA_PARALLEL,
    ENDS,
    FSDP1_FLAT_PARAMS,
    FSDP1_FULL,
    FSDP1_HYBRID,
    HALVED,
    HYBRID,
    MODES,
    ONE_RANK,
    QUARTERS,
    SHARDED_STAGES,
    STAGES,
    THIRDS,
    Clause,
    GroupSpec,
    ModelConfig,
    Setup,
    check,
    diff_snapshots,
    diff_values,
    drop_from_dict,
    drop_from_metadata,
    expect_error,
    expect_unchanged,
    fail_if,
    get_options,
    grid,
    make_case,
    moves,
    only_layers,
    optimizer_view,
    optimizers_arg,
    reshard,
    resharded_case,
    resuming,
    saving,
    set_options,
    snapshot,
)

ADAPTER = ["adapter.weight", "adapter.bias"]
# Frozen after training: a fine-tune that stops training the first block.
FROZEN_AFTER = ("layers.0.fc1.weight", "layers.0.fc1.bias")


def part_1(c, layout, mode, strict, same_hparams=False):
    """The target has parameters the checkpoint lacks (an adapter added for fine-tuning).

    ``same_hparams``: the target's groups have the checkpoint's hyperparameters,
    so the new parameters' group fields in a DCP template differ in nothing
    from what the checkpoint holds; only the load path can tell that the
    checkpoint never listed them (a path that counts the template's own
    fields as loaded lists them, and strict=True passes)."""
    kept = resuming.trained_source(c, resuming.recipe(layout), 2)
    saved = kept.save(c, mode)
    want = snapshot(kept.setup)
    groups = GroupSpec.for_seed(0) if same_hparams else None
    b = Setup(c, layout, "adamw", seed=1, cfg=ModelConfig(adapter=True), groups=groups)
    b.set_steps_done(2)
    mine = [f for f in ADAPTER if f in dict(b.named_parameters())]
    if strict:
        before = optimizer_view(b)
        expect_error(
            lambda: saving.load(c, b, saved, strict=True, model=False),
            names=ADAPTER if mine else [],
            what="OPT-PART-1: strict=True with parameters the checkpoint lacks",
        )
        expect_unchanged(before, optimizer_view(b), "OPT-PART-1: the failed strict load changed the optimizer")
        return
    saving.load(c, b, saved, strict=False)
    got = snapshot(b)
    problems = [
        f"state[{fqn!r}]: present, expected fresh (absent) state for a parameter the checkpoint lacks"
        for fqn in mine
        if fqn in got["state"]
    ]
    problems += diff_values(want["state"], {k: v for k, v in got["state"].items() if k not in ADAPTER}, "state")
    problems += diff_values(want["params"], {k: v for k, v in got["params"].items() if k not in ADAPTER}, "params")
    fail_if(problems, "OPT-PART-1: strict=False did not load the rest, or touched the new parameters")
    b.train(1)  # training goes on; the adapter gets state of its own
    if mine:
        check(all(f in snapshot(b)["state"] for f in mine), "OPT-PART-1: the new parameters got no state after a step")


def part_2(c, layout, mode):
    """Lazy state: parameters that never had a gradient have no state, before and after."""
    kept = resuming.trained_source(c, resuming.recipe(layout, cfg=ModelConfig(lazy_aux=True)), 2)
    a = kept.setup
    lazy = [f for f, p in a.named_parameters() if p.requires_grad and not a.optimizers[0].state.get(p)]
    check(bool(lazy) or a.layout.pp > 1, "setup error: no lazy parameter")
    saved = kept.save(c, mode)
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1, cfg=ModelConfig(lazy_aux=True))
    b.set_steps_done(2)
    saving.load(c, b, saved, strict=True)
    fail_if(
        diff_snapshots(want, snapshot(b)),
        "OPT-PART-2: the loaded optimizer does not reproduce the source (lazy state included)",
    )


def part_3(c, layout, mode):
    """Freezing after training: ignore_frozen_params drops them from the model dict, never their optimizer state."""
    frozen = list(FROZEN_AFTER)
    a = Setup(c, layout, "adamw", cfg=ModelConfig(frozen=True))
    a.train(2)
    a.freeze(frozen)
    opts = get_options(c.iut, mode, ignore_frozen_params=True)
    msd = c.iut.get_model_state_dict(a.model, options=opts)
    if not mode.on_root or c.rank == 0:
        leaked = [f for f in frozen + ["frozen.weight", "frozen.bias"] if f in msd]
        check(not leaked, f"OPT-PART-3: ignore_frozen_params kept frozen parameters {leaked}")
    saved = saving.save(c, a, mode, options={"ignore_frozen_params": True})
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1, cfg=ModelConfig(frozen=True))
    b.freeze(frozen)
    saving.load(c, b, saved, options={"ignore_frozen_params": True}, model=False)
    got = snapshot(b)
    problems = [f"state[{f!r}]: dropped" for f in frozen if f in want["state"] and f not in got["state"]]
    problems += diff_values(want["state"], got["state"], "state")
    fail_if(problems, "OPT-PART-3: optimizer state of frozen parameters was not kept")


def part_3_step0(c, layout, mode):
    """A parameter frozen from the start never has optimizer state: resuming
    from a checkpoint taken before the first step (as training scripts save
    at step 0) leaves it without any, and runs like the uninterrupted run."""
    r = resuming.resume(c, resuming.recipe(layout, cfg=ModelConfig(frozen=True)), mode, before=0)
    fail_if(
        diff_snapshots(r.expected, snapshot(r.resumed)),
        f"OPT-PART-3: {mode}: after resuming from a step-0 checkpoint, the run differs from the uninterrupted one",
    )


def part_3_resume(c, layout, mode, *, how=None, before=2, after=1, warm=0):
    """Parameters frozen after training keep their state: a checkpoint taken after freezing them, loaded into a
    fresh optimizer (whose get gives DCP a template without it) or a warm one, trains on like the uninterrupted run."""
    how = how or resuming.recipe(layout)
    a = how.build(c, 0)
    a.train(before)
    a.freeze(FROZEN_AFTER)
    had = [f for f in FROZEN_AFTER if f in snapshot(a)["state"]]
    saved = saving.save(c, a, mode)
    a.train(after)
    want = snapshot(a)
    b = how.build(c, 1)
    if warm:
        resuming.warm_up(b, warm)
    b.freeze(FROZEN_AFTER)
    b.set_steps_done(before)
    saving.load(c, b, saved)
    loaded = snapshot(b)["state"]
    fail_if(
        [f"state[{f!r}]: dropped" for f in had if f not in loaded],
        f"OPT-PART-3: {mode}: the state of parameters frozen after training was not loaded into a "
        f"{'warm' if warm else 'fresh'} optimizer",
    )
    b.train(after)
    fail_if(
        diff_snapshots(*saving.comparable(mode, b, want, snapshot(b))),
        f"OPT-PART-3: {mode}: resumed with parameters frozen after training, the run differs from the uninterrupted",
    )


def part_4(c, layout, mode):
    """An optimizer over a subset of the parameters round-trips."""
    r = resuming.resume(c, resuming.recipe(layout, trainable=only_layers), mode)
    fail_if(
        diff_snapshots(r.expected, snapshot(r.resumed)),
        "OPT-PART-4: an optimizer over some parameters does not resume like the uninterrupted run",
    )


def part_6_file(c, layout, fqn, key):
    """Partly missing state in a consolidated file (every rank reads it):
    every rank raises naming the FQN and the key; nothing changes."""
    a = Setup(c, layout, "adamw")
    a.train(2)
    osd = saving.read_full(saving.save(c, a, "file", model=None).path)["optim"]
    check(key in osd["state"].get(fqn, {}), f"setup error: the checkpoint has no state[{fqn!r}][{key!r}]")
    del osd["state"][fqn][key]
    b = Setup(c, layout, "adamw", seed=1)
    b.set_steps_done(2)
    before = optimizer_view(b)
    expect_error(
        lambda: c.iut.set_optimizer_state_dict(b.model, optimizers_arg(b), osd, options=set_options(c.iut, "file")),
        names=[fqn, key],
        what=f"OPT-PART-6: a file without state[{fqn!r}][{key!r}]",
    )
    expect_unchanged(before, optimizer_view(b), "OPT-PART-6: the failed load changed the optimizer")


def is_router(fqn: str) -> bool:
    return ".router." in fqn


def router_setup(c, layout, seed: int, own_group: bool, **kw) -> Setup:
    """A model whose routers never get a gradient, in the middle of the model:
    in groups with parameters that step, or (``own_group``) in a group of their own."""
    groups = GroupSpec.for_seed(seed, router_group=own_group)
    return Setup(c, layout, "adamw", seed=seed, cfg=ModelConfig(router=True, **kw), groups=groups)


def stateful_routers(setup) -> list[str]:
    return [f for f, p in setup.named_parameters() if is_router(f) and any(o.state.get(p) for o in setup.optimizers)]


def part_5(c, layout, own_group):
    """Resume through DCP into a freshly built optimizer; the routers never had a gradient."""
    a = router_setup(c, layout, 0, own_group)
    a.train(2)
    check(
        any(is_router(f) for f, _ in a.named_parameters()) and not stateful_routers(a),
        "setup error: the routers are not lazy",
    )
    saved = saving.save(c, a, "dcp")
    want = snapshot(a)
    a.train(1)
    b = router_setup(c, layout, 1, own_group)
    b.set_steps_done(2)
    saving.load(c, b, saved)
    stale = [
        f"state[{f!r}]: present after the load; the checkpoint has none (the router never had a gradient)"
        for f in stateful_routers(b)
    ]
    fail_if(stale + diff_snapshots(want, snapshot(b)), "OPT-PART-5: the resumed optimizer differs from the one saved")
    b.train(1)
    fail_if(
        diff_snapshots(snapshot(a), snapshot(b)),
        "OPT-PART-5: training after the resume differs from the uninterrupted run",
    )


# The warm targets' own steps (OPT-PART-6 holds for a stepped optimizer too).
WARM = 1


def part_6(c, layout, fqn, key, mode="dcp", warm=False):
    """Partly missing state, in a real DCP checkpoint or a dict in memory,
    loaded into a fresh or (``warm``) a stepped optimizer: every rank raises
    naming the FQN and the key; nothing changes. A stepped optimizer has
    every key already, so a load path that takes what is there would leave
    the target's own values beside the checkpoint's without a word."""
    a = Setup(c, layout, "adamw")
    a.train(2)
    saved = saving.save(c, a, mode, model=None)
    if mode.through_dcp:
        drop_from_metadata(c, saved.path, [f"optim.state.{fqn}.{key}"])
    else:
        drop_from_dict(saved, fqn, key)
    b = Setup(c, layout, "adamw", seed=1)
    if warm:
        resuming.warm_up(b, WARM)
    b.set_steps_done(2)
    before = optimizer_view(b)
    target = "a stepped optimizer" if warm else "a fresh optimizer"
    expect_error(
        lambda: saving.load(c, b, saved, model=False),
        names=[fqn, key],
        what=f"OPT-PART-6: a checkpoint without state[{fqn!r}][{key!r}], loaded into {target}",
    )
    changed = "OPT-PART-6: the failed load changed the optimizer" + (" (a stepped one)" if warm else "")
    expect_unchanged(before, optimizer_view(b), changed)


# (Not FSDP1: it gives every part of a rank's flat shard a gradient, zeros where none flowed, so
# a parameter that never had one still gets state on the ranks that hold a piece of it.)
# (layout, FQN, key): an even and an uneven shard (fsdp3: 3, 3, 2 rows), an
# empty one (fsdp4: aux.weight has 3 rows), pipeline stages (flat layout).
PART_6 = (
    (ONE_RANK.one(), "layers.0.fc2.weight", "exp_avg_sq"),
    (ONE_RANK.one(), "layers.1.fc1.bias", "step"),
    (THIRDS.one(), "layers.0.fc2.weight", "exp_avg_sq"),
    (THIRDS.one(), "layers.0.fc2.weight", "step"),
    (QUARTERS.one(), "aux.weight", "exp_avg_sq"),
    (STAGES.one(), "layers.1.fc2.weight", "exp_avg_sq"),
    (SHARDED_STAGES.one(), "layers.0.fc2.weight", "step"),
    (FSDP1_FULL.one(), "layers.0.fc2.weight", "exp_avg_sq"),
    (FSDP1_FLAT_PARAMS.one(), "layers.1.fc1.bias", "step"),  # one part of a flat parameter
)
# (layout, FQN, key, mode): the in-memory modes, into stepped optimizers.
PART_6_MEMORY = (
    (ONE_RANK.one(), "layers.0.fc2.weight", "exp_avg_sq", "sharded"),
    (THIRDS.one(), "layers.0.fc2.weight", "step", "full"),
    (QUARTERS.one(), "aux.weight", "exp_avg_sq", "flat"),
    (HYBRID.one(), "layers.1.fc1.bias", "exp_avg_sq", "full_cpu"),
)


def cases():
    strict = {"strict": {"strict": True}}
    both = {"nonstrict": {"strict": False}} | strict
    fresh_warm = {"frozen_after-fresh": {"warm": 0}, "frozen_after-warm": {"warm": 2}}
    # The consolidated file (SPEC §2 ``file``): what a full-state-only library loads.
    yield from grid("OPT-PART-1", ENDS, part_1, modes=("file",), variants=both)
    for layout, fqn, key in (
        (ONE_RANK.one(), "layers.0.fc2.weight", "exp_avg_sq"),
        (QUARTERS.one(), "aux.weight", "step"),
    ):
        yield make_case("OPT-PART-6", layout, part_6_file, mode="file", variant=f"no_{key}", fqn=fqn, key=key)
    yield from grid(
        "OPT-PART-1",
        ONE_RANK | HALVED | QUARTERS | HYBRID | SHARDED_STAGES,
        part_1,
        modes=("sharded", "full", "flat", "dcp"),
        variants=both,
    )
    # Pipelines go through DCP in the flat layout, whose group fields are per parameter.
    yield make_case(
        "OPT-PART-1",
        SHARDED_STAGES.one(),
        part_1,
        mode="dcp",
        variant="strict_same_hparams",
        strict=True,
        same_hparams=True,
    )
    # (Lazy state and subsets go by original parameter: a flat parameter has a gradient when any of its
    # parts has one, and an optimizer holds it whole, so FSDP1 runs them with original parameters.)
    yield from grid("OPT-PART-2", DATA_PARALLEL | THIRDS | SHARDED_STAGES | FSDP1_FULL, part_2, modes=MODES)
    yield from grid(
        "OPT-PART-3", ONE_RANK | HALVED | QUARTERS | HYBRID, part_3, modes=("sharded", "full", "flat", "dcp")
    )
    # FSDP1 (SPEC §2, 1.3): frozen parameters need the original ones (a flat parameter
    # freezes whole); strict partial loads, frozen state resumed. (A non-strict load goes into
    # a model with a parameter more, whose FSDP1 units shard every parameter at other offsets:
    # the case's rank-by-rank comparison of pieces cannot pair them.)
    yield from grid("OPT-PART-1", FSDP1_FULL, part_1, modes=("sharded", "full", "flat", "dcp"), variants=strict)
    yield from grid("OPT-PART-1", FSDP1_HYBRID, part_1, modes=("dcp",), variants=strict)
    yield from grid("OPT-PART-3", FSDP1_FULL, part_3, modes=("sharded", "full", "flat", "dcp"))
    yield from grid("OPT-PART-3", FSDP1_FULL, part_3_resume, modes=("dcp", "full_cpu"), variants=fresh_warm)
    # A frozen parameter in a checkpoint taken before the first step.
    yield from grid("OPT-PART-3", ENDS, part_3_step0, modes=MODES, variants={"step0": {}})
    # Frozen after training, resumed.
    yield from grid(
        "OPT-PART-3",
        ONE_RANK | HALVED | QUARTERS,
        part_3_resume,
        modes=("dcp", "sharded", "full", "full_cpu", "bcast", "flat"),
        variants=fresh_warm,
    )
    yield from grid(
        "OPT-PART-4",
        DATA_PARALLEL | STAGES | SHARDED_STAGES | FSDP1_FULL,
        part_4,
        modes=("sharded", "full", "flat", "dcp"),
    )
    routers = {"shared": {"own_group": False}, "group": {"own_group": True}}
    yield from grid("OPT-PART-5", BASE, part_5, modes=("dcp",), variants=routers)
    for move in moves((QUARTERS, HALVED), (HALVED, HYBRID), (SHARDED_STAGES, STAGES)):
        for variant in reshard.ROUTERS:
            yield resharded_case("OPT-PART-5", move, "adamw", "dcp", lazy=variant)
    for layout, fqn, key in PART_6:
        yield make_case("OPT-PART-6", layout, part_6, mode="dcp", variant=f"no_{key}", fqn=fqn, key=key)
    for layout, fqn, key in PART_6:
        yield make_case("OPT-PART-6", layout, part_6, mode="dcp", variant=f"no_{key}-warm", fqn=fqn, key=key, warm=True)
    for layout, fqn, key, mode in PART_6_MEMORY:
        yield make_case("OPT-PART-6", layout, part_6, mode=mode, variant=f"no_{key}-warm", fqn=fqn, key=key, warm=True)


CLAUSES = {
    "OPT-PART-1": Clause(),
    "OPT-PART-2": Clause(),
    "OPT-PART-3": Clause(
        options=("ignore_frozen_params",),
        contains=lambda s: s.freeze_after,
        check=lambda s: (
            part_3_resume,
            {
                "layout": s.built_on,
                "mode": s.kind,
                "how": s.recipe(),
                "before": s.before,
                "after": s.after,
                "warm": s.warm,
            },
        ),
        rank=130,
    ),
    "OPT-PART-4": Clause(),
    "OPT-PART-5": Clause(),
    "OPT-PART-6": Clause(),
}
