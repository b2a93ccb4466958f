"""SPEC §3 Purity (OPT-PURE): get changes nothing."""

from __future__ import annotations

import torch

from ..kit import (
    BASE,
    ENDS,
    FSDP1,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
    HYBRID,
    SHARDED_STAGES,
    Clause,
    batch,
    diff_snapshots,
    diff_values,
    expect_unchanged,
    fail_if,
    get_options,
    grads_view,
    grid,
    loss_fn,
    make_case,
    optimizer_view,
    optimizers_arg,
    resuming,
    snapshot,
)

OPTS = ("adamw", "adam_amsgrad", "sgd", "sgd_plain", "adagrad")


def _accumulate(s) -> None:
    """A forward and backward without a step: gradients present, optimizer fresh."""
    tokens, targets = (t.to(s.device) for t in batch(0, 0, s.cfg))
    rank, degree = s.dp
    rows = tokens.shape[0] // degree
    loss_fn(s.model(tokens[rank * rows : (rank + 1) * rows]), targets[rank * rows : (rank + 1) * rows]).backward()


def _get_changes_nothing(c, s, mode):
    before, grads = optimizer_view(s), grads_view(s)
    c.iut.get_optimizer_state_dict(s.model, optimizers_arg(s), options=get_options(c.iut, mode))
    expect_unchanged(before, optimizer_view(s), f"get ({mode}) changed the optimizer or the parameters")
    fail_if(diff_values(grads, grads_view(s), "grad"), f"get ({mode}) changed the gradients")


def pure_1(c, layout, opt, mode, grads, how=None):
    """Never stepped: get leaves it so, and training afterwards is unaffected.
    ``how``: the recipe to build (a generated scenario's), instead of the base model with ``opt``."""
    how = how or resuming.recipe(layout, opt)
    a = how.build(c, 0)
    if grads:
        _accumulate(a)
    _get_changes_nothing(c, a, mode)
    _zero_grad(a)
    a.train(2)
    # The same run without the get (kept per rank: no implementation touched it).
    b = resuming.kept_run(c, how, 2, prepare=_accumulate_then_zero if grads else None)
    fail_if(diff_snapshots(b, snapshot(a)), "training after get differs from training without it")


def _zero_grad(s) -> None:
    for o in s.optimizers:
        o.zero_grad(set_to_none=True)


def _accumulate_then_zero(s) -> None:
    _accumulate(s)
    _zero_grad(s)


def pure_2(c, layout, opt, mode, how=None):
    """After steps: get changes nothing, and changing what it returned does not reach the optimizer."""
    how = how or resuming.recipe(layout, opt)
    a = how.build(c, 0)
    a.train(2)
    _get_changes_nothing(c, a, mode)
    osd = c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, mode))
    before = optimizer_view(a)
    _vandalise(osd)
    expect_unchanged(before, optimizer_view(a), "changing the returned dict changed the optimizer")
    a.train(1)
    b = resuming.kept_run(c, how, 3)  # the same run without the gets
    fail_if(diff_snapshots(b, snapshot(a)), "training after get differs from training without it")


def _vandalise(osd) -> None:
    """Pop, replace and clear everything in the returned containers."""
    if "state" in osd:
        for entry in list(osd["state"].values()):
            _clear_nested(entry)
            for key in list(entry):
                entry[key] = torch.zeros(1) if isinstance(entry[key], torch.Tensor) else -1
            entry.clear()
        osd["state"].clear()
        for group in osd["param_groups"]:
            group["lr"] = 123.0
            group["params"].clear()
            group.pop("weight_decay", None)
        osd["param_groups"].clear()
    else:
        for key in list(osd):
            osd[key] = None
        osd.clear()


def _clear_nested(entry: dict) -> None:
    """Empty the containers nested in a state entry (custom optimizers keep dicts and lists)."""
    for value in entry.values():
        if isinstance(value, dict):
            _clear_nested(value)
        if isinstance(value, (dict, list)):
            value.clear()


# OPT-PURE-1 runs every optimizer on these, AdamW alone on the other layouts.
EVERY_OPT = ENDS | HYBRID | SHARDED_STAGES


def cases():
    for layout in BASE:
        for opt in OPTS if layout in EVERY_OPT else ("adamw",):
            yield make_case("OPT-PURE-1", layout, pure_1, opt=opt, mode="sharded", variant="fresh", grads=False)
            if layout.pp == 1:  # stages accumulate gradients only inside a schedule step
                yield make_case("OPT-PURE-1", layout, pure_1, opt=opt, mode="sharded", variant="grads", grads=True)
    yield from grid("OPT-PURE-2", BASE, pure_2, opts=("adamw",), modes=("sharded", "flat"))
    yield from grid("OPT-PURE-2", FSDP1, pure_2, opts=("adamw",), modes=("sharded", "flat"))  # FSDP1 (SPEC §2, 1.3)
    yield make_case("OPT-PURE-2", FSDP1_FULL.one(), pure_2, opt="adamw", mode="full_cpu")
    # Nested state (dicts and lists) must be copies too.
    yield from grid("OPT-PURE-2", ENDS, pure_2, opts=("custom",), modes=("sharded",))
    # The same clauses for an implementation whose get only gathers to rank 0 (SPEC §1:
    # get-side clauses run with any declared get mode).
    for layout in ENDS:
        yield make_case("OPT-PURE-1", layout, pure_1, opt="adamw", mode="full_cpu", variant="fresh", grads=False)
        yield make_case("OPT-PURE-2", layout, pure_2, opt="adamw", mode="full_cpu")
    # FSDP1 (SPEC §2, 1.3)
    fresh_and_grads = {"fresh": {"grads": False}, "grads": {"grads": True}}
    yield from grid(
        "OPT-PURE-1", FSDP1_FULL_SHARD, pure_1, opts=("adamw",), modes=("sharded",), variants=fresh_and_grads
    )
    for layout in BASE | FSDP1_FULL_SHARD:
        for mode in ("full", "full_cpu", "flat"):
            yield make_case("OPT-PURE-3", layout, pure_1, opt="adamw", mode=mode, variant="fresh", grads=False)
            yield make_case("OPT-PURE-3", layout, pure_2, opt="adamw", mode=mode, variant="stepped")


# get changes nothing: on a never-stepped optimizer (before=0) OPT-PURE-1, or
# OPT-PURE-3 in the full and flat layouts; after steps, OPT-PURE-2.
CLAUSES = {
    "OPT-PURE-1": Clause(
        side="get",
        contains=lambda s: not s.before and s.kind.gets_shards,
        check=lambda s: (pure_1, s.trained_args(grads=False)),
        rank=100,
    ),
    "OPT-PURE-2": Clause(
        side="get", contains=lambda s: bool(s.before), check=lambda s: (pure_2, s.trained_args()), rank=110
    ),
    "OPT-PURE-3": Clause(
        side="get",
        contains=lambda s: not s.before and not s.kind.gets_shards,
        check=lambda s: (pure_1, s.trained_args(grads=False)),
        rank=120,
    ),
}
