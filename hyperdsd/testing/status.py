"""The status vocabulary: what happened on one rank, and the verdict on a
task or a case.

Both are ``str`` enums, so they compare equal to their values, print as
them in reports, and pickle across processes.
"""

from __future__ import annotations

from enum import Enum


class RankStatus(str, Enum):
    """What one rank did with one task.

    ``PASSED``, ``RAISED`` and ``NOT_APPLICABLE`` are reported by the rank;
    ``DIED``, ``TIMEOUT`` and ``STUCK`` are assigned by whoever collects the
    results when a rank could not report, or was only released from a
    blocked collective because another rank failed.
    """

    PASSED = "passed"
    RAISED = "raised"
    NOT_APPLICABLE = "n/a"
    DIED = "died"
    TIMEOUT = "timeout"
    STUCK = "stuck"

    __str__ = str.__str__

    @property
    def failed(self) -> bool:
        return self in (RankStatus.RAISED, RankStatus.DIED, RankStatus.TIMEOUT, RankStatus.STUCK)


class Status(str, Enum):
    """The verdict on a task (``PASSED``, ``FAILED``, ``ERROR``,
    ``NOT_APPLICABLE``) or a case (also ``XFAIL`` and ``XPASS``).

    ``FAILED``: the code under test deviated (raised, gave a wrong result,
    hung or died inside it). ``ERROR``: the harness or the task's own code
    failed outside the code under test, so nothing could be judged.
    """

    PASSED = "passed"
    FAILED = "failed"
    XFAIL = "xfail"
    XPASS = "xpass"
    NOT_APPLICABLE = "n/a"
    ERROR = "error"

    __str__ = str.__str__

    @property
    def unexpected(self) -> bool:
        return self in (Status.FAILED, Status.ERROR)
