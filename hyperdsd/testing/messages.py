"""Messages passed between the controller and the rank workers.

The controller sends a :class:`Task`, :class:`Leave`, :class:`Rejoin` or
:class:`Shutdown`
to every rank of a pool over that rank's pipe; each rank answers a task with
exactly one :class:`RankResult` and a rejoin with :class:`Ready` (or
:class:`StartFailed`); a leave has no answer. Everything
here is picklable and small: tensors never travel through the pipes, only
verdicts and short values.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .status import RankStatus

# The signal a controller sends a rank for the stacks of all its threads.
STACK_SIGNAL = signal.SIGUSR1

# What a task's verdict holds against the code under test (see outcome.judge):
# everything the task does, or only the code it runs in ``ctx.under_test``.
WHOLE_TASK = "task"
REGIONS = "regions"


def function_ref(fn: Callable | str) -> str:
    """``"package.module:qualname"``: how a rank finds ``fn`` in a fresh process."""
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not name or "<" in name or module == "__main__":
        raise ValueError(f"task function {fn!r} must be a module-level function importable by other processes")
    return f"{module}:{name}"


@dataclass(frozen=True)
class Task:
    """A function to run on every rank: ``fn(ctx, **kwargs)``.

    ``fn`` is given as the function itself (or ``"package.module:function"``)
    and travels as that reference, so that it resolves in a freshly spawned
    process without pickling code. ``scope`` says what a failure blames:
    ``"task"`` (any failure is the task's verdict) or ``"regions"`` (only
    failures inside ``ctx.under_test`` blocks, and failed checks, blame the
    code under test; anything else is an error of the task itself).
    """

    fn: Callable | str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    scope: str = WHOLE_TASK

    def __post_init__(self) -> None:
        object.__setattr__(self, "fn", function_ref(self.fn))
        if self.scope not in (WHOLE_TASK, REGIONS):
            raise ValueError(f"task scope must be {WHOLE_TASK!r} or {REGIONS!r}, got {self.scope!r}")


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Leave:
    """Leave the process group now (see group.Membership.leave)."""


@dataclass(frozen=True)
class Rejoin:
    """Leave the current process group and join generation ``generation``."""

    generation: int


@dataclass(frozen=True)
class Ready:
    rank: int
    pid: int
    generation: int = 0


@dataclass(frozen=True)
class StartFailed:
    rank: int
    message: str


@dataclass
class RankResult:
    rank: int
    status: RankStatus
    duration_s: float = 0.0
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    value: Any = None
    # The code under test the rank was in when it raised, hung or died
    # (a ``ctx.under_test`` label); "" when it was in the task's own code.
    region: str = ""
    # The rank raised an AssertionError: a check of the task did not hold.
    check: bool = False
    # Python stacks of every thread, collected when the rank missed its deadline.
    stacks: str = ""
    # What the rank printed to stdout/stderr while the task ran.
    log: str = ""
    # Collective sequence number of every process group this rank belongs to,
    # keyed by the group's global ranks; used to tell whether the groups are
    # still in step after a task.
    pg_sequence: dict[tuple[int, ...], int] | None = None
    # Threads still running and child processes still alive after the task
    # (the processes are killed by the rank before it answers).
    leaks: list[str] = field(default_factory=list)

    @property
    def reported(self) -> bool:
        return self.status in (RankStatus.PASSED, RankStatus.RAISED, RankStatus.NOT_APPLICABLE)

    @property
    def where(self) -> str:
        return f" in {self.region}" if self.region else ""
