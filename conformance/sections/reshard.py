"""SPEC §3 Resharding (OPT-RESHARD): save on one layout, load on another.

Each case has two phases on two worlds. The first trains on layout A,
saves, trains on and writes the uninterrupted run's full state (every
rank's part, gathered) as the reference; the second loads on layout B,
trains as many steps and compares with the reference (tolerance 1e-6
relative: reductions over other numbers of ranks round differently; the
models are float64 so that only that rounding shows).

Parameters the checkpoint has no state for (``lazy``) must stay without
state in the never-stepped target (OPT-RESHARD-2, and OPT-PART-5's
resharded cases). The target's optimizer is built as a resuming job builds
it, with the same param groups as the source's: through DCP, nothing
relaxed, a template group the checkpoint lacks cannot load. So
OPT-RESHARD-2's source covers every parameter in its optimizer and freezes
those outside the layers (they never get state), rather than leaving them
out of its optimizer (which would leave a group out).
"""

from __future__ import annotations

from ..kit import (
    FSDP1_FLAT_PARAMS,
    FSDP1_FULL,
    FSDP1_HYBRID,
    HALVED,
    HYBRID,
    ONE_RANK,
    QUARTERS,
    SHARDED_STAGES,
    STAGES,
    THIRDS,
    Case,
    Clause,
    moves,
    one_group_if_flat,
    reshard,
    resharded_case,
)

PAIRS = moves(
    (QUARTERS, HALVED),  # to fewer ranks
    (HALVED, QUARTERS),  # to more, one of them with an empty piece
    (QUARTERS, THIRDS),  # to uneven pieces
    (HYBRID, HALVED),  # from a 2-D mesh to a 1-D one
    (QUARTERS, HYBRID),  # and back
    (HALVED, ONE_RANK),  # to one rank
    (ONE_RANK, QUARTERS),  # from one rank
    (SHARDED_STAGES, STAGES),  # pipeline stages, sharded to whole
)
# FSDP1 and FSDP2 through DCP, both ways (SPEC §2, 1.3).
FSDP1_PAIRS = moves(
    (FSDP1_FLAT_PARAMS, QUARTERS),
    (QUARTERS, FSDP1_FLAT_PARAMS),
    (QUARTERS, FSDP1_FULL),
    (FSDP1_FULL, HALVED),
    (HALVED, FSDP1_FULL),
)
# Parameters outside the optimizer's subset (lazy): to fewer ranks and more, to a 2-D mesh, to FSDP1.
LAZY_PAIRS = moves((QUARTERS, HALVED), (HALVED, QUARTERS), (ONE_RANK, HYBRID), (QUARTERS, FSDP1_FULL))
# A broadcast set of what another layout saved.
BCAST_PAIRS = moves(
    (QUARTERS, HALVED),
    (HALVED, HYBRID),
    (ONE_RANK, THIRDS),
    (QUARTERS, SHARDED_STAGES),
    (SHARDED_STAGES, QUARTERS),
    (HYBRID, ONE_RANK),
    (HALVED, FSDP1_FLAT_PARAMS),
    (FSDP1_FULL, FSDP1_HYBRID),
)


def cases():
    for move in PAIRS:
        for opt in ("adamw", "sgd"):
            yield resharded_case("OPT-RESHARD-1", move, opt, "dcp")
    for move in FSDP1_PAIRS:
        for opt in ("adamw", "sgd"):
            yield one_group_if_flat(resharded_case("OPT-RESHARD-1", move, opt, "dcp"))
    for move in LAZY_PAIRS:
        yield resharded_case("OPT-RESHARD-2", move, "adamw", "dcp", lazy="subset")
    # A parameter the checkpoint lists without state (lazy), loaded where a
    # rank holds an empty piece of it (four ranks: aux has 3 rows). SGD keeps no
    # step, so that rank's template entry has nothing it could tell written
    # from unwritten by: it must go by the other ranks.
    (to_more,) = moves((HALVED, QUARTERS))
    yield resharded_case("OPT-RESHARD-2", to_more, "sgd", "dcp", lazy="aux")
    for move in BCAST_PAIRS:
        yield one_group_if_flat(resharded_case("OPT-RESHARD-3", move, "adamw", "bcast"))


def _explored(s, clause: str, cid: str, source: str) -> Case:
    """Save on the scenario's layout, load on ``reshard_to``: this section's two phases."""
    move = s.move
    params = {"src": move.source, "dst": move.target, "opt": s.optimizer, "mode": s.kind}
    return reshard.two_phases(cid, clause, move, params | {"cfg": s.cfg(), "groups": s.groups()}, source)


CLAUSES = {
    "OPT-RESHARD-1": Clause(
        contains=lambda s: bool(s.reshard_to) and s.kind.through_dcp,
        build=lambda s, case_id, source: _explored(s, "OPT-RESHARD-1", case_id, source),
        rank=170,
    ),
    "OPT-RESHARD-2": Clause(),
    "OPT-RESHARD-3": Clause(
        contains=lambda s: bool(s.reshard_to) and s.kind.broadcast,
        build=lambda s, case_id, source: _explored(s, "OPT-RESHARD-3", case_id, source),
        rank=180,
    ),
}
