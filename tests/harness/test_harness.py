"""The harness itself: every rank judged, deadlines kept, no process left behind."""

import os
import signal
import subprocess
import sys
import time
import uuid

import harness_tasks
import pytest
from helpers import ROOT, TESTS, descendant_ranks, is_multiprocessing_helper, marked_processes, scaled, wait_for

from hyperdsd.testing import REGIONS, PoolSet, Task, parse_mesh

# Limits a task must meet, scaled to the machine: a task's deadline, how long
# ranks released by a failed one may take to answer (grace), gloo's timeout.
DEADLINE = scaled(8)
SHORT_DEADLINE = scaled(4)  # waited out by the hang tests
GLOO_TIMEOUT = scaled(5)
GRACE = scaled(2)
# Waits on an event (a process is gone): only a hang reaches these.
EVENT_LIMIT_S = scaled(60)
MARK = uuid.uuid4().hex


@pytest.fixture(scope="module")
def pools():
    os.environ["HYPERDSD_TEST_MARK"] = MARK  # inherited by every rank
    ps = PoolSet(gloo_timeout_s=GLOO_TIMEOUT, grace_s=GRACE)
    yield ps
    ps.kill()
    # The fork server started with this mark lives as long as this process.
    assert [p for p in marked_processes(MARK) if not is_multiprocessing_helper(p)] == [], (
        "rank processes survived PoolSet.kill()"
    )
    assert descendant_ranks() == [], "rank processes survived PoolSet.kill()"


def run(pools, fn, world_size=4, deadline=DEADLINE, scope="task", **kwargs):
    start = time.monotonic()
    outcome = pools.run(world_size, Task(fn, kwargs, scope=scope), deadline)
    return outcome, time.monotonic() - start


def by_rank(outcome):
    return {r.rank: r for r in outcome.results}


def test_every_rank_reports(pools):
    outcome, _ = run(pools, harness_tasks.all_reduce_rank)
    assert outcome.status == "passed"
    assert outcome.values == [6.0] * 4


def test_pool_is_reused_between_tasks(pools):
    run(pools, harness_tasks.noop)
    pids = pools.pool(4).pids
    outcome, _ = run(pools, harness_tasks.noop)
    assert outcome.values == [0, 1, 2, 3]
    assert pools.pool(4).pids == pids


@pytest.mark.parametrize("spawn", [False, True])
def test_ranks_are_forked_from_the_fork_server_or_spawned_when_asked(monkeypatch, spawn):
    if spawn:
        monkeypatch.setenv("HYPERDSD_SPAWN_RANKS", "1")
    with PoolSet(gloo_timeout_s=GLOO_TIMEOUT) as ps:
        outcome = ps.run(2, Task(harness_tasks.parent_and_sum, {}), DEADLINE)
        assert outcome.status == "passed", outcome.describe()
        parents = {parent for parent, _ in outcome.values}
        assert [total for _, total in outcome.values] == [1.0, 1.0]
        if spawn:
            assert parents == {os.getpid()}  # fresh interpreters, started by this process
        else:
            assert len(parents) == 1 and os.getpid() not in parents  # all forked by one server


def assert_recovers(pools, old_pids):
    """The next task runs on a fresh pool, and the old ranks are gone."""
    outcome, _ = run(pools, harness_tasks.all_reduce_rank)
    assert outcome.status == "passed", outcome.describe()
    assert not set(pools.pool(4).pids) & set(old_pids), "the next task must run on a fresh pool"
    for pid in old_pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] == "Z"


def assert_regrouped(pools, outcome, old_pids):
    """The same ranks formed new process groups, and the next task runs on them."""
    assert outcome.regrouped and not outcome.recycled, (outcome.regrouped, outcome.recycled)
    again, _ = run(pools, harness_tasks.all_reduce_rank)
    assert again.status == "passed" and again.values == [6.0] * 4, again.describe()
    assert pools.pool(4).pids == old_pids, "the pool must be kept"


def test_rank_hanging_in_collective(pools):
    run(pools, harness_tasks.noop)
    _ = pools.pool(4).pids
    outcome, took = run(pools, harness_tasks.hang_in_collective, rank=1)
    assert outcome.status == "failed"
    assert by_rank(outcome)[1].status in ("raised", "timeout")
    assert took <= DEADLINE + EVENT_LIMIT_S
    assert "rank 1" in outcome.describe()
    assert outcome.recycled or outcome.regrouped
    again, _ = run(pools, harness_tasks.all_reduce_rank)
    assert again.status == "passed", again.describe()


