"""Running and shrinking scenarios: each scenario's clause checks on the
matrix's rank pools (:class:`ScenarioRunner`), its :class:`Verdict`, and the
rounds of hypothesis that draw, run and shrink them until the budget is
spent (:func:`explore`).

A deviation is raised to hypothesis under a signature of its clause and
message, so that hypothesis shrinks each kind of deviation on its own.
Exploration goes in rounds (seed, seed+1, ...): a round ends when hypothesis
has shrunk what it found; later rounds look past deviations already found
(a scenario's checks go on after a check that deviates as before), so they
find others, also those that show only in a later check of a scenario that
deviates as before too, until the budget is spent. Generation stops at
:data:`GENERATE_SHARE` of the budget; what is left shrinks. Hypothesis keeps
no database: ``--seed`` and the budget say what ran, and ``--replay TOKEN``
reruns one scenario exactly.
"""

from __future__ import annotations

import hashlib
import time

from hyperdsd.testing import Status

from ..running.generated import clause_cases
from ..running.results import CaseResult
from ..running.runner import Runner
from ..world.scenario import Scenario
from .findings import Exploration, Finding, Verdict, deviated, replay_command, result_signature
from .strategy import Choices, strategy

GENERATE_SHARE = 0.7  # of the budget: new scenarios; the rest is for shrinking
ROUND_EXAMPLES = 200  # scenarios per hypothesis round at most


class ScenarioRunner:
    """Runs scenarios' clause checks on a :class:`Runner` (its pools, deadlines
    and verdict rules), each check of a scenario once: a scenario run again
    (hypothesis replays the ones it keeps) gets the results it had, and runs
    on past a check whose deviation has since become known (``known``, the
    signatures found so far)."""

    def __init__(self, runner: Runner, only: str | None = None):
        self.runner = runner
        self.only = only  # run this clause's check alone (a replay of a finding filed under it)
        self.known: set[str] = set()
        self.verdicts: dict[Scenario, Verdict] = {}
        self.not_applicable: dict[str, int] = {}
        self._results: dict[Scenario, list[CaseResult]] = {}

    def run(self, s: Scenario) -> Verdict:
        start = time.monotonic()
        results = self._results.setdefault(s, [])
        cases = [c for c in clause_cases(s) if self.only in (None, c.clause)]
        while len(results) < len(cases) and not any(
            deviated(r) and result_signature(r) not in self.known for r in results
        ):
            case = cases[len(results)]
            result = self.runner.run_case(case)
            result.repro = replay_command(self.runner.impl, s, case.clause)
            results.append(result)
            if result.status == Status.NOT_APPLICABLE:
                self.not_applicable[case.clause] = self.not_applicable.get(case.clause, 0) + 1
        verdict = Verdict(s, list(results), time.monotonic() - start, frozenset(self.known))
        self.verdicts[s] = verdict
        return verdict


class _Deviation(Exception):
    """A scenario's deviation, raised to hypothesis; one subclass per signature."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.signature)
        self.verdict = verdict


_KINDS: dict[str, type] = {}


def _deviation(verdict: Verdict) -> _Deviation:
    # Hypothesis tells failures apart by exception type and where it was
    # raised: one type per signature makes it shrink each kind on its own.
    sig = verdict.signature
    kind = _KINDS.get(sig)
    if kind is None:
        kind = _KINDS[sig] = type(f"Deviation_{hashlib.sha1(sig.encode()).hexdigest()[:10]}", (_Deviation,), {})
    return kind(verdict)


def explore(
    scenario_runner: ScenarioRunner,
    ch: Choices,
    *,
    budget_s: float,
    seed: int,
    world_sizes: list[int],
    on_scenario=None,
    on_finding=None,
    max_rounds: int | None = None,
) -> Exploration:
    """Draw, run and shrink scenarios until ``budget_s`` is spent."""
    from hypothesis import given, reject
    from hypothesis import seed as hypothesis_seed

    report = Exploration(seed, budget_s, list(world_sizes))
    start = time.monotonic()
    generate_until = start + GENERATE_SHARE * budget_s
    stop_at = start + budget_s
    known = scenario_runner.known  # the runner looks past these
    scenarios = strategy(ch)

    while time.monotonic() < generate_until and (max_rounds is None or report.rounds < max_rounds):
        round_seed = seed + report.rounds
        report.rounds += 1
        found_this_round: list[str] = []

        def prop(s: Scenario) -> None:
            fresh = s not in scenario_runner.verdicts
            if fresh:
                now = time.monotonic()
                # Past the generation share, only a round that is shrinking runs new scenarios.
                if now >= stop_at or (now >= generate_until and not found_this_round):
                    reject()
            verdict = scenario_runner.run(s)
            if fresh:
                report.ran += 1
                key = verdict.status.value
                report.statuses[key] = report.statuses.get(key, 0) + 1
                if on_scenario is not None:
                    on_scenario(verdict)
            sig = verdict.signature
            if sig is None or sig in known:
                return
            if sig not in found_this_round:
                found_this_round.append(sig)
            raise _deviation(verdict)

        test = _round_settings()(hypothesis_seed(round_seed)(given(scenarios)(prop)))
        raised: list[_Deviation] = []
        try:
            test()
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM: what this round saw, unshrunk, and the report so far.
            report.interrupted = True
            for sig in found_this_round:
                seen = [v for v in scenario_runner.verdicts.values() if v.signature == sig]
                _record(report, known, min(seen, key=lambda v: len(v.scenario.to_json())), on_finding, shrunk=False)
            break
        except BaseException as exc:  # noqa: BLE001 - hypothesis raises what the test raised, grouped
            raised = _deviations_in(exc)
            if not raised:
                raise
        for dev in raised:
            _record(report, known, dev.verdict, on_finding)
        if time.monotonic() >= stop_at:
            break
    report.elapsed_s = time.monotonic() - start
    return report


def _round_settings():
    """A round's hypothesis settings: generate and shrink, nothing kept between runs, quiet."""
    from hypothesis import HealthCheck, Phase, Verbosity, settings

    return settings(
        database=None,
        deadline=None,
        max_examples=ROUND_EXAMPLES,
        phases=(Phase.generate, Phase.shrink),
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=True,
        verbosity=Verbosity.quiet,
        print_blob=False,
        derandomize=False,
    )


def _record(report: Exploration, known: set, verdict, on_finding, shrunk: bool = True) -> None:
    """A finding of a cause not known yet, once."""
    if verdict.signature in known:
        return
    known.add(verdict.signature)
    finding = Finding(verdict, shrunk=shrunk)
    report.findings.append(finding)
    if on_finding is not None:
        on_finding(finding)


def _deviations_in(exc: BaseException) -> list[_Deviation]:
    if isinstance(exc, _Deviation):
        return [exc]
    group = getattr(exc, "exceptions", None)  # an exception group (Python 3.11, or hypothesis's backport)
    if isinstance(group, (list, tuple)):
        return [d for e in group for d in _deviations_in(e)]
    return []
