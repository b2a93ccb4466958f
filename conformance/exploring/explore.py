"""``python -m conformance explore``: generated scenarios, shrunk to a minimal repro.

Hypothesis draws :class:`~conformance.exploring.scenario.Scenario` values within what
the adapter declares (:func:`choices`), each runs the checks of the clauses
it exercises on the same warm rank pools, oracle and deadlines as the matrix
(:class:`ScenarioRunner`), and a deviation is raised to hypothesis under a
signature of its clause and message, so that hypothesis shrinks each kind of
deviation on its own. Exploration goes in rounds (seed, seed+1, ...): a
round ends when hypothesis has shrunk what it found; later rounds look past
deviations already found (a scenario's checks go on after a check that
deviates as before), so they find others, also those that show only in a
later check of a scenario that deviates as before too, until the budget
is spent. Generation stops at :data:`GENERATE_SHARE` of the budget;
what is left shrinks. Hypothesis keeps no database: ``--seed`` and the
budget say what ran, and ``--replay TOKEN`` reruns one scenario exactly.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field, replace

from hyperdsd.testing import Status

from ..adapters import MODES
from ..running.results import CaseResult
from ..running.runner import Runner, undeclared
from ..world.layouts import parse_layout
from ..world.loops import POINTS
from ..world.policies import VARIANTS
from .scenario import (
    DTYPES,
    EXTRA_STATE,
    GROUP_ORDERS,
    LAYOUTS,
    MODEL_KEYS,
    MODEL_KEYS_MODES,
    OPTIMIZERS,
    Scenario,
    clause_cases,
    found_record,
    reshard_problems,
    scenario_case,
    write_found,
)

GENERATE_SHARE = 0.7  # of the budget: new scenarios; the rest is for shrinking
ROUND_EXAMPLES = 200  # scenarios per hypothesis round at most


class ExploreUsageError(ValueError):
    """A request exploration cannot serve (a budget that does not parse, nothing declared to draw)."""


def parse_budget(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1h`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise ExploreUsageError(f"expected a budget such as 90s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


# -- what may be drawn ----------------------------------------------------------


@dataclass(frozen=True)
class Choices:
    """What scenarios may contain for one adapter and set of world sizes."""

    modes_of: tuple[tuple[str, tuple[str, ...]], ...]  # (layout, modes declared on it), simplest first
    optimizers: tuple[str, ...] = OPTIMIZERS
    policies: tuple[str, ...] = ()  # FSDP2 policy variants, where the adapter declares the layout "policies"

    @property
    def layouts(self) -> tuple[str, ...]:
        return tuple(layout for layout, _ in self.modes_of)

    def modes(self, layout: str) -> tuple[str, ...]:
        return dict(self.modes_of)[layout]


def choices(adapter, world_sizes) -> Choices:
    """The layouts and modes whose round trip the adapter declares (SPEC §1),
    on the world sizes given: the same rule as the matrix's (registry.needs_of)."""
    allowed = set(world_sizes)
    modes_of = []
    for layout in LAYOUTS:
        if parse_layout(layout).world_size not in allowed:
            continue
        modes = tuple(
            m for m in MODES if not undeclared(adapter, scenario_case(Scenario(layout=layout, mode=m), "OPT-RT-1"))
        )
        if modes:
            modes_of.append((layout, modes))
    if not modes_of:
        raise ExploreUsageError(f"{adapter.name} declares no round trip on a layout of world sizes {sorted(allowed)}")
    # reshard_after_forward=2 makes fully_shard build a mesh, and so process
    # groups torch never frees, at every call: hundreds of draws would leave a
    # rank with thousands of threads. The matrix runs it in a bounded number of cases.
    drawn = tuple(v for v in VARIANTS if v != "reshard2") if "policies" in adapter.layouts else ()
    return Choices(tuple(modes_of), policies=drawn)


