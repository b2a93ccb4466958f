"""SPEC §3 Empty param groups (OPT-EMPTY)."""

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
    diff_values,
    fail_if,
    grid,
    resuming,
    saving,
    snapshot,
)

EMPTY_AT = (0, 2, 9)  # first, in the middle, last


def _groups_without_params(snap) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in snap["groups"]]


def empty_1(c, layout, opt, mode, n_optimizers=1, empty_at=EMPTY_AT, cfg=None, split=True):
    """Groups without parameters, anywhere, survive: count, order, every field; step() works.
    ``empty_at``, ``cfg``, ``split``: where the empty groups go, the model, and
    whether its parameters are split by role (a generated scenario's)."""
    spec = GroupSpec(empty_at=empty_at, split=split)
    model = {"cfg": cfg} if cfg is not None else {}
    kept = resuming.trained_source(c, resuming.recipe(layout, opt, groups=spec, n_optimizers=n_optimizers, **model), 2)
    saved = kept.save(c, mode)
    want = snapshot(kept.setup)
    # The target's empty groups carry values of their own, so that a load
    # that ignores them shows.
    target_groups = GroupSpec(empty_at=empty_at, split=split, scale=3.0)
    b = Setup(c, layout, opt, seed=1, groups=target_groups, n_optimizers=n_optimizers, cfg=cfg)
    b.set_steps_done(2)
    own = snapshot(b)
    saving.load(c, b, saved)
    got = snapshot(b)
    check(
        len(got["groups"]) == len(want["groups"]),
        f"{len(got['groups'])} groups after loading, expected {len(want['groups'])}",
    )
    problems = []
    for i, (w, g, o) in enumerate(zip(want["groups"], got["groups"], own["groups"])):
        missing = sorted(set(w) - set(g))
        if missing:
            problems.append(f"groups[{i}] lacks {missing}")
        if w["params"] != g["params"]:
            problems.append(f"groups[{i}]['params'] = {g['params']}, expected {w['params']} (order of groups changed)")
        # In the flat layout an empty group has no FQN to travel with: it keeps its own values (OPT-EMPTY-2).
        expected = o if not w["params"] and not saving.effective(mode, b).carries_empty_groups else w
        problems += diff_values(
            {k: v for k, v in expected.items() if k != "params"},
            {k: v for k, v in g.items() if k != "params"},
            f"groups[{i}]",
        )
    fail_if(problems, f"{mode}: param groups without parameters did not survive")
    b.train(1)  # step() must work with the loaded groups


def empty_2(c, layout, opt, target_empty):
    """Flat layout: the target's empty groups keep their values, whatever their number; nothing raises."""
    a = Setup(c, layout, opt, groups=GroupSpec(empty_at=(0, 9)))
    a.train(2)
    saved = saving.save(c, a, "flat")
    b = Setup(c, layout, opt, seed=1, groups=GroupSpec(empty_at=target_empty, scale=3.0))
    own = snapshot(b)
    saving.load(c, b, saved)
    got = snapshot(b)
    empties = [(i, g) for i, g in enumerate(own["groups"]) if not g["params"]]
    problems = diff_values([g for _, g in empties], [got["groups"][i] for i, _ in empties], "empty groups")
    fail_if(problems, "flat: the target's empty groups did not keep their own values")
    b.train(1)


def cases():
    yield from grid("OPT-EMPTY-1", DATA_PARALLEL | STAGES | SHARDED_STAGES, empty_1, opts=("adamw", "sgd"), modes=MODES)
    # FSDP1 (SPEC §2, 1.3)
    yield from grid("OPT-EMPTY-1", FSDP1_FULL_SHARD, empty_1, opts=("adamw",), modes=MODES)
    yield from grid(
        "OPT-EMPTY-1",
        ENDS,
        empty_1,
        opts=("adamw",),
        modes=("sharded", "full_cpu", "dcp"),
        variants={"2opt": {"n_optimizers": 2}},
        profile="multi-optimizer",
    )
    targets = {"same": {"target_empty": (0, 9)}, "more": {"target_empty": (1, 2, 9)}, "none": {"target_empty": ()}}
    yield from grid(
        "OPT-EMPTY-2",
        ENDS | HYBRID | SHARDED_STAGES | FSDP1_FULL_SHARD,
        empty_2,
        opts=("adamw",),
        modes=("flat",),
        variants=targets,
    )


CLAUSES = {
    "OPT-EMPTY-1": Clause(
        contains=lambda s: bool(s.empty_at),
        check=lambda s: (
            empty_1,
            {
                "layout": s.built_on,
                "opt": s.optimizer,
                "mode": s.kind,
                "empty_at": s.empty_at,
                "cfg": s.cfg(),
                "split": not s.one_group,
            },
        ),
        rank=40,
    ),
    "OPT-EMPTY-2": Clause(),
}
