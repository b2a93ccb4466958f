"""SPEC §3 Pipeline and MPMD (OPT-MPMD): each rank holds other parameters."""

from __future__ import annotations

import torch.distributed as dist

from ..kit import (
    ENDS,
    SHARDED_STAGES,
    STAGES,
    Clause,
    GroupSpec,
    Layout,
    Setup,
    check,
    clone_tree,
    diff_snapshots,
    diff_values,
    fail_if,
    get_options,
    grid,
    optimizers_arg,
    resuming,
    saving,
    set_options,
    snapshot,
    without_empty_groups,
)

OPTS = ("adamw", "adam_amsgrad", "sgd", "sgd_plain", "adagrad")


def mpmd_1(c, layout, opt):
    """Flat keys each belong to one of the rank's parameters; stages' keys are disjoint; DCP round trip."""
    a = Setup(c, layout, opt)
    a.train(2)
    flat = c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, "flat"))
    mine = {fqn for fqn, _ in a.named_parameters()}
    stray = []
    for key in flat:
        head, _, rest = str(key).partition(".")
        if head not in ("state", "param_groups") or not any(rest.startswith(f + ".") for f in mine):
            stray.append(key)
    fail_if(stray, "flat keys that belong to none of this rank's parameters")
    keysets = [None] * dist.get_world_size()
    dist.all_gather_object(keysets, (a.stage, sorted(map(str, flat))))
    for r, (stage, keys) in enumerate(keysets):
        for r2, (stage2, keys2) in enumerate(keysets):
            if stage < stage2:
                common = set(keys) & set(keys2)
                check(
                    not common,
                    f"stages {stage} (rank {r}) and {stage2} (rank {r2}) share flat keys: {sorted(common)[:5]}",
                )
    saved = saving.save(c, a, "dcp")
    want = snapshot(a)
    b = Setup(c, layout, opt, seed=1)
    b.set_steps_done(2)
    saving.load(c, b, saved)
    fail_if(diff_snapshots(want, snapshot(b)), "after a DCP round trip of the flat dicts, a rank's optimizer differs")
    a.train(1)
    b.train(1)
    fail_if(diff_snapshots(snapshot(a), snapshot(b)), "training after the DCP round trip differs")


def mpmd_2(c, layout, opt, empty_on_last):
    """Stages with different group layouts (number of groups, hyperparameters) round-trip."""

    # pipeline stages hold different parameters, so their groups differ in number already;
    # each stage also gets its own learning rates, and optionally an empty group of its own.
    def spec(stage):
        return GroupSpec(scale=1.0 + stage, empty_at=(9,) if empty_on_last and stage else ())

    stage = _stage(c, layout)
    r = resuming.resume(c, resuming.recipe(layout, opt, groups=spec(stage)), "dcp")
    # Stages go through DCP in the flat layout: an empty group keeps its own values (OPT-EMPTY-2).
    fail_if(
        diff_snapshots(without_empty_groups(r.expected), without_empty_groups(snapshot(r.resumed))),
        "stages with their own group layouts did not resume like the uninterrupted run",
    )


def _stage(c, layout: Layout) -> int:
    return c.mesh(layout.mesh, layout.dim_names).get_coordinate()[0]


def mpmd_3(c, layout, opt):
    """flat -> nested -> flat through set and get, given the model: nothing lost."""
    a = Setup(c, layout, opt)
    a.train(2)
    flat = clone_tree(c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, "flat")))
    b = Setup(c, layout, opt, seed=1)
    c.iut.set_optimizer_state_dict(b.model, optimizers_arg(b), clone_tree(flat), options=set_options(c.iut, "flat"))
    nested = clone_tree(c.iut.get_optimizer_state_dict(b.model, optimizers_arg(b)))
    d = Setup(c, layout, opt, seed=2)
    c.iut.set_optimizer_state_dict(d.model, optimizers_arg(d), nested)
    again = c.iut.get_optimizer_state_dict(d.model, optimizers_arg(d), options=get_options(c.iut, "flat"))
    fail_if(diff_values(flat, again, "flat"), "flat -> nested -> flat lost or changed entries")


def cases():
    empty_group = {"lr": {"empty_on_last": False}, "empty_group": {"empty_on_last": True}}
    for layout in STAGES | SHARDED_STAGES:
        yield from grid("OPT-MPMD-1", (layout,), mpmd_1, opts=OPTS, modes=("flat",))
        yield from grid("OPT-MPMD-2", (layout,), mpmd_2, opts=("adamw", "sgd"), modes=("flat",), variants=empty_group)
    yield from grid("OPT-MPMD-3", ENDS | STAGES | SHARDED_STAGES, mpmd_3, opts=("adamw", "sgd"), modes=("flat",))


CLAUSES = {"OPT-MPMD-1": Clause(), "OPT-MPMD-2": Clause(), "OPT-MPMD-3": Clause()}