def strategy(ch: Choices):
    """A hypothesis strategy of scenarios within ``ch``; each field shrinks
    towards the base model (fewer layers, smaller dims, features off, the
    first layout, mode and optimizer, fewer steps, a fresh target)."""
    from hypothesis import strategies as st

    @st.composite
    def scenarios(draw):
        layout = draw(st.sampled_from(ch.layouts))
        mode = draw(st.sampled_from(ch.modes(layout)))
        optimizer = draw(st.sampled_from(ch.optimizers))
        pp = parse_layout(layout).pp
        n_layers = draw(st.integers(max(1, pp), 3))
        dim = draw(st.integers(1, 9))
        hidden = draw(st.integers(1, 12))
        vocab = draw(st.integers(2, 16))
        aux_out = draw(st.integers(1, 5))
        dtype = draw(st.sampled_from(DTYPES))
        # Every draw is made whatever the others gave, and ignored where it
        # does not apply: the choices stay aligned, so hypothesis can turn
        # one off (a pipeline, one group) without shifting the rest.
        tie = draw(st.booleans()) and pp == 1
        lazy, frozen, adapter, router = (draw(st.booleans()) for _ in range(4))
        extra_state = draw(st.sampled_from(EXTRA_STATE))
        one_group = draw(st.booleans())
        empty_at = tuple(sorted(draw(st.sets(st.integers(0, 5), max_size=3))))
        router_group = draw(st.booleans()) and router and not one_group
        custom_fields = draw(st.booleans())
        scale = draw(st.sampled_from((1.0, 0.5, 2.0)))
        scheduler = draw(st.booleans())
        before = draw(st.sampled_from((1, 2, 0, 3)))
        after = draw(st.sampled_from((1, 2)))
        warm = draw(st.sampled_from((0, 1, 2)))
        reshard = draw(st.booleans())
        target = draw(st.sampled_from(ch.layouts))
        model_keys = draw(st.sampled_from(MODEL_KEYS))
        group_order = draw(st.sampled_from(GROUP_ORDERS))
        policy = draw(st.sampled_from(("",) + ch.policies))
        loop_point = draw(st.sampled_from(("",) + tuple(POINTS)))
        freeze_after = draw(st.booleans())
        s = Scenario(
            layout=layout,
            mode=mode,
            optimizer=optimizer,
            vocab=vocab,
            dim=dim,
            hidden=hidden,
            n_layers=n_layers,
            aux_out=aux_out,
            dtype=dtype,
            tie=tie,
            lazy=lazy,
            frozen=frozen,
            adapter=adapter,
            router=router,
            extra_state=extra_state,
            one_group=one_group,
            empty_at=empty_at,
            router_group=router_group,
            custom_fields=custom_fields,
            scale=scale,
            scheduler=scheduler,
            before=before,
            after=after,
            warm=warm,
            group_order=group_order,
        )
        if model_keys and mode in MODEL_KEYS_MODES and pp == 1:
            s = replace(s, model_keys=model_keys)
        for extra in ({"policy": policy}, {"loop_point": loop_point}, {"freeze_after": freeze_after}):
            drawn = replace(s, **extra)
            try:
                drawn.validate()
            except ValueError:
                continue  # not on this layout, or not with what was drawn before
            s = drawn
        if reshard:
            resharded = replace(s, reshard_to=target)
            if not reshard_problems(resharded):
                return resharded
        return s

    return scenarios()


# -- running a scenario ---------------------------------------------------------


def _deviated(r: CaseResult) -> bool:
    return r.status in (Status.FAILED, Status.ERROR)


def result_signature(r: CaseResult) -> str:
    """The kind of a check's deviation: its status, clause and message with the particulars left out."""
    return f"{r.status.value} {r.case.clause}: {normalise(r.message)}"


