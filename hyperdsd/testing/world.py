"""Running tasks on a world that someone else launched (``torchrun``).

Every rank runs the same tasks in the same order, in its own process. Results
travel to rank 0 through the rendezvous store rather than a collective, so a
task that leaves the process group out of step cannot corrupt the report.
There is no pool to kill here: a rank that misses its deadline dumps every
rank-local stack and exits, and torchrun tears the rest of the world down.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import sys
import threading
import time
from typing import Callable

from . import messages as m
from .context import RankContext, execute
from .pool import TaskOutcome, _out_of_step, judge


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class _Watchdog:
    """Ends the process if a task overruns: a stuck collective cannot be interrupted."""

    def __init__(self, deadline_s: float, on_expiry: Callable[[], None] | None):
        self._done = threading.Event()
        self._deadline_s = deadline_s
        self._on_expiry = on_expiry
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        if self._done.wait(self._deadline_s):
            return
        sys.stderr.write(f"\nhyperdsd: task missed its {self._deadline_s:g} s deadline; stacks follow\n")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self._on_expiry is not None:
            try:
                self._on_expiry()
            except Exception:
                pass
        sys.stderr.flush()
        os._exit(124)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()


class ExistingWorld:
    """The torchrun world as a pool: same ``run`` contract as :class:`WorkerPool`."""

    def __init__(self, gloo_timeout_s: float = 45.0, result_timeout_s: float = 600.0):
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=gloo_timeout_s))
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # torch does not expose the default store publicly; it is only read here.
        self._store = dist.distributed_c10d._get_default_store()
        self._result_timeout = datetime.timedelta(seconds=result_timeout_s)
        self._count = 0
        self.ctx = RankContext(self.rank, self.world_size, workdir=os.getcwd())
        self.on_expiry: Callable[[], None] | None = None

    def run(self, task: m.Task, deadline_s: float) -> TaskOutcome | None:
        """Run on this rank; rank 0 returns the outcome for all ranks, others None.

        Rank 0 waits for the other ranks' results until the deadline. If one
        does not report, the outcome is an error with ``recycled`` set: the
        world cannot be trusted any more, and the caller should end the run
        (torchrun then stops the other ranks). Other ranks' watchdogs fire a
        little later than rank 0's, so that rank 0 is the one that reports.
        """
        self._count += 1
        start = time.monotonic()
        grace = 0.0 if self.rank == 0 else 10.0
        with _Watchdog(deadline_s + grace, self.on_expiry if self.rank == 0 else None):
            result = execute(self.ctx, task)
        if result.status == m.PASSED and not _picklable(result.value):
            result.value = None
        key = f"hyperdsd/task{self._count}/rank"
        self._store.set(f"{key}{self.rank}", pickle.dumps(result))
        if self.rank != 0:
            return None
        results: list[m.RankResult] = []
        missing = []
        for r in range(self.world_size):
            remaining = max(0.1, deadline_s - (time.monotonic() - start))
            try:
                self._store.wait([f"{key}{r}"], datetime.timedelta(seconds=remaining))
                results.append(pickle.loads(self._store.get(f"{key}{r}")))
            except Exception:  # the store raises on timeout
                missing.append(r)
                results.append(m.RankResult(r, m.TIMEOUT, message=f"did not report within the {deadline_s:g} s deadline (stuck or dead)"))
        status, notes = judge(results)
        outcome = TaskOutcome(task, self.world_size, status, results, time.monotonic() - start, notes=notes)
        if missing:
            outcome.recycled = f"ranks {missing} did not report; the world cannot run further tasks"
        out_of_step = _out_of_step(results)
        if out_of_step:
            outcome.notes.append(out_of_step)
            # Its next collective would pair with the wrong partners: every
            # later case would fail for this one's sake.
            outcome.recycled = outcome.recycled or f"{out_of_step}; the world cannot run further tasks"
        return outcome


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False
