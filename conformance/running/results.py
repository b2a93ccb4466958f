"""What a case's run came to: its verdict and everything a report shows."""

from __future__ import annotations

from dataclasses import dataclass, field

from hyperdsd.testing import Status

from .registry import Case

# The order reports list statuses in.
STATUSES = (Status.PASSED, Status.FAILED, Status.XFAIL, Status.XPASS, Status.NOT_APPLICABLE, Status.ERROR)


@dataclass
class CaseResult:
    case: Case
    status: Status
    duration_s: float = 0.0
    message: str = ""  # what went wrong, by rank
    details: str = ""  # tracebacks, stacks and rank logs
    repro: str = ""
    xfail_reason: str = ""
    ranks: list[int] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)  # rank deaths, hangs, leaks, restarts

    @property
    def unexpected(self) -> bool:
        return self.status.unexpected