@dataclass
class Verdict:
    """What one scenario came to: the first clause whose check did not pass
    with a deviation not already known (checks run most specific first and
    stop there), else the first that did not pass; and the results of the
    checks that ran."""

    scenario: Scenario
    results: list[CaseResult]
    duration_s: float = 0.0
    known: frozenset[str] = frozenset()  # signatures already found when it was judged

    @property
    def bad(self) -> CaseResult | None:
        bad = [r for r in self.results if _deviated(r)]
        return next((r for r in bad if result_signature(r) not in self.known), bad[0] if bad else None)

    @property
    def status(self) -> Status:
        bad = self.bad
        if bad is not None:
            return bad.status
        if self.results and all(r.status == Status.NOT_APPLICABLE for r in self.results):
            return Status.NOT_APPLICABLE
        return Status.PASSED

    @property
    def clause(self) -> str | None:
        return self.bad.case.clause if self.bad else None

    @property
    def message(self) -> str:
        return self.bad.message if self.bad else ""

    @property
    def signature(self) -> str | None:
        """The kind of deviation: its status, clause and message with the
        particulars (numbers, names) left out; None when nothing deviated."""
        bad = self.bad
        return None if bad is None else result_signature(bad)


def normalise(message: str) -> str:
    """A message's gist: its first line and what its first detail says,
    once ranks, numbers, quoted names, where in the state it was and what
    follows a value difference are left out, so that two scenarios
    deviating alike have one signature whatever their sizes and whichever
    entry shows it first (hypothesis shrinks within one signature)."""
    out: list[str] = []
    for line in message.splitlines():
        detail = line[:1].isspace()
        line = re.sub(r"\branks? [\d,]+", "rank N", line)
        line = re.sub(r"'[^']*'", "'.'", line)
        if detail:  # "  state['x']['step']: values differ ..." -> "values differ ..."
            line = re.sub(r"^\s*[\w.]*(\[[^\]]*\])+:\s*", "", line)
        line = re.sub(r"(values differ|received|expected a|dtype|shape) .*", r"\1 ...", line)
        line = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", line).strip()
        line = re.sub(r"N(, ?N)+", "N", line)  # lists of ranks or sizes, whatever their length
        if line and line not in out:
            out.append(line)
        if len(out) == 2:
            break
    return " | ".join(out)[:300]


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
            _deviated(r) and result_signature(r) not in self.known for r in results
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


def replay_command(impl: str, s: Scenario, clause: str | None = None) -> str:
    """The command that runs ``s`` again (``clause``'s check alone, when given), and nothing else."""
    import shlex

    only = f" --clause {clause}" if clause else ""
    return f"python -m conformance explore --impl {shlex.quote(impl)} --replay {s.token}{only}"


# -- exploring -------------------------------------------------------------------


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


@dataclass
class Finding:
    verdict: Verdict
    saved_to: str | None = None
    shrunk: bool = True  # False: seen as the run was interrupted, before hypothesis shrank it

    @property
    def scenario(self) -> Scenario:
        return self.verdict.scenario

    def to_json(self, impl: str) -> dict:
        v = self.verdict
        bad = v.bad
        return {
            "clause": v.clause,
            "status": v.status.value,
            "signature": v.signature,
            "message": v.message,
            "ranks": bad.ranks if bad else [],
            "scenario": self.scenario.to_dict(),
            "description": self.scenario.describe(),
            "token": self.scenario.token,
            "repro": replay_command(impl, self.scenario, v.clause),
            "saved_to": self.saved_to,
            "shrunk": self.shrunk,
        }