def test_rank_missing_deadline_gets_stacks(pools):
    run(pools, harness_tasks.noop)
    old = pools.pool(4).pids
    outcome, took = run(pools, harness_tasks.sleep_forever, rank=1, deadline=SHORT_DEADLINE)
    assert outcome.status == "failed"  # the whole task is under test: its hang is its verdict
    r1 = by_rank(outcome)[1]
    assert r1.status in ("timeout", "stuck")
    assert "sleep_forever" in r1.stacks, r1.stacks
    assert took <= SHORT_DEADLINE + EVENT_LIMIT_S
    assert_recovers(pools, old)


def test_nonzero_rank_exit_code(pools):
    run(pools, harness_tasks.noop)
    old = pools.pool(4).pids
    outcome, took = run(pools, harness_tasks.exit_code, rank=2, code=3)
    assert outcome.status == "failed"
    r2 = by_rank(outcome)[2]
    assert r2.status == "died" and "exited with code 3" in r2.message
    assert outcome.describe().startswith("rank 2 died")
    assert took <= DEADLINE + EVENT_LIMIT_S
    assert_recovers(pools, old)


def test_nonzero_rank_sigkill(pools):
    run(pools, harness_tasks.noop)
    old = pools.pool(4).pids
    outcome, took = run(pools, harness_tasks.sigkill, rank=3)
    assert outcome.status == "failed"
    r3 = by_rank(outcome)[3]
    assert r3.status == "died" and "SIGKILL" in r3.message
    assert took <= DEADLINE + EVENT_LIMIT_S
    assert_recovers(pools, old)


def test_rank_raises_while_others_wait(pools):
    run(pools, harness_tasks.noop)
    old = pools.pool(4).pids
    outcome, took = run(pools, harness_tasks.raise_while_others_wait, rank=1)
    assert outcome.status == "failed"
    r = by_rank(outcome)
    assert r[1].status == "raised" and r[1].exc_type == "ValueError" and "rank 1" in r[1].message
    assert "Traceback" in r[1].traceback
    for other in (0, 2, 3):
        # Released when rank 1 left the group, not after a timeout: the
        # traceback shows where each was blocked.
        assert r[other].status == "stuck", r[other]
        assert "until rank 1 left" in r[other].message and "barrier" in r[other].traceback
    assert took <= DEADLINE + EVENT_LIMIT_S
    assert_regrouped(pools, outcome, old)


def test_a_failed_rank_releases_the_others_even_when_torch_keeps_its_groups(pools):
    # Once FSDP's modules are imported, a destroyed process group is kept
    # alive by torch; leaving must still close its connections.
    run(pools, harness_tasks.noop)
    old = pools.pool(4).pids
    outcome, _ = run(pools, harness_tasks.raise_after_importing_fsdp, rank=1)
    assert outcome.status == "failed"
    assert [r.status for r in outcome.results] == ["stuck", "raised", "stuck", "stuck"], outcome.describe()
    assert_regrouped(pools, outcome, old)


def test_regions_tell_the_code_under_test_from_the_task(pools):
    outcome, _ = run(pools, harness_tasks.fail_in_region, scope=REGIONS, rank=1, label="set_optimizer_state_dict")
    assert outcome.status == "failed"
    lines = outcome.describe().splitlines()
    assert lines[0] == "rank 1 raised ValueError in set_optimizer_state_dict: the code under test fails", lines
    assert (
        lines[1]
        == "ranks 0,2,3 blocked in a collective until rank 1 left the process group in set_optimizer_state_dict"
    ), lines
    outcome, _ = run(pools, harness_tasks.fail_outside_region, scope=REGIONS)
    assert outcome.status == "error", outcome.describe()
    assert all(r.region == "" for r in outcome.results)
    outcome, _ = run(pools, harness_tasks.check_fails_outside_region, scope=REGIONS)
    assert outcome.status == "failed", outcome.describe()  # a failed check is a verdict
    outcome, _ = run(pools, harness_tasks.fail_outside_region)  # the whole task under test
    assert outcome.status == "failed"


