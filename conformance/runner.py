"""Runs cases: phases through persistent pools (or the torchrun world), one
verdict per case, expected failures applied."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from hyperdsd.testing import ExistingWorld, PoolSet, RankContext, RankResult, Task, TaskOutcome

from .adapters import load_adapter
from .registry import Case, by_id
from .xfails import Xfails

STATUSES = ("passed", "failed", "xfail", "xpass", "n/a", "error")


@dataclass
class CaseResult:
    case: Case
    status: str
    duration_s: float = 0.0
    message: str = ""  # what went wrong, by rank
    details: str = ""  # tracebacks, stacks and rank logs
    repro: str = ""
    xfail_reason: str = ""
    ranks: list[int] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)  # rank deaths, hangs, leaks, pool restarts

    @property
    def unexpected(self) -> bool:
        return self.status in ("failed", "error")


def run_phase(ctx: RankContext, *, case_id: str, phase: int, impl: str, workdir: str):
    """Task entry point on every rank: run one phase of one case."""
    from .context import CaseContext

    case = by_id()[case_id]
    c = CaseContext(ctx, case, phase, load_adapter(impl), workdir)
    spec = case.phases[phase]
    return spec.fn(c, **spec.params)


def repro_command(impl: str, case_id: str, timeout: float | None, torchrun_nproc: int | None = None) -> str:
    launcher = f"torchrun --nproc-per-node {torchrun_nproc} -m conformance" if torchrun_nproc else "python -m conformance"
    cmd = f"{launcher} --impl {shlex.quote(impl)} -k {shlex.quote(case_id)}"
    if timeout is not None:
        cmd += f" --timeout {timeout:g}"
    return cmd


def _group_by_message(results: list[RankResult]) -> list[tuple[list[int], RankResult]]:
    groups: dict[tuple, tuple[list[int], RankResult]] = {}
    for r in results:
        if r.status == "passed":
            continue
        key = (r.status, r.exc_type, r.message)
        groups.setdefault(key, ([], r))[0].append(r.rank)
    return list(groups.values())


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def headline(message: str) -> str:
    """An exception message without the remote traceback some libraries embed in it."""
    if "Traceback (most recent call last)" not in message:
        return message
    lines = [line for line in message.splitlines() if line.strip()]
    return f"{lines[0]} ... {lines[-1].strip()}" if len(lines) > 1 else message


def describe_outcome(outcome: TaskOutcome, phase_label: str) -> tuple[str, str, list[int]]:
    """(message, details, ranks named) for a phase that did not pass."""
    lines, details, named = [], [], []
    for ranks, r in _group_by_message(outcome.results):
        named += ranks
        what = {"raised": r.exc_type or "error", "died": "died", "timeout": "timeout", "stuck": "stuck", "n/a": "n/a"}.get(r.status, r.status)
        lines.append(f"{phase_label}{_ranks(ranks)}: {what}: {headline(r.message)}")
        if headline(r.message) != r.message:
            details.append(f"--- full message ({_ranks(ranks)}) ---\n{r.message}")
        if r.traceback:
            details.append(f"--- traceback ({_ranks(ranks)}) ---\n{r.traceback}")
    for r in outcome.results:
        if r.stacks:
            details.append(f"--- stacks of rank {r.rank} ({r.status}) ---\n{r.stacks}")
        if r.log.strip() and r.status != "passed":
            details.append(f"--- output of rank {r.rank} ---\n{r.log}")
    lines += [f"{phase_label}{note}" for note in outcome.notes]
    return "\n".join(lines), "\n".join(details), sorted(set(named))


class WorldLost(RuntimeError):
    """Under torchrun, a rank stopped answering: no further case can run."""


class Runner:
    """Runs cases one after another and reports each as it finishes."""

    def __init__(
        self,
        impl: str,
        *,
        timeout: float | None = None,
        xfails: Xfails | None = None,
        world: ExistingWorld | None = None,
        pools: PoolSet | None = None,
        workdir: str | None = None,
    ):
        self.impl = impl
        self.adapter = load_adapter(impl)
        self.timeout = timeout
        self.xfails = xfails
        self.world = world
        self.pools = pools
        self.workdir = workdir
        self.lost = ""  # set when the torchrun world stopped answering

    def applicability(self, case: Case) -> str:
        """Why ``case`` cannot run here, or "" when it can."""
        if not self.adapter.claims(case.profile):
            return f"{self.adapter.name} does not claim the {case.profile!r} profile"
        if self.world is not None:
            if any(ws != self.world.world_size for ws in case.world_sizes):
                sizes = "/".join(map(str, case.world_sizes))
                return f"needs world size {sizes}; the torchrun world has {self.world.world_size}"
        return ""

    def run_case(self, case: Case) -> CaseResult | None:
        """Run every phase; under torchrun only rank 0 gets a result."""
        deadline = self.timeout if self.timeout is not None else case.deadline_s
        repro = repro_command(self.impl, case.id, self.timeout, self.world.world_size if self.world else None)
        reason = self.applicability(case)
        if reason:
            if self.world is not None and self.world.rank != 0:
                return None  # rank 0 reports
            return self._finish(CaseResult(case, "n/a", message=reason, repro=repro))
        start = time.monotonic()
        workdir = self._case_dir(case)
        status, message, details, ranks = "passed", "", "", []
        faults: dict[str, int] = {}
        notes: list[str] = []
        try:
            for i, phase in enumerate(case.phases):
                task = Task("conformance.runner:run_phase", {"case_id": case.id, "phase": i, "impl": self.impl, "workdir": workdir}, name=case.id)
                if self.world is not None:
                    outcome = self.world.run(task, deadline)
                    if outcome is None:
                        continue  # not rank 0: rank 0 reports
                    if outcome.recycled:
                        self.lost = outcome.recycled
                else:
                    outcome = self.pools.run(phase.world_size, task, deadline)
                for kind, n in outcome.faults().items():
                    faults[kind] = faults.get(kind, 0) + n
                if outcome.notes and outcome.status == "passed":
                    notes += outcome.notes
                if outcome.status != "passed":
                    label = f"phase {i + 1}/{len(case.phases)} on {phase.world_size} ranks: " if len(case.phases) > 1 else ""
                    status = outcome.status
                    message, details, ranks = describe_outcome(outcome, label)
                    break
        finally:
            if self.world is None or self.world.rank == 0:
                shutil.rmtree(workdir, ignore_errors=True)
        if self.world is not None and self.world.rank != 0:
            return None
        if notes and not message:
            message = "\n".join(notes)  # e.g. leaked threads: the case passed, the run counts it
        return self._finish(CaseResult(case, status, time.monotonic() - start, message, details, repro, ranks=ranks, faults=faults))

    def _case_dir(self, case: Case) -> str:
        if self.world is None:
            return tempfile.mkdtemp(prefix="conformance-case-", dir=self.workdir)
        # Every rank must name the same directory; it must be on a shared
        # filesystem when the world spans several machines.
        base = self.workdir or os.path.join(tempfile.gettempdir(), f"conformance-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        path = os.path.join(base, hashlib.sha1(case.id.encode()).hexdigest()[:16])
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def _finish(self, result: CaseResult) -> CaseResult:
        entry = self.xfails.match(result.case.id) if self.xfails else None
        if entry is not None:
            if result.status in ("failed", "error"):
                result.status, result.xfail_reason = "xfail", entry.reason
            elif result.status == "passed":
                result.status, result.xfail_reason = "xpass", entry.reason
        return result

    def run(self, cases: Iterable[Case], on_result: Callable[[CaseResult], None] | None = None) -> list[CaseResult]:
        results = []
        for case in cases:
            result = self.run_case(case)
            if result is not None:
                results.append(result)
                if on_result is not None:
                    on_result(result)
            if self.lost:
                raise WorldLost(self.lost)
        return results