@dataclass
class Exploration:
    seed: int
    budget_s: float
    world_sizes: list[int]
    ran: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False

    @property
    def per_minute(self) -> float:
        return 60.0 * self.ran / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def by_clause(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.verdict.clause] = out.get(f.verdict.clause, 0) + 1
        return dict(sorted(out.items()))

    def to_json(self, impl: str) -> dict:
        return {
            "ran": self.ran,
            "rounds": self.rounds,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "seed": self.seed,
            "world_sizes": self.world_sizes,
            "scenarios_per_minute": round(self.per_minute, 2),
            "statuses": dict(sorted(self.statuses.items())),
            "failures_by_clause": self.by_clause(),
            "complete": not self.interrupted,
            "findings": [f.to_json(impl) for f in self.findings],
        }


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
    from hypothesis import HealthCheck, Phase, Verbosity, given, reject, settings
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

        test = settings(
            database=None,
            deadline=None,
            max_examples=ROUND_EXAMPLES,
            phases=(Phase.generate, Phase.shrink),
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=True,
            verbosity=Verbosity.quiet,
            print_blob=False,
            derandomize=False,
        )(hypothesis_seed(round_seed)(given(scenarios)(prop)))
        raised: list[_Deviation] = []
        try:
            test()
        except KeyboardInterrupt:
            # Ctrl-C or SIGTERM: what this round saw, unshrunk, and the report so far.
            report.interrupted = True
            for sig in found_this_round:
                if sig not in known:
                    seen = [v for v in scenario_runner.verdicts.values() if v.signature == sig]
                    known.add(sig)
                    finding = Finding(min(seen, key=lambda v: len(v.scenario.to_json())), shrunk=False)
                    report.findings.append(finding)
                    if on_finding is not None:
                        on_finding(finding)
            break
        except BaseException as exc:  # noqa: BLE001 - hypothesis raises what the test raised, grouped
            raised = _deviations_in(exc)
            if not raised:
                raise
        for dev in raised:
            sig = dev.verdict.signature
            if sig in known:
                continue
            known.add(sig)
            finding = Finding(dev.verdict)
            report.findings.append(finding)
            if on_finding is not None:
                on_finding(finding)
        if time.monotonic() >= stop_at:
            break
    report.elapsed_s = time.monotonic() - start
    return report


def kinds(findings: list[Finding]) -> dict[str, list[Finding]]:
    """Findings grouped by their signature with the mode left out: one
    deviation found in several modes is one line of the summary."""
    out: dict[str, list[Finding]] = {}
    for f in findings:
        key = f.verdict.signature.replace(f" {f.scenario.mode}: ", " ", 1)
        out.setdefault(key, []).append(f)
    return out


def _deviations_in(exc: BaseException) -> list[_Deviation]:
    if isinstance(exc, _Deviation):
        return [exc]
    group = getattr(exc, "exceptions", None)  # an exception group (Python 3.11, or hypothesis's backport)
    if isinstance(group, (list, tuple)):
        return [d for e in group for d in _deviations_in(e)]
    return []


# -- the command ----------------------------------------------------------------


def describe_finding(f: Finding, impl: str) -> str:
    v = f.verdict
    bad = v.bad
    ranks = f" on ranks {bad.ranks}" if bad and bad.ranks else ""
    lines = [
        f"{v.status.value.upper()} {v.clause}{ranks}",
        f"  scenario ({'shrunk' if f.shrunk else 'not shrunk: the run was interrupted'}):",
        *("    " + line for line in f.scenario.describe().splitlines()),
        "  what differed:",
        *("    " + line for line in v.message.splitlines()[:12]),
        f"  replay: {replay_command(impl, f.scenario, v.clause)}",
    ]
    if f.saved_to:
        lines.append(f"  saved as case {json.load(open(f.saved_to))['id']} in {f.saved_to}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    p.add_argument("--budget", default="10m", help="how long to explore: 90s, 10m, 1h (default 10m)")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed of the first round (default 0)")
    p.add_argument("--replay", metavar="TOKEN", help="run the scenario of this replay token, and nothing else")
    p.add_argument(
        "--clause",
        metavar="CLAUSE",
        help="with --replay: run only this clause's check of the scenario (a finding's repro names the clause "
        "it was filed under, which may come after a check that deviated as an earlier finding did)",
    )
    p.add_argument(
        "--save-found",
        metavar="DIR",
        help="write each shrunk deviation as a case file here (load them with $CONFORMANCE_FOUND=DIR)",
    )
    p.add_argument("--rounds", type=int, default=None, help="stop after this many rounds (default: the budget)")


