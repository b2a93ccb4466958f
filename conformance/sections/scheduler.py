"""SPEC §3 Param-group fields and schedulers (OPT-SCHED).

Through DCP the target's own state dict is the load template, and DCP reads
only the keys the template has. So in the ``dcp`` mode the target is built
as a resuming job builds it (its scheduler and custom fields exist, with
other values) and every field must take the checkpoint's value; a field the
target lacks altogether (OPT-SCHED-3) cannot be read through a template by
any implementation, and is checked in the other modes.
"""

from __future__ import annotations

from ..kit import (
    DATA_PARALLEL,
    ENDS,
    FSDP1_FULL_SHARD,
    HYBRID,
    MODES,
    SHARDED_STAGES,
    STAGES,
    Clause,
    GroupSpec,
    Setup,
    check,
    diff_snapshots,
    diff_values,
    fail_if,
    grid,
    saving,
    snapshot,
)


def _fields(snap) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in snap["groups"]]


def sched_1(c, layout, mode):
    """initial_lr and every other field come back, each group its own."""
    a = Setup(c, layout, "adamw", scheduler=True, groups=GroupSpec(extra=(("tag", "source"),)))
    a.train(2)
    want = snapshot(a)
    check(all("initial_lr" in g for g in want["groups"]), "setup error: no initial_lr")
    saved = saving.save(c, a, mode)
    if mode.through_dcp:  # as a resuming job builds it: the fields exist, with other values
        b = Setup(c, layout, "adamw", seed=1, scheduler=True, groups=GroupSpec(scale=0.5, extra=(("tag", "target"),)))
        b.train(1)
    else:  # no scheduler yet (no initial_lr), no custom field
        b = Setup(c, layout, "adamw", seed=1)
    saving.load(c, b, saved)
    fail_if(
        diff_values(_fields(want), _fields(snapshot(b)), "param_groups"),
        f"{mode}: param-group fields did not round-trip",
    )


def sched_2(c, layout, mode, n_optimizers=1, opt="adamw", cfg=None):
    """A scheduler resumed from its state_dict plus the loaded optimizer repeats the lr sequence.
    ``opt``, ``cfg``: another optimizer and model (a generated scenario's)."""
    a = Setup(c, layout, opt, scheduler=True, n_optimizers=n_optimizers, cfg=cfg)
    a.train(2)
    saved = saving.save(c, a, mode)
    sched_states = [s.state_dict() for s in a.schedulers]
    lrs_a = []
    for _ in range(3):
        a.train(1)
        lrs_a.append([g["lr"] for o in a.optimizers for g in o.param_groups])
    b = Setup(c, layout, opt, seed=1, scheduler=True, n_optimizers=n_optimizers, cfg=cfg)
    b.set_steps_done(2)
    saving.load(c, b, saved)
    for sched, st in zip(b.schedulers, sched_states):
        sched.load_state_dict(st)
    lrs_b = []
    for _ in range(3):
        b.train(1)
        lrs_b.append([g["lr"] for o in b.optimizers for g in o.param_groups])
    fail_if(diff_values(lrs_a, lrs_b, "lr by step"), f"{mode}: the resumed scheduler gives other learning rates")
    fail_if(diff_snapshots(snapshot(a), snapshot(b)), f"{mode}: the resumed run differs from the uninterrupted one")


def sched_3(c, layout, mode):
    """A field only the checkpoint has is restored; one it lacks keeps the target's value."""
    a = Setup(c, layout, "adamw", groups=GroupSpec(extra=(("from_checkpoint", 7),)))
    a.train(1)
    saved = saving.save(c, a, mode)
    b = Setup(c, layout, "adamw", seed=1, groups=GroupSpec(extra=(("target_only", "kept"),)))
    saving.load(c, b, saved)
    problems = []
    for i, g in enumerate(snapshot(b)["groups"]):
        if g.get("from_checkpoint") != 7:
            problems.append(
                f"groups[{i}]['from_checkpoint'] = {g.get('from_checkpoint')!r}, expected 7 (from the checkpoint)"
            )
        if g.get("target_only") != "kept":
            problems.append(
                f"groups[{i}]['target_only'] = {g.get('target_only')!r}, expected 'kept' (the checkpoint lacks it)"
            )
    fail_if(problems, f"{mode}: group fields were not merged")


def cases():
    yield from grid(
        "OPT-SCHED-1",
        DATA_PARALLEL | STAGES | SHARDED_STAGES | FSDP1_FULL_SHARD,
        sched_1,
        opts=("adamw",),
        modes=MODES,
    )
    yield from grid(
        "OPT-SCHED-2",
        ENDS | HYBRID | SHARDED_STAGES | FSDP1_FULL_SHARD,
        sched_2,
        opts=("adamw",),
        modes=("sharded", "full_cpu", "flat", "dcp"),
    )
    yield from grid(
        "OPT-SCHED-2",
        ENDS | SHARDED_STAGES,
        sched_2,
        opts=("adamw",),
        modes=("sharded", "bcast", "flat"),
        variants={"2opt": {"n_optimizers": 2}},
        profile="multi-optimizer",
    )
    yield from grid(
        "OPT-SCHED-3",
        ENDS | STAGES | FSDP1_FULL_SHARD,
        sched_3,
        opts=("adamw",),
        modes=("sharded", "full", "bcast", "flat"),
    )


CLAUSES = {
    "OPT-SCHED-1": Clause(),
    "OPT-SCHED-2": Clause(
        contains=lambda s: s.scheduler,
        check=lambda s: (sched_2, {"layout": s.built_on, "mode": s.kind, "opt": s.optimizer, "cfg": s.cfg()}),
        rank=50,
    ),
    "OPT-SCHED-3": Clause(),
}
