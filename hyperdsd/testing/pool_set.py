"""Pools of rank workers keyed by world size: the executor of spawned ranks.

A :class:`PoolSet` starts a :class:`~hyperdsd.testing.pool.WorkerPool` for a
world size on first use and reuses it after, keeping at most so many rank
processes alive; the pool itself runs each task (:mod:`.pool`).
"""

from __future__ import annotations

import os
import tempfile
import time

from . import messages as m
from .outcome import TaskOutcome
from .pool import PoolStartError, WorkerPool
from .status import RankStatus, Status


class PoolSet:
    """Pools keyed by world size, started on first use and reused after: the
    :class:`~hyperdsd.testing.executor.Executor` of spawned ranks.

    At most ``max_ranks`` rank processes are kept alive; the least recently
    used pool is closed to make room. ``preload`` names modules the ranks'
    tasks import, imported once by the fork server (see ``process.py``; the
    first pool of a process to start decides).
    """

    launcher = "pools"
    repro_prefix = "python -m conformance"
    exitfirst_refusal = ""
    reporter = True
    on_expiry = None  # the controller is no rank: a hang comes back as an outcome

    def __init__(
        self,
        *,
        gloo_timeout_s: float = 45.0,
        start_timeout_s: float = 180.0,
        grace_s: float = 5.0,
        release_after_s: float = 0.25,
        max_ranks: int = 12,
        device_type: str = "cpu",
        backend: str = "gloo",
        preload: tuple[str, ...] = (),
    ):
        self.preload = tuple(preload)
        self.gloo_timeout_s = gloo_timeout_s
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.release_after_s = release_after_s
        self.max_ranks = max_ranks
        self.device_type = device_type
        self.backend = backend
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
            pool = WorkerPool(
                world_size,
                gloo_timeout_s=self.gloo_timeout_s,
                start_timeout_s=self.start_timeout_s,
                grace_s=self.grace_s,
                release_after_s=self.release_after_s,
                device_type=self.device_type,
                backend=self.backend,
                preload=self.preload,
            )
            self.starts += 1
            pool.start()
        self._pools[world_size] = pool  # most recently used last
        return pool

    def run_workdir(self, base: str | None, prefix: str) -> str:
        if base:  # a --workdir that does not exist yet is made, as under torchrun
            os.makedirs(base, exist_ok=True)
        return tempfile.mkdtemp(prefix=prefix, dir=base)  # the ranks are forked on this machine

    def unfit(self, world_sizes) -> str:
        big = [w for w in world_sizes if w > self.max_ranks]
        return f"needs {max(big)} ranks; this run keeps at most {self.max_ranks}" if big else ""

    def run(self, world_size: int, task: m.Task, deadline_s: float = 60.0) -> TaskOutcome:
        start = time.monotonic()
        try:
            pool = self.pool(world_size)
        except PoolStartError as exc:
            result = m.RankResult(0, RankStatus.DIED, message=f"the pool of {world_size} ranks did not start: {exc}")
            return TaskOutcome(task, world_size, Status.ERROR, [result], time.monotonic() - start, "start failed")
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