def save_finding(directory: str, f: Finding, impl: str) -> str:
    v = f.verdict
    record = found_record(v.clause, f.scenario, impl=impl, status=v.status.value, message=v.message)
    return write_found(directory, record)


def check_request(args) -> None:
    """Raise ExploreUsageError (a ValueError) for a request the command cannot
    serve, before any rank starts: a usage error costs no pool."""
    parse_budget(args.budget)
    if args.clause and not args.replay:
        raise ExploreUsageError("--clause goes with --replay")
    if args.replay:
        s = Scenario.from_token(args.replay)
        if args.clause and not any(c.clause == args.clause for c in clause_cases(s)):
            raise ExploreUsageError(
                f"--clause {args.clause}: not a clause the scenario exercises "
                f"({', '.join(c.clause for c in clause_cases(s))})"
            )


def run_command(args, adapter, runner: Runner, info) -> int:
    """The explore command, on a runner the CLI set up (after check_request); returns the exit status."""
    impl = adapter.spec
    sr = ScenarioRunner(runner, only=args.clause)
    if args.replay:
        s = Scenario.from_token(args.replay)
        described = "\n".join("  " + x for x in s.describe().splitlines())
        print(f"replaying {s.digest} against {adapter.name}:\n{described}")
        verdict = sr.run(s)
        for r in verdict.results:
            print(f"  {r.case.clause}: {r.status.value}" + (f"\n    {r.message}" if r.message else ""))
        print(f"verdict: {verdict.status.value}" + (f" ({verdict.clause})" if verdict.clause else ""))
        if args.json:
            _write(args.json, info, impl, None, [Finding(verdict)] if verdict.bad else [], verdict)
        return 1 if verdict.bad else 0
    ws = args.world_sizes or sorted({parse_layout(x).world_size for x in LAYOUTS})
    ch = choices(adapter, ws)
    budget = parse_budget(args.budget)
    print(
        f"exploring {adapter.name} for {budget:g}s, seed {args.seed}, world sizes {ws}: "
        f"{len(ch.layouts)} layouts, up to {max(len(ch.modes(x)) for x in ch.layouts)} modes"
    )

    def on_scenario(v: Verdict) -> None:
        mark = {"passed": ".", "failed": "F", "error": "E", "n/a": "s"}.get(v.status.value, "?")
        print(mark, end="", flush=True)

    def on_finding(f: Finding) -> None:
        if args.save_found:
            f.saved_to = save_finding(args.save_found, f, impl)
        print("\n" + describe_finding(f, impl), flush=True)

    report = explore(
        sr,
        ch,
        budget_s=budget,
        seed=args.seed,
        world_sizes=ws,
        on_scenario=on_scenario,
        on_finding=on_finding,
        max_rounds=args.rounds,
    )
    if report.interrupted:
        print("\nexploration interrupted: the report covers what ran; all ranks stopped")
    print(
        f"\n{report.ran} scenarios in {report.elapsed_s:.0f}s ({report.per_minute:.1f} per minute), "
        f"{report.rounds} rounds; {len(report.findings)} deviations"
        + (f": {', '.join(f'{k} {n}' for k, n in report.by_clause().items())}" if report.findings else "")
    )
    for kind, found in kinds(report.findings).items():
        modes = sorted({f.scenario.mode for f in found})
        print(f"  {len(found)} x {kind} (modes {', '.join(modes)})")
    if args.json:
        _write(args.json, info, impl, report, report.findings, None)
    return 1 if report.findings or report.interrupted else 0


def _write(path: str, info, impl: str, report: Exploration | None, findings, replayed: Verdict | None) -> None:
    from ..reporting.reports import write_json

    section = report.to_json(impl) if report else {"replay": True, "findings": [f.to_json(impl) for f in findings]}
    if replayed is not None:
        section["verdict"] = replayed.status.value
        section["scenario"] = replayed.scenario.to_dict()
    write_json(path, {**info.header(), "explore": section})
