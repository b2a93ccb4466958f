"""The controller side: persistent pools of rank workers, one per world size.

A pool spawns its ranks once; each task is sent to every rank and every rank
must answer before its deadline. A rank that raises, dies or misses the
deadline fails the task, and any doubt about the pool's health (a dead or
stuck rank, process groups out of step) gets the pool killed; the next task
on that world size starts a fresh one.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from . import messages as m
from .context import worker_env
from .process import describe_exit, kill_tree, request_stacks, worker_command

_LOG_TAIL_BYTES = 16_000
# Strong references: a pool whose start was interrupted is referenced by
# nothing else, and must still be killed at exit.
_live_pools: "set[WorkerPool]" = set()


@atexit.register
def _kill_all_pools() -> None:
    for pool in list(_live_pools):
        pool.kill()


class PoolStartError(RuntimeError):
    pass


@dataclass
class TaskOutcome:
    """How one task went on every rank of one pool."""

    task: m.Task
    world_size: int
    status: str  # "passed" | "failed" | "error" | "n/a"
    results: list[m.RankResult]
    duration_s: float
    recycled: str = ""  # why the pool was discarded after this task, if it was
    notes: list[str] = field(default_factory=list)

    def faults(self) -> dict[str, int]:
        """What went wrong with the ranks themselves, by kind (for run summaries)."""
        out: dict[str, int] = {}
        for r in self.results:
            kind = {m.DIED: "rank deaths", m.TIMEOUT: "ranks past the deadline", m.STUCK: "ranks stuck after another failed"}.get(r.status)
            if kind:
                out[kind] = out.get(kind, 0) + 1
            if r.leaks:
                out["ranks that leaked threads or processes"] = out.get("ranks that leaked threads or processes", 0) + 1
        if self.recycled:
            out["pool restarts"] = 1
        return out

    @property
    def values(self) -> list:
        return [r.value for r in self.results]

    def describe(self) -> str:
        """One line per rank that did not pass, most telling first."""
        # A death or a hang explains the errors it causes on other ranks, so it comes first.
        order = {m.DIED: 0, m.TIMEOUT: 1, m.RAISED: 2, m.STUCK: 3, m.NOT_APPLICABLE: 4, m.PASSED: 5}
        lines = [r.headline() for r in sorted(self.results, key=lambda r: (order.get(r.status, 9), r.rank)) if r.status != m.PASSED]
        return "\n".join(lines + self.notes)


def judge(results: list[m.RankResult]) -> tuple[str, list[str]]:
    """Turn per-rank results into one verdict; every rank counts."""
    statuses = {r.status for r in results}
    if statuses & {m.DIED, m.TIMEOUT, m.STUCK}:
        return "error", []
    if m.RAISED in statuses:
        return "failed", []
    if statuses == {m.NOT_APPLICABLE}:
        return "n/a", []
    if m.NOT_APPLICABLE in statuses:
        return "error", ["ranks disagree on whether the task applies"]
    return "passed", []


def _out_of_step(results: list[m.RankResult]) -> str:
    seen: dict[tuple[int, ...], dict[int, int]] = {}
    for r in results:
        if r.pg_sequence is None:
            return f"rank {r.rank} could not report its process groups"
        for ranks, seq in r.pg_sequence.items():
            seen.setdefault(ranks, {})[r.rank] = seq
    for ranks, by_rank in seen.items():
        if len(set(by_rank.values())) > 1:
            detail = ", ".join(f"rank {k}: {v}" for k, v in sorted(by_rank.items()))
            return f"process group {list(ranks)} is out of step ({detail} collectives issued)"
    return ""


def _read_from(path: str, offset: int, limit: int = _LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            end = f.tell()
            f.seek(max(offset, end - limit))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return text if end - offset <= limit else "[...]\n" + text


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


class _Rank:
    """A rank's process, with a waitable that becomes ready when it exits."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.pid = proc.pid
        try:
            self.sentinel = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            self.sentinel = None  # death is still seen as EOF on the pipe

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            pass

    def release(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


class WorkerPool:
    """``world_size`` rank processes sharing one gloo process group."""

    def __init__(self, world_size: int, *, gloo_timeout_s: float = 45.0, start_timeout_s: float = 180.0, grace_s: float = 5.0):
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.gloo_timeout_s = gloo_timeout_s
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.workdir = ""
        self._procs: list = []
        self._conns: list = []
        self.tasks_run = 0

    # -- lifecycle -------------------------------------------------------
    def start(self) -> "WorkerPool":
        try:
            self._spawn()
            self._await_ready()
        except BaseException:
            self.kill()  # Ctrl-C or a failed start: no rank outlives it
            raise
        return self

    def _spawn(self) -> None:
        # mkdtemp makes a 0700 directory: the rendezvous store and logs stay private.
        self.workdir = tempfile.mkdtemp(prefix=f"hyperdsd-pool{self.world_size}-")
        _live_pools.add(self)
        env = dict(os.environ, **worker_env(), HYPERDSD_SYS_PATH=json.dumps([os.path.abspath(p) for p in sys.path]))
        for rank in range(self.world_size):
            ours, theirs = socket.socketpair()
            with open(self._log(rank), "ab") as log:
                proc = subprocess.Popen(
                    worker_command(
                        "--fd", str(theirs.fileno()),
                        "--rank", str(rank),
                        "--world-size", str(self.world_size),
                        "--workdir", self.workdir,
                        "--parent-pid", str(os.getpid()),
                        "--gloo-timeout", str(self.gloo_timeout_s),
                    ),
                    pass_fds=(theirs.fileno(),),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Own session: no terminal Ctrl-C, and one group to kill.
                    start_new_session=True,
                )
            theirs.close()
            self._procs.append(_Rank(proc))
            self._conns.append(Connection(ours.detach()))

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = set(range(self.world_size))
        problems = []
        while pending and not problems:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                problems.append(f"ranks {sorted(pending)} did not join the process group within {self.start_timeout_s:.0f} s")
                break
            for obj in wait(self._waitables(pending), timeout=remaining):
                rank = self._rank_of(obj)
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                if obj is conn or conn.poll():
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    if isinstance(msg, m.Ready):
                        pending.discard(rank)
                        continue
                    if isinstance(msg, m.StartFailed):
                        problems.append(f"rank {rank} could not join the process group: {msg.message}")
                        continue
                self._procs[rank].join(1)
                problems.append(f"rank {rank} {describe_exit(self._procs[rank].exitcode)} while starting")
        if problems:
            logs = "\n".join(
                f"--- rank {r} log ---\n{_read_from(self._log(r), 0)}" for r in range(self.world_size)
            )
            self.kill()
            raise PoolStartError("; ".join(problems) + "\n" + logs)

    def _log(self, rank: int) -> str:
        return os.path.join(self.workdir, f"rank{rank}.log")

    def _stacks(self, rank: int) -> str:
        return os.path.join(self.workdir, f"rank{rank}.stacks")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _waitables(self, ranks) -> list:
        objs = [self._conns[r] for r in ranks]
        return objs + [self._procs[r].sentinel for r in ranks if self._procs[r].sentinel is not None]

    def _rank_of(self, obj) -> int:
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
            if obj is conn or obj == proc.sentinel:
                return rank
        return -1

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask ranks to stop, then make sure they and their children are gone."""
        for conn in self._conns:
            try:
                conn.send(m.Shutdown())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self._procs:
            if proc.pid is not None:
                kill_tree(proc.pid)
        for proc in self._procs:
            proc.join(5)
            proc.release()
        for conn in self._conns:
            try:
                conn.close()
            except OSError:
                pass
        self._procs, self._conns = [], []
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = ""
        _live_pools.discard(self)

    # -- running tasks ---------------------------------------------------
    def run(self, task: m.Task, deadline_s: float) -> TaskOutcome:
        """Run ``task`` on every rank; the pool is killed if it may be unhealthy.

        If the caller is interrupted while waiting (Ctrl-C, a test timeout),
        the ranks are still busy with the task: the pool is killed rather
        than left to answer the next task with this one's results.
        """
        try:
            return self._run(task, deadline_s)
        except BaseException:
            self.kill()
            raise

    def _run(self, task: m.Task, deadline_s: float) -> TaskOutcome:
        if not self.alive:
            raise PoolStartError("the pool is not running")
        start = time.monotonic()
        self.tasks_run += 1
        log_offsets = [_size(self._log(r)) for r in range(self.world_size)]
        results: dict[int, m.RankResult] = {}
        for rank, conn in enumerate(self._conns):
            try:
                conn.send(task)
            except (OSError, ValueError):
                results[rank] = self._died(rank)
        pending = set(range(self.world_size)) - set(results)
        hard = start + deadline_s
        soft = float("inf")
        first_failure = next(iter(results.values()), None)
        if first_failure is not None:
            soft = time.monotonic() + self.grace_s
        while pending:
            limit = min(hard, soft)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            for obj in wait(self._waitables(pending), timeout=remaining):
                rank = self._rank_of(obj)
                if rank not in pending:
                    continue
                result = self._receive(rank)
                results[rank] = result
                pending.discard(rank)
                if result.status not in (m.PASSED, m.NOT_APPLICABLE) and first_failure is None:
                    first_failure = result
                    soft = time.monotonic() + self.grace_s
        recycled = ""
        if pending:
            timed_out = time.monotonic() >= hard
            stacks = self._collect_stacks(sorted(pending))
            for rank in pending:
                if timed_out:
                    msg = f"missed the {deadline_s:g} s deadline"
                    status = m.TIMEOUT
                else:
                    msg = (
                        f"still running {self.grace_s:g} s after rank {first_failure.rank} failed "
                        "(blocked, most likely in a collective)"
                    )
                    status = m.STUCK
                results[rank] = m.RankResult(rank, status, message=msg, stacks=stacks.get(rank, ""))
            recycled = "ranks " + ",".join(map(str, sorted(pending))) + (" missed the deadline" if timed_out else " were stuck")
        ordered = [results[r] for r in range(self.world_size)]
        status, notes = judge(ordered)
        if not recycled:
            if any(r.status == m.DIED for r in ordered):
                recycled = "a rank died"
            else:
                recycled = _out_of_step(ordered)
        for r in ordered:
            if r.leaks:
                notes.append(f"rank {r.rank} left behind: " + "; ".join(r.leaks))
        if status != "passed":
            for r in ordered:
                r.log = _read_from(self._log(r.rank), log_offsets[r.rank])
        outcome = TaskOutcome(task, self.world_size, status, ordered, time.monotonic() - start, recycled, notes)
        if recycled:
            outcome.notes.append(f"pool restarted: {recycled}")
            self.kill()
        return outcome

    def _receive(self, rank: int) -> m.RankResult:
        conn = self._conns[rank]
        try:
            if conn.poll():
                msg = conn.recv()
                if isinstance(msg, m.RankResult):
                    return msg
        except (EOFError, OSError):
            pass
        return self._died(rank)

    def _died(self, rank: int) -> m.RankResult:
        proc = self._procs[rank]
        proc.join(2)
        return m.RankResult(rank, m.DIED, message=f"died during the task ({describe_exit(proc.exitcode)})")

    def _collect_stacks(self, ranks: list[int], wait_s: float = 2.0) -> dict[int, str]:
        before = {r: _size(self._stacks(r)) for r in ranks}
        for r in ranks:
            if self._procs[r].is_alive():
                request_stacks(self._procs[r].pid)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_size(self._stacks(r)) == before[r] for r in ranks):
            time.sleep(0.05)
        time.sleep(0.1)  # let the dump finish writing
        return {r: _read_from(self._stacks(r), before[r]) for r in ranks}


class PoolSet:
    """Pools keyed by world size, started on first use and reused after.

    At most ``max_ranks`` rank processes are kept alive; the least recently
    used pool is closed to make room.
    """

    def __init__(self, *, gloo_timeout_s: float = 45.0, start_timeout_s: float = 180.0, grace_s: float = 5.0, max_ranks: int = 12):
        self.gloo_timeout_s = gloo_timeout_s
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.max_ranks = max_ranks
        self._pools: dict[int, WorkerPool] = {}
        self.starts = 0

    def pool(self, world_size: int) -> WorkerPool:
        pool = self._pools.pop(world_size, None)
        if pool is None or not pool.alive:
            if pool is not None:
                pool.kill()
            while self._pools and sum(self._pools) + world_size > self.max_ranks:
                oldest = next(iter(self._pools))
                self._pools.pop(oldest).close()
            pool = WorkerPool(world_size, gloo_timeout_s=self.gloo_timeout_s, start_timeout_s=self.start_timeout_s, grace_s=self.grace_s)
            self.starts += 1
            pool.start()
        self._pools[world_size] = pool  # most recently used last
        return pool

    def run(self, world_size: int, task: m.Task, deadline_s: float = 60.0) -> TaskOutcome:
        start = time.monotonic()
        try:
            pool = self.pool(world_size)
        except PoolStartError as exc:
            result = m.RankResult(0, m.DIED, message=f"the pool of {world_size} ranks did not start: {exc}")
            return TaskOutcome(task, world_size, "error", [result], time.monotonic() - start, "start failed")
        outcome = pool.run(task, deadline_s)
        if outcome.recycled:
            self._pools.pop(world_size, None)
        return outcome

    @property
    def pids(self) -> list[int]:
        return [pid for pool in self._pools.values() for pid in pool.pids]

    def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def kill(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.kill()

    def __enter__(self) -> "PoolSet":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.kill()
