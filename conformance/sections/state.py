"""SPEC §3 State values (OPT-STATE): per-parameter state beyond tensors
shaped like the parameter, as custom optimizers keep it (see world/optimizers.py)."""

from __future__ import annotations

from ..kit import (
    BASE,
    ENDS,
    FSDP1_FLAT_PARAMS,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
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
    ModelConfig,
    check_get,
    check_loaded,
    diff_snapshots,
    fail_if,
    grid,
    make_case,
    moves,
    one_group_if_flat,
    resharded_case,
    resuming,
    snapshot,
)

OPT = "custom"


def state_1(c, layout, mode, lazy=False):
    """Resume with the custom optimizer; what get returns is laid out as the
    clause says, and so is what set loads. ``lazy``: a parameter never gets a
    gradient, so a never-stepped target's template holds nested placeholders
    for state the checkpoint does not have; it must stay without state."""
    how = resuming.recipe(layout, OPT, cfg=ModelConfig(lazy_aux=True)) if lazy else resuming.recipe(layout, OPT)
    r = resuming.resume(c, how, mode, on_saving=lambda s: check_get(c, s, mode), on_loaded=check_loaded)
    fail_if(
        diff_snapshots(r.expected, snapshot(r.resumed)),
        f"{mode}: after resuming, the custom optimizer's run differs from the uninterrupted one",
    )


# Every mode on the layouts that differ most in how state is laid out
# (unsharded, uneven shards, 2-D, pipeline stages); the others in the modes
# that take each path once (in memory, through rank 0, through DCP).
EVERY_MODE = ONE_RANK | THIRDS | HYBRID | SHARDED_STAGES
SOME_MODES = ("sharded", "bcast", "dcp")


def cases():
    for layout in BASE:
        for mode in MODES if layout in EVERY_MODE else SOME_MODES:
            yield make_case("OPT-STATE-1", layout, state_1, opt=OPT, mode=mode)
    # Lazy state through DCP (fsdp4: a rank holds an empty shard of aux; pipelines go flat).
    yield from grid(
        "OPT-STATE-1", ENDS | SHARDED_STAGES, state_1, opts=(OPT,), modes=("dcp",), variants={"lazy": {"lazy": True}}
    )
    for move in moves((QUARTERS, THIRDS), (HYBRID, HALVED), (SHARDED_STAGES, STAGES)):
        yield one_group_if_flat(resharded_case("OPT-STATE-1", move, OPT, "dcp"))
    # FSDP1 (SPEC §2, 1.3): state unflattened from flat shards, nested state included; to FSDP2 and back.
    yield from grid("OPT-STATE-1", FSDP1_FULL_SHARD, state_1, opts=(OPT,), modes=MODES)
    yield from grid("OPT-STATE-1", FSDP1_HYBRID, state_1, opts=(OPT,), modes=SOME_MODES)
    for move in moves((FSDP1_FLAT_PARAMS, QUARTERS), (HALVED, FSDP1_FULL)):
        yield one_group_if_flat(resharded_case("OPT-STATE-1", move, OPT, "dcp"))


CLAUSES = {"OPT-STATE-1": Clause()}
