"""The benchmark's breakdown of a key's time counts every hyperdsd module
in a named category: a module moved or added must be placed, not silently
counted as "other"."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import ROOT
from tools.benchmarks import bench_breakdown

REPO = Path(ROOT)

OTHER = "other (benchmark, Python)"


def test_every_hyperdsd_module_has_a_category():
    unplaced = []
    for path in sorted((REPO / "hyperdsd").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if any(rel.startswith(m) for m in bench_breakdown.NOT_ON_A_CALL):
            continue
        if bench_breakdown._category(str(path), "some_function") == OTHER:
            unplaced.append(rel)
    assert not unplaced, f"modules the breakdown counts as {OTHER!r}: {unplaced}"


def test_a_function_outside_hyperdsd_and_torch_is_other():
    assert bench_breakdown._category(str(Path("/x/tools/benchmarks/bench_tasks.py")), "_op") == OTHER
    assert bench_breakdown._category("/x/hyperdsd/state/in_place.py", "f") == "checks (validation)"
    assert bench_breakdown._category("/x/hyperdsd/transport/flat_shards.py", "f") == "FSDP1: twin, flat shards"
