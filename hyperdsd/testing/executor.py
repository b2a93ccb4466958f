"""What runs a task on a world of ranks: one interface, two implementations.

* :class:`~hyperdsd.testing.pool.PoolSet`: ranks this process spawns, a
  persistent pool per world size (``python -m conformance``, pytest).
* :class:`~hyperdsd.testing.world.TorchrunWorld`: ranks someone else
  launched (``torchrun``); a task for fewer ranks runs on a sub-world of them.

Callers (the conformance runner, tests, benchmarks) hold an ``Executor`` and
need not know which one it is.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from .messages import Task
from .outcome import TaskOutcome


class Executor(Protocol):
    launcher: str  # "pools" or "torchrun": how the ranks came to be

    @property
    def reporter(self) -> bool:
        """Whether this process receives outcomes (under torchrun: rank 0 only)."""

    def unfit(self, world_sizes: Iterable[int]) -> str:
        """Why tasks for these world sizes cannot run here, or ""."""

    def run(self, world_size: int, task: Task, deadline_s: float) -> TaskOutcome | None:
        """Run ``task`` on every rank of a world of ``world_size``; the
        outcome, or None in a process that does not report."""

    def close(self) -> None: ...

    def kill(self) -> None: ...
