"""Running tasks on a world that someone else launched (``torchrun``).

Every rank runs the same tasks in the same order, in its own process. A task
for ``k`` ranks runs on ranks ``0..k-1`` in a process group of their own (a
sub-world: the launcher's group is replaced by one of size ``k``, formed
through the launcher's store), while the other ranks wait for its verdict
without taking part in any collective. Results travel to rank 0 through the
store rather than a collective, so a task that leaves the process group out
of step cannot corrupt the report; rank 0 judges and publishes whether the
next task needs a new process group.

A rank whose task failed leaves its process group at once, which releases
ranks blocked on it in a collective. A rank that hangs past its deadline
publishes its stacks and exits; rank 0 reports the task and ends the run.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import sys
import tempfile
import threading
import time
from typing import Callable

from . import messages as m
from .context import RankContext, execute, select_device
from .group import Membership
from .outcome import TaskOutcome, judge, mark_released, out_of_step
from .status import RankStatus

# How long after its deadline a rank that still runs its task exits (rank 0
# waits for results until the deadline, then this long for stacks).
_EXIT_AFTER_S = 5.0
_POLL_S = 0.005
_PEER_POLL_S = 0.25
# A peer's failure releases the ranks blocked on it at once (its connections
# close); one that is still running after this long is released by itself.
_RELEASE_AFTER_S = 1.0


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class WorldLost(RuntimeError):
    """A rank stopped answering: no further task can run on this world."""


class _Watchdog:
    """Watches a rank's task.

    When a peer failed and left while this rank still runs, it closes this
    rank's own connections after a grace period: a rank blocked on a peer
    that left does not always see the connection drop (a send to a peer
    already gone can wait for gloo's whole timeout), but it sees its own.
    At the deadline it publishes where this rank is; a little later it ends
    the process: a collective that never completes cannot be interrupted.
    """

    def __init__(
        self,
        deadline_s: float,
        on_deadline: Callable[[], None],
        on_exit: Callable[[], None] | None,
        peer_left: Callable[[], bool] = lambda: False,
        release: Callable[[], None] = lambda: None,
    ):
        self._done = threading.Event()
        self._deadline_s = deadline_s
        self._on_deadline = on_deadline
        self._on_exit = on_exit
        self._peer_left = peer_left
        self._release = release
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        end = time.monotonic() + self._deadline_s
        noticed = None
        while not self._done.wait(min(_PEER_POLL_S, max(0.0, end - time.monotonic()))):
            now = time.monotonic()
            if now >= end:
                break
            if noticed is None:
                try:
                    noticed = now if self._peer_left() else None
                except Exception:
                    pass
            elif now - noticed >= _RELEASE_AFTER_S:
                _quietly(self._release)
                noticed = float("inf")  # once
        else:
            return
        _quietly(self._on_deadline)
        if self._done.wait(_EXIT_AFTER_S):
            return
        sys.stderr.write(f"\nhyperdsd: task missed its {self._deadline_s:g} s deadline; stacks follow\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self._on_exit is not None:
            _quietly(self._on_exit)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(124)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:
        pass


def _stacks_now() -> str:
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.seek(0)
        return f.read()


class TorchrunWorld:
    """The torchrun world as an :class:`~hyperdsd.testing.executor.Executor`."""

    launcher = "torchrun"
    exitfirst_refusal = "every rank of a torchrun world must run the same cases"

    def __init__(
        self, gloo_timeout_s: float = 45.0, *, device_type: str = "cpu", backend: str = "gloo", workdir: str = ""
    ):
        import torch
        import torch.distributed as dist

        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_type != "cpu":
            select_device(device_type, self.local_rank)
        torch.set_num_threads(max(1, torch.get_num_threads()))
        # The launcher's rendezvous (env://): its store outlives every process
        # group formed through it, sub-worlds included.
        self._store, self.rank, self.world_size = next(
            dist.rendezvous("env://", timeout=datetime.timedelta(seconds=gloo_timeout_s))
        )
        self._membership = Membership(self._store, backend=backend, timeout_s=gloo_timeout_s)
        self._generation = 0
        self._membership.join(self.rank, self.world_size, self._generation)
        self._formed = self.world_size
        self._dirty = False
        self._lost = ""
        self._count = 0
        self.ctx = RankContext(
            self.rank, self.world_size, workdir="", device_type=device_type, local_rank=self.local_rank
        )
        self.on_expiry: Callable[[TaskOutcome | None], None] | None = None
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or self.world_size
        self.repro_prefix = f"torchrun --nproc-per-node {nproc} -m conformance"

    @property
    def reporter(self) -> bool:
        return self.rank == 0

    def run_workdir(self, base: str | None, prefix: str) -> str:
        # Every rank names the same directory, on a filesystem all nodes share
        # when the world spans machines (``base``).
        path = os.path.join(base or tempfile.gettempdir(), prefix + os.environ.get("TORCHELASTIC_RUN_ID", "run"))
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def unfit(self, world_sizes) -> str:
        big = [w for w in world_sizes if w > self.world_size]
        if big:
            return f"needs world size {max(big)}; the torchrun world has {self.world_size}"
        return ""

    # -- process groups --------------------------------------------------
    def _form(self, size: int) -> None:
        """Make ranks 0..size-1 a world of their own (every rank calls this alike)."""
        if size == self._formed and not self._dirty:
            return
        self._generation += 1
        self.ctx.reset()
        self._membership.leave()
        if self.rank < size:
            self._membership.join(self.rank, size, self._generation)
            self.ctx.world_size = size
        self._formed, self._dirty = size, False

    def _key(self, n: int, what: str) -> str:
        return f"hyperdsd/task{n}/{what}"

    # -- running tasks ---------------------------------------------------
    def run(self, world_size: int, task: m.Task, deadline_s: float) -> TaskOutcome | None:
        """Run on this rank if it is one of the first ``world_size``; rank 0
        returns the outcome for all of them, others None."""
        if self._lost:
            raise WorldLost(self._lost)
        self._count += 1
        n = self._count
        self._form(world_size)
        start = time.monotonic()
        if self.rank < world_size:
            expiry = (lambda: self._report_hang(n, world_size, task, start, deadline_s)) if self.rank == 0 else None
            left = self._key(n, "a-rank-left")
            with _Watchdog(
                deadline_s,
                lambda: self._publish_stacks(n),
                expiry,
                peer_left=lambda: self._store.check([left]),
                release=self._membership.close_connections,
            ):
                result = execute(self.ctx, task)
            if not _picklable(result.value):
                result.value = None
            self._store.set(self._key(n, f"rank{self.rank}"), pickle.dumps(result))
            if result.status.failed:
                # Peers may be blocked on this rank: leaving releases them.
                self._store.set(self._key(n, "a-rank-left"), b"1")
                self.ctx.reset()
                self._membership.leave()
                self._dirty = True
        if self.rank != 0:
            return self._await_verdict(n, deadline_s)
        outcome = self._collect(n, world_size, task, start, deadline_s)
        self._dirty = self._dirty or bool(outcome.regrouped)
        self._lost = outcome.recycled
        self._store.set(
            self._key(n, "verdict"), pickle.dumps({"regroup": bool(outcome.regrouped), "lost": outcome.recycled})
        )
        return outcome

    def _await_verdict(self, n: int, deadline_s: float) -> None:
        key = self._key(n, "verdict")
        try:
            self._store.wait([key], datetime.timedelta(seconds=deadline_s + 3 * _EXIT_AFTER_S + 30))
            verdict = pickle.loads(self._store.get(key))
        except Exception as exc:  # the store raises on timeout, or when rank 0 is gone
            raise WorldLost(f"rank 0 gave no verdict on task {n}: {exc}") from None
        if verdict["lost"]:
            raise WorldLost(verdict["lost"])
        self._dirty = self._dirty or verdict["regroup"]
        return None

    def _result_of(self, n: int, r: int) -> m.RankResult | None:
        key = self._key(n, f"rank{r}")
        if not self._store.check([key]):
            return None
        return pickle.loads(self._store.get(key))

    def _collect(self, n: int, size: int, task: m.Task, start: float, deadline_s: float) -> TaskOutcome:
        results: dict[int, m.RankResult] = {}
        hard = start + deadline_s
        while len(results) < size and time.monotonic() < hard:
            for r in range(size):
                if r not in results:
                    got = self._result_of(n, r)
                    if got is not None:
                        results[r] = got
            if len(results) < size:
                time.sleep(_POLL_S)
        missing = [r for r in range(size) if r not in results]
        if missing:  # their watchdogs publish where they are at the deadline
            wait_until = time.monotonic() + _EXIT_AFTER_S / 2
            while time.monotonic() < wait_until and not all(
                self._store.check([self._key(n, f"stacks{r}")]) for r in missing
            ):
                time.sleep(0.05)
        return self._outcome(n, size, task, start, deadline_s, results, missing)

    def _outcome(self, n, size, task, start, deadline_s, results, missing) -> TaskOutcome:
        for r in missing:
            stacks, region = "", ""
            key = self._key(n, f"stacks{r}")
            if self._store.check([key]):
                stacks, region = pickle.loads(self._store.get(key))
            results[r] = m.RankResult(
                r,
                RankStatus.TIMEOUT,
                message=f"did not report within the {deadline_s:g} s deadline (stuck or dead)",
                stacks=stacks,
                region=region,
            )
        ordered = [results[r] for r in range(size)]
        mark_released(ordered)
        status, notes = judge(ordered, task.scope)
        outcome = TaskOutcome(task, size, status, ordered, time.monotonic() - start, notes=notes)
        if missing:
            outcome.recycled = f"ranks {missing} did not report; the world cannot run further tasks"
        elif any(r.status.failed for r in ordered):
            outcome.regrouped = "a rank failed and left the process group"
        else:
            outcome.regrouped = out_of_step(ordered)
        for r in ordered:
            if r.leaks:
                outcome.notes.append(f"rank {r.rank} left behind: " + "; ".join(r.leaks))
        return outcome

    def _publish_stacks(self, n: int) -> None:
        self._store.set(self._key(n, f"stacks{self.rank}"), pickle.dumps((_stacks_now(), self.ctx.region)))

    def _report_hang(self, n: int, size: int, task: m.Task, start: float, deadline_s: float) -> None:
        """Rank 0 itself hung: judge the task from what the store holds, then report."""
        if self.on_expiry is None:
            return
        results = {r: res for r in range(size) if (res := self._result_of(n, r)) is not None}
        outcome = self._outcome(n, size, task, start, deadline_s, results, [r for r in range(size) if r not in results])
        self.on_expiry(outcome)

    def close(self) -> None:
        self._membership.leave()

    def kill(self) -> None:
        self.close()


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False
