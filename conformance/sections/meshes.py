"""SPEC §3 Meshes (OPT-MESH): parameters on meshes of their own, and models
on part of the world.

OPT-MESH-1 runs on the layouts that serve it (see layouts.KINDS): one
optimizer over dense layers sharded over the world and experts on an
``ep x dp`` mesh, FSDP-sharded experts, or a router replicated on
sub-meshes. OPT-MESH-2 runs two models on disjoint parts of the world, one
part at a time: while one part's ranks resume their model, the other part's
ranks wait outside any collective, so a call that waits for ranks outside
its model's mesh hangs there and misses the case's deadline.
"""

from __future__ import annotations

import os
import time

from ..kit import (
    MODES,
    Clause,
    Setup,
    check_get,
    check_loaded,
    diff_snapshots,
    fail_if,
    grid,
    move,
    resharded_case,
    resuming,
    serving,
    snapshot,
)

OPT = "adamw"
# Resharding to another ep x dp split, to plain FSDP, and from replicated
# sub-meshes to another world size. Named: layouts with experts or replicated
# sub-meshes of their own are outside the catalog, and each move is the case.
RESHARD = (move("fsdp4+ep2x2", "fsdp4+ep4x1"), move("fsdp4+ep2x2", "fsdp4+ep1"), move("fsdp4+rep2", "fsdp2+ep1"))
DEADLINE_S = 30.0
# How long the ranks of one part wait for the other's, at least: longer
# than the case's deadline, so that a hang is reported where it is (in the
# call under test on the other part), not as this wait giving up.
PART_WAIT_S = 120.0


def resume_checked(c, layout: str, mode: str):
    """Resume ``layout``'s model in ``mode``: what get returns and what set
    loads keep each tensor's own mesh and placements; the run continues
    bitwise like the uninterrupted one."""
    r = resuming.resume(
        c, resuming.recipe(layout, OPT), mode, on_saving=lambda s: check_get(c, s, mode), on_loaded=check_loaded
    )
    fail_if(
        diff_snapshots(r.expected, snapshot(r.resumed)),
        f"{mode}: after resuming on {layout}, the run differs from the uninterrupted one",
    )
    return r.resumed


def mesh_1(c, layout, mode):
    """One optimizer over parameters on different meshes round-trips."""
    resume_checked(c, layout, mode)


def mesh_2(c, layout, mode):
    """Each model resumes with only its own ranks calling, one part after the
    other, the part without rank 0 first."""
    Setup(c, layout, OPT, with_optimizer=False)  # every rank builds every part's mesh (a collective)
    spans = layout.spans
    for part in reversed(range(len(spans))):
        done = c.path(f"part{part}-done")
        if c.rank not in spans[part]:
            _wait_for(done, spans[part], max(PART_WAIT_S, 2 * c.deadline_s))
            continue
        try:
            resume_checked(c, layout, mode).barrier()
        finally:
            if c.rank == spans[part][0]:
                open(done, "w").close()


def _wait_for(path: str, ranks: tuple[int, ...], wait_s: float) -> None:
    """Outside any collective, until the ranks of another part are done."""
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks {list(ranks)} did not finish their model within {wait_s:g} s")
        time.sleep(0.01)


def cases():
    yield from grid("OPT-MESH-1", serving("OPT-MESH-1"), mesh_1, opts=(OPT,), modes=MODES)
    for moved in RESHARD:
        yield resharded_case("OPT-MESH-1", moved, OPT, "dcp")
    yield from grid("OPT-MESH-2", serving("OPT-MESH-2"), mesh_2, opts=(OPT,), modes=MODES, deadline_s=DEADLINE_S)


CLAUSES = {"OPT-MESH-1": Clause(), "OPT-MESH-2": Clause()}
