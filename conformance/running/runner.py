"""Runs cases: each phase as a task on an executor (spawned pools or the
torchrun world), one verdict per case, expected failures applied.

Whether a case applies here is decided in one place,
:meth:`Runner.applicability`; the pytest plugin and the CLI both ask it.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import time
from typing import Callable, Iterable

from hyperdsd.testing import REGIONS, Executor, RankContext, Status, Task, TaskOutcome

from .. import tensors
from ..adapters import Adapter, load_adapter, set_rank_device
from ..judging.naming import cut, name_tensors
from .generated import case_from_source
from .registry import Case, by_id
from .results import CaseResult
from .xfails import Xfails


def run_phase(
    ctx: RankContext,
    *,
    case_id: str,
    phase: int,
    impl: str,
    workdir: str,
    deadline_s: float = 60.0,
    source: str | None = None,
):
    """Task entry point on every rank: run one phase of one case (``deadline_s``:
    the phase's; ``source``: a generated case, rebuilt from its scenario)."""
    from .case_context import CaseContext

    if source is not None:
        case = case_from_source(source)
    else:
        case = by_id()[case_id]
    set_rank_device(ctx.device)
    adapter = load_adapter(impl)
    tensors.use(adapter.tensors)  # how this rank reads the implementation's distributed values (SPEC 1.6)
    c = CaseContext(ctx, case, phase, adapter, workdir, deadline_s)
    spec = case.phases[phase]
    try:
        return spec.fn(c, **spec.params)
    except BaseException as exc:
        c.name_tensors(exc)
        failure = c.stumbled(exc) if isinstance(exc, Exception) else None
        if failure is None:
            c.note_changes(exc)
            raise
        raise failure from exc


def repro_command(impl: str, case_id: str, timeout: float | None, prefix: str = "python -m conformance") -> str:
    cmd = f"{prefix} --impl {shlex.quote(impl)} -k {shlex.quote(case_id)}"
    if timeout is not None:
        cmd += f" --timeout {timeout:g}"
    return cmd


def describe_outcome(outcome: TaskOutcome, phase_label: str) -> tuple[str, str, list[int]]:
    """(message, details, ranks named) for a phase that did not pass."""
    lines = [f"{phase_label}{line}" for line in outcome.describe().splitlines()]
    named = sorted({r.rank for r in outcome.results if r.status != Status.PASSED})
    details = []
    for r in outcome.results:
        if r.traceback:
            details.append(f"--- traceback of rank {r.rank} ---\n{r.traceback}")
        if r.stacks:
            details.append(f"--- stacks of rank {r.rank} ({r.status}) ---\n{r.stacks}")
        if r.log.strip() and r.status != Status.PASSED:
            details.append(f"--- output of rank {r.rank} ---\n{r.log}")
    # Reports name tensors, never print them, and stay readable (SPEC §4, 1.4).
    message = cut(name_tensors("\n".join(lines)))
    return message, cut(name_tensors("\n".join(details)), max_lines=2000, max_chars=200_000), named


def undeclared(adapter: Adapter, case: Case) -> str:
    """Why ``adapter``'s declaration (SPEC §1) rules ``case`` out, or ""."""
    if not adapter.claims(case.profile):
        return f"{adapter.name} does not claim the {case.profile!r} profile"
    lacking = adapter.lacks(case.needs)
    return f"{adapter.name} does not declare {', '.join(lacking)}" if lacking else ""


class Runner:
    """Runs cases one after another and reports each as it finishes."""

    def __init__(
        self,
        adapter: Adapter,
        executor: Executor,
        *,
        timeout: float | None = None,
        xfails: Xfails | None = None,
        workdir: str | None = None,
        deadline_scale: float = 1.0,
    ):
        self.adapter = adapter
        self.executor = executor
        self.timeout = timeout
        # Cases' own deadlines times this (a slow machine's test run); an
        # explicit ``timeout`` is taken as given.
        self.deadline_scale = deadline_scale
        self.xfails = xfails
        # Every rank of a case must see its directory: under torchrun every
        # rank names the same one (on a shared filesystem across machines).
        self._own_workdir = workdir is None
        self.workdir = workdir or executor.run_workdir(None, "conformance-")
        self.current: Case | None = None

    @property
    def impl(self) -> str:
        return self.adapter.spec

    def applicability(self, case: Case) -> str:
        """Why ``case`` cannot run here, or "" when it can."""
        return undeclared(self.adapter, case) or self.executor.unfit(case.world_sizes)

    def repro(self, case: Case) -> str:
        return repro_command(self.impl, case.id, self.timeout, self.executor.repro_prefix)

    def run_case(self, case: Case) -> CaseResult | None:
        """Run every phase; a process that does not report gets None."""
        reason = self.applicability(case)
        if reason:
            if not self.executor.reporter:
                return None
            return self._finish(CaseResult(case, Status.NOT_APPLICABLE, message=reason, repro=self.repro(case)))
        self.current = case
        start = time.monotonic()
        workdir = self._case_dir(case)
        status, message, details, ranks = Status.PASSED, "", "", []
        faults: dict[str, int] = {}
        notes: list[str] = []
        try:
            for i, phase in enumerate(case.phases):
                deadline = self.timeout if self.timeout is not None else case.deadline_s * self.deadline_scale
                args = {"case_id": case.id, "phase": i, "impl": self.impl, "workdir": workdir, "deadline_s": deadline}
                if case.source is not None:
                    args["source"] = case.source
                task = Task(
                    run_phase,
                    args,
                    name=case.id,
                    scope=REGIONS,
                )
                outcome = self.executor.run(phase.world_size, task, deadline)
                if outcome is None:
                    continue  # another process reports
                for kind, n in outcome.faults().items():
                    faults[kind] = faults.get(kind, 0) + n
                if outcome.notes and outcome.status == Status.PASSED:
                    notes += outcome.notes
                if outcome.status != Status.PASSED:
                    status = outcome.status
                    label = (
                        f"phase {i + 1}/{len(case.phases)} on {phase.world_size} ranks: "
                        if len(case.phases) > 1
                        else ""
                    )
                    message, details, ranks = describe_outcome(outcome, label)
                    break
        finally:
            self.current = None
            if self.executor.reporter:
                shutil.rmtree(workdir, ignore_errors=True)
        if not self.executor.reporter:
            return None
        if notes and not message:
            message = "\n".join(notes)  # e.g. leaked threads: the case passed, the run counts it
        return self._finish(
            CaseResult(
                case, status, time.monotonic() - start, message, details, self.repro(case), ranks=ranks, faults=faults
            )
        )

    def result_of_hang(self, case: Case, outcome: TaskOutcome) -> CaseResult:
        """The verdict on a case whose ranks, the reporting one included, hung."""
        message, details, ranks = describe_outcome(outcome, "")
        return self._finish(
            CaseResult(
                case,
                outcome.status,
                outcome.duration_s,
                message,
                details,
                self.repro(case),
                ranks=ranks,
                faults=outcome.faults(),
            )
        )

    def _case_dir(self, case: Case) -> str:
        path = os.path.join(self.workdir, hashlib.sha1(case.id.encode()).hexdigest()[:16])
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def _finish(self, result: CaseResult) -> CaseResult:
        entry = self.xfails.match(result.case.id) if self.xfails else None
        if entry is not None:
            if result.status.unexpected:
                result.status, result.xfail_reason = Status.XFAIL, entry.reason
            elif result.status == Status.PASSED:
                result.status, result.xfail_reason = Status.XPASS, entry.reason
        return result

    def close(self) -> None:
        """Remove the run's directory if this runner made it."""
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def run(
        self, cases: Iterable[Case], on_result: Callable[[CaseResult], None] | None = None, exitfirst: bool = False
    ) -> list[CaseResult]:
        """Run ``cases`` in order; with ``exitfirst``, stop after the first unexpected verdict."""
        results = []
        for case in cases:
            result = self.run_case(case)
            if result is not None:
                results.append(result)
                if on_result is not None:
                    on_result(result)
                if exitfirst and result.unexpected:
                    break
        return results
