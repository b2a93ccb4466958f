"""What runs a task on a world of ranks: one interface, two implementations.

* :class:`~hyperdsd.testing.pool_set.PoolSet`: ranks this process spawns, a
  persistent pool per world size (``python -m conformance``, pytest).
* :class:`~hyperdsd.testing.world.TorchrunWorld`: ranks someone else
  launched (``torchrun``); a task for fewer ranks runs on a sub-world of them.

Callers (the conformance runner, tests, benchmarks) hold an ``Executor`` and
need not know which one it is.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from .messages import Task
from .outcome import TaskOutcome


class Executor(Protocol):
    launcher: str  # "pools" or "torchrun": how the ranks came to be, for reports only
    repro_prefix: str  # the command line that reruns a selection of cases on ranks like these
    exitfirst_refusal: str  # why a run here cannot stop at the first failure, or ""
    # Called in the reporting process when it is itself a rank of a case that
    # missed its deadline (so it cannot return the outcome); None: not needed.
    on_expiry: Callable[[TaskOutcome | None], None] | None

    @property
    def reporter(self) -> bool:
        """Whether this process receives outcomes (under torchrun: rank 0 only)."""

    def run_workdir(self, base: str | None, prefix: str) -> str:
        """A directory for this run that every rank of every task sees (created)."""

    def unfit(self, world_sizes: Iterable[int]) -> str:
        """Why tasks for these world sizes cannot run here, or ""."""

    def run(self, world_size: int, task: Task, deadline_s: float) -> TaskOutcome | None:
        """Run ``task`` on every rank of a world of ``world_size``; the
        outcome, or None in a process that does not report."""

    def close(self) -> None: ...

    def kill(self) -> None: ...
