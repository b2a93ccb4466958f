"""Messages passed between the controller and the rank workers.

The controller sends a :class:`Task` (or :class:`Shutdown`) to every rank of a
pool over that rank's pipe; each rank answers with exactly one
:class:`RankResult`. Everything here is picklable and small: tensors never
travel through the pipes, only verdicts and short values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# Per-rank statuses. "passed", "raised" and "n/a" are reported by the rank
# itself; "died", "timeout" and "stuck" are assigned by the controller when a
# rank could not report.
PASSED = "passed"
RAISED = "raised"
NOT_APPLICABLE = "n/a"
DIED = "died"
TIMEOUT = "timeout"
STUCK = "stuck"


@dataclass(frozen=True)
class Task:
    """A function to run on every rank: ``fn(ctx, **kwargs)``.

    ``fn`` is ``"package.module:function"`` so that it resolves in a freshly
    spawned process without pickling code.
    """

    fn: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int


@dataclass(frozen=True)
class StartFailed:
    rank: int
    message: str


@dataclass
class RankResult:
    rank: int
    status: str
    duration_s: float = 0.0
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    value: Any = None
    # Python stacks of every thread, collected when the rank missed its deadline.
    stacks: str = ""
    # What the rank printed to stdout/stderr while the task ran.
    log: str = ""
    # Collective sequence number of every process group this rank belongs to,
    # keyed by the group's global ranks; used to tell whether the groups are
    # still in step after a failure.
    pg_sequence: dict[tuple[int, ...], int] | None = None
    # Threads still running and child processes still alive after the task
    # (the processes are killed by the rank before it answers).
    leaks: list[str] = field(default_factory=list)

    @property
    def reported(self) -> bool:
        return self.status in (PASSED, RAISED, NOT_APPLICABLE)

    def headline(self) -> str:
        if self.status == RAISED:
            return f"rank {self.rank} raised {self.exc_type}: {self.message}"
        if self.status == NOT_APPLICABLE:
            return f"rank {self.rank} not applicable: {self.message}"
        if self.status == PASSED:
            return f"rank {self.rank} passed"
        return f"rank {self.rank} {self.status}: {self.message}"
