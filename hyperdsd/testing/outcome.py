"""What one task's per-rank results mean: the verdict, the lines that
explain it, and whether the ranks' process groups can be trusted after it.

Both executors (spawned pools and the torchrun world) judge with
:func:`judge`, so a task gets the same verdict however it was launched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import messages as m
from .status import RankStatus, Status

# What gloo says on a rank whose peer left the process group while it was
# blocked on that peer in a collective.
_PEER_LEFT = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe", re.I)


@dataclass
class TaskOutcome:
    """How one task went on every rank of one world."""

    task: m.Task
    world_size: int
    status: Status
    results: list[m.RankResult]
    duration_s: float
    recycled: str = ""  # why the ranks were restarted after this task, if they were
    regrouped: str = ""  # why the ranks formed new process groups after this task
    notes: list[str] = field(default_factory=list)

    def faults(self) -> dict[str, int]:
        """What went wrong with the ranks themselves, by kind (for run summaries)."""
        out: dict[str, int] = {}
        kinds = {
            RankStatus.DIED: "rank deaths",
            RankStatus.TIMEOUT: "ranks past the deadline",
            RankStatus.STUCK: "ranks stuck after another failed",
        }
        for r in self.results:
            kind = kinds.get(r.status)
            if kind:
                out[kind] = out.get(kind, 0) + 1
            if r.leaks:
                out["ranks that leaked threads or processes"] = out.get("ranks that leaked threads or processes", 0) + 1
        if self.recycled:
            out["pool restarts"] = 1
        elif self.regrouped:
            out["process groups re-formed"] = 1
        return out

    @property
    def values(self) -> list:
        return [r.value for r in self.results]

    def describe(self) -> str:
        """One line per kind of failure, most telling first, ranks grouped."""
        return "\n".join(describe_results(self.results) + self.notes)


def mark_released(results: list[m.RankResult]) -> None:
    """Ranks that raised only because a failed peer left the process group
    were blocked waiting on it: they are stuck, not failing on their own.

    Told apart by gloo's message, and only when some other rank failed for
    a reason of its own (otherwise the connection loss is the failure).
    """
    lost = [r for r in results if r.status == RankStatus.RAISED and _PEER_LEFT.search(r.message or "")]
    own = [r for r in results if r.status.failed and r not in lost]
    if not lost or not own:
        return
    origin = ",".join(str(r.rank) for r in own)
    for r in lost:
        r.status = RankStatus.STUCK
        r.message = f"blocked in a collective until rank {origin} left the process group"


def judge(results: list[m.RankResult], scope: str = m.WHOLE_TASK) -> tuple[Status, list[str]]:
    """One verdict from every rank's result.

    Any failing rank fails the task (``FAILED``) when the failure counts
    against the code under test: with ``scope="task"`` every failure does;
    with ``scope="regions"`` a failure inside a ``ctx.under_test`` block, or
    a failed check (an AssertionError), does. Failures elsewhere are the
    task's own (``ERROR``), unless a failure of the code under test explains
    them.
    """
    failures = [r for r in results if r.status.failed]
    if failures:
        blamed = [r for r in failures if scope == m.WHOLE_TASK or r.region or r.check]
        return (Status.FAILED if blamed else Status.ERROR), []
    statuses = {r.status for r in results}
    if statuses == {RankStatus.NOT_APPLICABLE}:
        return Status.NOT_APPLICABLE, []
    if RankStatus.NOT_APPLICABLE in statuses:
        return Status.ERROR, ["ranks disagree on whether the task applies"]
    return Status.PASSED, []


# What a rank says when its process group broke under it (a timeout or a
# lost connection closes the group's connections for good).
_GROUP_BROKE = re.compile(
    r"gloo|pair closure|Timed out waiting|Connection (?:closed|reset|refused)|NCCL|Broken pipe", re.I
)


def out_of_step(results: list[m.RankResult]) -> str:
    """Why the process groups cannot be reused after these results, or ""."""
    broke = [r.rank for r in results if r.status.failed and _GROUP_BROKE.search(f"{r.message}\n{r.traceback}")]
    if broke:
        return f"the process group broke under rank(s) {','.join(map(str, broke))}"
    seen: dict[tuple[int, ...], dict[int, int]] = {}
    for r in results:
        if r.pg_sequence is None:
            return f"rank {r.rank} could not report its process groups"
        for ranks, seq in r.pg_sequence.items():
            seen.setdefault(ranks, {})[r.rank] = seq
    for ranks, by_rank in seen.items():
        if len(set(by_rank.values())) > 1:
            detail = ", ".join(f"rank {k}: {v}" for k, v in sorted(by_rank.items()))
            return f"process group {list(ranks)} is out of step ({detail} collectives issued)"
    return ""


_ORDER = {
    RankStatus.DIED: 0,
    RankStatus.TIMEOUT: 1,
    RankStatus.RAISED: 2,
    RankStatus.STUCK: 3,
    RankStatus.NOT_APPLICABLE: 4,
}


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _what(r: m.RankResult) -> str:
    if r.status == RankStatus.RAISED:
        return f"raised {r.exc_type or 'an error'}{r.where}: {headline(r.message)}"
    if r.status == RankStatus.DIED:
        return f"died{r.where}: {r.message}"
    if r.status == RankStatus.TIMEOUT:
        return f"still running{r.where}: {r.message}"
    if r.status == RankStatus.STUCK:
        return f"{r.message}{r.where}"
    return f"not applicable: {r.message}"


def describe_results(results: list[m.RankResult]) -> list[str]:
    """A line per distinct failure (a death or a hang first: it explains the rest)."""
    groups: dict[tuple, list] = {}
    for r in sorted(results, key=lambda r: (_ORDER.get(r.status, 9), r.rank)):
        if r.status == RankStatus.PASSED:
            continue
        key = (r.status, r.exc_type, headline(r.message), r.region)
        groups.setdefault(key, [[], r])[0].append(r.rank)
    return [f"{_ranks(ranks)} {_what(r)}" for ranks, r in groups.values()]


def headline(message: str) -> str:
    """An exception message without the remote traceback some libraries embed in it."""
    if "Traceback (most recent call last)" not in message:
        return message
    lines = [line for line in message.splitlines() if line.strip()]
    return f"{lines[0]} ... {lines[-1].strip()}" if len(lines) > 1 else message
