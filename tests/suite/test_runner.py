"""The runner asks its Executor, never the launcher's name: deadlines, the
repro command and the run directory come from it (no ranks start here)."""

import os

from conformance.adapters import load_adapter
from conformance.running.registry import by_id
from conformance.running.runner import Runner
from hyperdsd.testing import Status, TaskOutcome
from hyperdsd.testing.messages import RankResult
from hyperdsd.testing.status import RankStatus

CASE = "OPT-RT-1[fsdp4-adamw-sharded]"


class RecordingExecutor:
    """An Executor whose ranks always pass, recording what it was asked to run."""

    launcher = "recording"
    repro_prefix = "launch-somehow -m conformance"
    exitfirst_refusal = ""
    reporter = True
    on_expiry = None

    def __init__(self, workdir):
        self.workdir = workdir
        self.runs = []

    def run_workdir(self, base, prefix):
        path = os.path.join(self.workdir, prefix + "run")
        os.makedirs(path, exist_ok=True)
        return path

    def unfit(self, world_sizes):
        return ""

    def run(self, world_size, task, deadline_s):
        self.runs.append((world_size, dict(task.kwargs), deadline_s))
        results = [RankResult(r, RankStatus.PASSED) for r in range(world_size)]
        return TaskOutcome(task, world_size, Status.PASSED, results, 0.0)

    def close(self):
        pass

    def kill(self):
        pass


def test_a_deadline_scale_multiplies_each_cases_own_deadline_and_reaches_the_ranks(tmp_path):
    case = by_id()[CASE]
    executor = RecordingExecutor(str(tmp_path))
    runner = Runner(load_adapter("hyperdsd"), executor, deadline_scale=2.5)
    result = runner.run_case(case)
    assert result.status == Status.PASSED
    assert [d for _, _, d in executor.runs] == [case.deadline_s * 2.5] * len(case.phases)
    assert [kw["deadline_s"] for _, kw, _ in executor.runs] == [case.deadline_s * 2.5] * len(case.phases)
    # The run directory is the executor's, and so is the repro command's launcher.
    assert runner.workdir == os.path.join(str(tmp_path), "conformance-run")
    assert result.repro.startswith("launch-somehow -m conformance --impl hyperdsd -k ")


def test_an_explicit_timeout_is_taken_as_given(tmp_path):
    executor = RecordingExecutor(str(tmp_path))
    runner = Runner(load_adapter("hyperdsd"), executor, timeout=7.0, deadline_scale=2.5)
    result = runner.run_case(by_id()[CASE])
    assert {d for _, _, d in executor.runs} == {7.0}
    assert result.repro.endswith("--timeout 7")


def test_a_workdir_that_does_not_exist_yet_is_made(tmp_path):
    from hyperdsd.testing import PoolSet

    base = tmp_path / "not" / "yet"
    with PoolSet() as pools:
        path = pools.run_workdir(str(base), "conformance-")
    assert os.path.isdir(path) and os.path.dirname(path) == str(base)
