"""The benchmark's breakdown of a key's time counts every hyperdsd module
in a named category: a module moved or added must be placed, not silently
counted as "other"."""

from __future__ import annotations

from pathlib import Path

import torch

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
    assert bench_breakdown._category("/x/hyperdsd/state/loading/in_place.py", "f") == "checks (validation)"
    assert bench_breakdown._category("/x/hyperdsd/fsdp1/unit_moves.py", "f") == "FSDP1: twin, flat parameters"


def test_every_phase_names_a_function_that_exists():
    """A phase whose function was renamed or moved would be timed nowhere."""
    import importlib

    for name, where in bench_breakdown.PHASES:
        for module_name, path in where:
            owner = importlib.import_module(module_name)
            for part in path.split("."):
                owner = getattr(owner, part, None)
                assert owner is not None, (name, module_name, path)
            assert callable(owner), (name, module_name, path)


def test_phases_are_timed_and_put_back():
    import hyperdsd.state.model as model_state
    from hyperdsd.state.keys.fqn import ModelIndex

    before = model_state.plan_load, ModelIndex.__dict__["of"]
    spent: dict[str, float] = {}
    with bench_breakdown._timed_phases(spent):
        assert model_state.plan_load is not before[0]
        ModelIndex.of(torch.nn.Linear(2, 2))
    assert (model_state.plan_load, ModelIndex.__dict__["of"]) == before
    assert set(spent) == {"the index (kept from the last call)"} and spent["the index (kept from the last call)"] >= 0
