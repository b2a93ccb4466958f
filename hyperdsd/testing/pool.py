"""The controller side: a persistent pool of rank workers for one world size
(:mod:`.pool_set` keeps one per world size).

A pool spawns its ranks once; each task is sent to every rank and every rank
must answer before its deadline. When a rank fails while others are still
running, the finished ranks are told to leave the process group, which
releases any rank blocked on them in a collective at once; the ranks then
form new process groups (a new generation) instead of being restarted. A
dead rank, or one that stays stuck, gets the pool killed; the next task on
that world size starts a fresh one.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait

from . import messages as m
from .context import read_region, worker_env
from .outcome import TaskOutcome, judge, mark_released, out_of_step
from .process import describe_exit, interrupts_deferred, kill_tree, request_stacks, start_worker
from .status import RankStatus, Status

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


class WorkerPool:
    """``world_size`` rank processes sharing one gloo process group."""

    def __init__(
        self,
        world_size: int,
        *,
        gloo_timeout_s: float = 45.0,
        start_timeout_s: float = 180.0,
        grace_s: float = 5.0,
        release_after_s: float = 0.25,
        device_type: str = "cpu",
        backend: str = "gloo",
        preload: tuple[str, ...] = (),
    ):
        if world_size < 1:
            raise ValueError(f"world size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.preload = preload
        self.device_type = device_type
        self.backend = backend
        self.gloo_timeout_s = gloo_timeout_s
        self.start_timeout_s = start_timeout_s
        # After a rank fails: how long the others may take to finish on their
        # own before the finished ranks leave the process group (releasing
        # ranks blocked on them), and how long released ranks may take to answer.
        self.release_after_s = release_after_s
        self.grace_s = grace_s
        self.workdir = ""
        self.generation = 0
        self._procs: list = []
        self._conns: list = []
        self.tasks_run = 0

    # -- lifecycle -------------------------------------------------------
    def start(self) -> "WorkerPool":
        try:
            self._spawn()
            self._await_ready(range(self.world_size), 0)
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
            args = [
                "--rank",
                str(rank),
                "--world-size",
                str(self.world_size),
                "--workdir",
                self.workdir,
                "--parent-pid",
                str(os.getpid()),
                "--gloo-timeout",
                str(self.gloo_timeout_s),
                "--device",
                self.device_type,
                "--backend",
                self.backend,
            ]
            try:
                with interrupts_deferred():
                    self._procs.append(
                        start_worker(args, theirs, self._log(rank), env, self.start_timeout_s, self.preload)
                    )
            except (OSError, EOFError) as exc:
                ours.close()
                theirs.close()
                raise PoolStartError(f"rank {rank} could not be started: {type(exc).__name__}: {exc}") from exc
            theirs.close()
            self._conns.append(Connection(ours.detach()))

    def _await_ready(self, ranks, generation: int) -> None:
        """Every rank in ``ranks`` joins process-group ``generation``, or PoolStartError."""
        deadline = time.monotonic() + self.start_timeout_s
        pending = set(ranks)
        problems = []
        while pending and not problems:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                problems.append(
                    f"ranks {sorted(pending)} did not join the process group within {self.start_timeout_s:.0f} s"
                )
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
                    if isinstance(msg, m.Ready) and msg.generation == generation:
                        pending.discard(rank)
                        continue
                    if isinstance(msg, m.StartFailed):
                        problems.append(f"rank {rank} could not join the process group: {msg.message}")
                        continue
                    if msg is not None:
                        problems.append(f"rank {rank} answered {type(msg).__name__} while joining the process group")
                        continue
                self._procs[rank].join(1)
                problems.append(
                    f"rank {rank} {describe_exit(self._procs[rank].exitcode)} while joining the process group"
                )
        if problems:
            logs = "\n".join(f"--- rank {r} log ---\n{_read_from(self._log(r), 0)}" for r in range(self.world_size))
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

    def _tell(self, rank: int, msg) -> bool:
        try:
            self._conns[rank].send(msg)
            return True
        except (OSError, ValueError):
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Ask ranks to stop, then make sure they and their children are gone."""
        for rank in range(len(self._conns)):
            self._tell(rank, m.Shutdown())
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
        """Run ``task`` on every rank; the pool re-forms its groups or is
        killed if it may be unhealthy.

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
        for rank in range(self.world_size):
            if not self._tell(rank, task):
                results[rank] = self._died(rank)
        pending = set(range(self.world_size)) - set(results)
        hard = start + deadline_s
        releasing, first_failure = self._await(results, pending, hard)
        recycled = ""
        if pending:
            recycled = self._unfinished(results, pending, time.monotonic() >= hard, deadline_s, first_failure)
        return self._conclude(
            task, start, [results[r] for r in range(self.world_size)], log_offsets, releasing, recycled
        )

    def _await(self, results: dict, pending: set, hard: float) -> tuple[bool, m.RankResult | None]:
        """Results until none is pending, the deadline or the grace after a first failure; meanwhile finished
        ranks leave their groups, releasing ranks blocked on a failed one. (Whether they left, the first failure.)"""
        release_at = soft = float("inf")
        releasing = False
        first_failure = next(iter(results.values()), None)
        if first_failure is not None:
            release_at, soft = time.monotonic() + self.release_after_s, time.monotonic() + self.grace_s
        while pending:
            limit = min(hard, soft) if releasing else min(hard, soft, release_at)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                if not releasing and limit == release_at:
                    releasing = True
                    for rank in results:
                        self._tell(rank, m.Leave())
                    continue
                break
            for obj in wait(self._waitables(pending), timeout=remaining):
                rank = self._rank_of(obj)
                if rank not in pending:
                    continue
                result = self._receive(rank)
                results[rank] = result
                pending.discard(rank)
                if releasing:
                    self._tell(rank, m.Leave())
                if result.status.failed and first_failure is None:
                    first_failure = result
                    release_at, soft = time.monotonic() + self.release_after_s, time.monotonic() + self.grace_s
        return releasing, first_failure

    def _unfinished(self, results: dict, pending: set, timed_out: bool, deadline_s: float, first_failure) -> str:
        """The results of ranks still running, with their stacks; why the pool restarts."""
        stacks = self._collect_stacks(sorted(pending))
        for rank in pending:
            if timed_out:
                status, msg = RankStatus.TIMEOUT, f"missed the {deadline_s:g} s deadline"
            else:
                status = RankStatus.STUCK
                msg = (
                    f"still running {self.grace_s:g} s after rank {first_failure.rank} failed "
                    "(blocked, most likely in a collective)"
                )
            results[rank] = m.RankResult(
                rank, status, message=msg, stacks=stacks.get(rank, ""), region=read_region(self.workdir, rank)
            )
        return "ranks " + ",".join(map(str, sorted(pending))) + (" missed the deadline" if timed_out else " were stuck")

    def _conclude(self, task, start: float, ordered: list, log_offsets: list, releasing: bool, recycled: str):
        """The verdict; the pool re-forms its process groups, or restarts, where they cannot be trusted."""
        mark_released(ordered)
        status, notes = judge(ordered, task.scope)
        if not recycled and any(r.status == RankStatus.DIED for r in ordered):
            recycled = "a rank died"
        regrouped = ""
        if not recycled:
            regrouped = (
                "ranks left the process group to release ranks blocked on a failed one"
                if releasing
                else out_of_step(ordered)
            )
        for r in ordered:
            if r.leaks:
                notes.append(f"rank {r.rank} left behind: " + "; ".join(r.leaks))
        if status != Status.PASSED:
            for r in ordered:
                r.log = _read_from(self._log(r.rank), log_offsets[r.rank])
        outcome = TaskOutcome(
            task, self.world_size, status, ordered, time.monotonic() - start, recycled, regrouped, notes
        )
        if regrouped:
            try:
                self._rejoin()
            except PoolStartError as exc:
                outcome.recycled = recycled = (
                    f"the ranks could not form new process groups ({str(exc).splitlines()[0]})"
                )
        if recycled:
            outcome.notes.append(f"pool restarted: {recycled}")
            self.kill()
        return outcome

    def _rejoin(self) -> None:
        """Every rank leaves its process groups and joins a new generation."""
        self.generation += 1
        for rank in range(self.world_size):
            if not self._tell(rank, m.Rejoin(self.generation)):
                raise PoolStartError(f"rank {rank} cannot be reached")
        self._await_ready(range(self.world_size), self.generation)

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
        return m.RankResult(
            rank,
            RankStatus.DIED,
            message=f"{describe_exit(proc.exitcode)} during the task",
            region=read_region(self.workdir, rank),
        )

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