def test_a_hang_inside_the_code_under_test_is_a_failure_naming_where(pools):
    outcome, _ = run(
        pools,
        harness_tasks.hang_in_region,
        scope=REGIONS,
        deadline=SHORT_DEADLINE,
        rank=1,
        label="get_optimizer_state_dict",
    )
    assert outcome.status == "failed", outcome.describe()
    r1 = by_rank(outcome)[1]
    assert r1.status in ("timeout", "stuck") and r1.region == "get_optimizer_state_dict"
    assert (
        "rank 1 still running in get_optimizer_state_dict" in outcome.describe()
        or "in get_optimizer_state_dict" in outcome.describe()
    )


def test_out_of_step_groups_recycle_the_pool(pools):
    run(pools, harness_tasks.noop)
    old = pools.pool(4).pids
    outcome, _ = run(pools, harness_tasks.mismatched_count)
    assert outcome.status == "failed"
    assert "out of step" in outcome.regrouped or outcome.regrouped.startswith("ranks left")
    assert_regrouped(pools, outcome, old)


def test_not_applicable(pools):
    outcome, _ = run(pools, harness_tasks.not_applicable)
    assert outcome.status == "n/a"


def test_two_dim_mesh(pools):
    outcome, _ = run(pools, harness_tasks.mesh_sum, spec="2x2", dim="shard")
    assert outcome.status == "passed" and outcome.values == [2.0] * 4


def test_rank_output_is_attached_to_failures(pools):
    outcome, _ = run(pools, harness_tasks.print_and_fail, world_size=2)
    assert outcome.status == "failed"
    r1 = by_rank(outcome)[1]
    assert "hello from rank 1" in r1.log
    assert "rank 1 disagrees" in r1.message


def test_grandchildren_are_killed_with_the_pool(pools):
    mark = uuid.uuid4().hex
    outcome, _ = run(pools, harness_tasks.spawn_child, world_size=2, deadline=SHORT_DEADLINE, marker=mark)
    assert outcome.status == "failed"
    assert [r.region for r in outcome.results] == ["child started", ""], "rank 0 had not started its child"
    assert wait_for(lambda: not marked_processes(mark), EVENT_LIMIT_S), marked_processes(mark)


def test_parse_mesh():
    assert parse_mesh("4").shape == (4,) and parse_mesh("4").dim_names == ("shard",)
    assert parse_mesh("2x2").dim_names == ("replicate", "shard")
    with pytest.raises(ValueError, match="explicit dim names"):
        parse_mesh("2x1x2")
    with pytest.raises(ValueError, match="positive"):
        parse_mesh("0x2")
    with pytest.raises(ValueError, match="joined by 'x'"):
        parse_mesh("two")


def test_leaked_threads_and_processes_are_reported_and_processes_killed(pools):
    outcome, _ = run(pools, harness_tasks.leak_thread, world_size=2)
    assert outcome.status == "passed"
    assert all(any("thread" in leak for leak in r.leaks) for r in outcome.results)
    assert outcome.faults() == {"ranks that leaked threads or processes": 2}
    mark = uuid.uuid4().hex
    outcome, _ = run(pools, harness_tasks.leak_child, world_size=2, marker=mark)
    assert outcome.status == "passed"
    assert any("process" in leak and "killed" in leak for leak in outcome.results[0].leaks)
    assert wait_for(lambda: not marked_processes(mark), EVENT_LIMIT_S), marked_processes(mark)


@pytest.mark.parametrize("when", ["while-ranks-start", "after-start"])
def test_ranks_die_with_a_controller_killed_outright(when):
    # SIGKILL leaves the controller no chance to clean up: the ranks must go
    # by themselves (the kernel's parent-death signal, armed at once).
    mark = uuid.uuid4().hex
    script = (
        "import sys, time\n"
        "from hyperdsd.testing import WorkerPool\n"
        "WorkerPool(2).start()\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]), HYPERDSD_TEST_MARK=mark)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if when == "after-start":
            assert proc.stdout.readline().strip() == "started"
            assert len(marked_processes(mark)) >= 3  # the controller, its two ranks (and the fork server)
        else:
            # A rank, or the fork server importing for the ranks.
            assert wait_for(lambda: len(marked_processes(mark)) >= 2, EVENT_LIMIT_S, interval_s=0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    # A fork server killed in its imports notices once they are done.
    assert wait_for(lambda: not marked_processes(mark), EVENT_LIMIT_S, interval_s=0.1), marked_processes(mark)
