"""``python -m conformance explore``: generated scenarios, drawn within what
the implementation declares, run on the matrix's rank pools, and each
deviation shrunk to a minimal scenario with a replay token
(``conformance.exploring`` draws, runs and shrinks; this is the command)."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ..adapters import AdapterError, load_adapter
from ..exploring.engine import ScenarioRunner, explore
from ..exploring.findings import Exploration, Finding, Verdict, describe_finding, kinds, save_finding
from ..exploring.strategy import ExploreUsageError, choices, parse_budget
from ..running.generated import clause_cases
from ..running.runner import Runner
from ..world.scenario import DRAWN, Scenario
from .common import DEFAULT_IMPL, UsageError, as_command, check_device, int_list, positive


def build_explore_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance explore",
        description="Draw scenarios (model sizes and features, optimizer and groups, layout, mode, steps, a fresh "
        "or warm target) with hypothesis, run the checks of every clause each contains, and shrink each deviation "
        "to a minimal scenario with a replay token.",
        epilog="Exit status: 0 when no scenario deviated, 1 otherwise, 2 for usage errors.",
    )
    p.add_argument(
        "--impl", default=None, help=f"implementation under test (default: $CONFORMANCE_IMPL or {DEFAULT_IMPL})"
    )
    p.add_argument(
        "--world-sizes", type=int_list, help="only layouts of these world sizes, e.g. 1,2 (default: 1,2,3,4)"
    )
    p.add_argument("--json", help="write the JSON report (its 'explore' section) here")
    p.add_argument("--timeout", type=positive, help="per-check deadline in seconds (default: each clause's own)")
    p.add_argument(
        "--deadline-scale",
        type=positive,
        default=float(os.environ.get("CONFORMANCE_DEADLINE_SCALE", "1")),
        help="multiply each check's own deadline (default: $CONFORMANCE_DEADLINE_SCALE or 1); ignored with --timeout",
    )
    p.add_argument("--workdir", help="where scenarios keep checkpoints")
    p.add_argument("--device", default="cpu", help="device every rank computes on (default: cpu)")
    p.add_argument("--backend", default=None, help="process-group backend (default: the device's)")
    add_arguments(p)
    return p


def explore_main(argv: list[str]) -> int:
    parser = build_explore_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    return as_command("python -m conformance explore", _explore, args)


def _explore(args) -> int:
    import shutil

    from hyperdsd.testing import PoolSet, environment_problems, launched_by_torchrun, stop_fork_server

    from ..reporting.reports import RunInfo
    from ..running.runner import Runner

    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise UsageError("exploring needs hypothesis: pip install hypothesis (or hyperdsd[explore])") from None
    if launched_by_torchrun():
        raise UsageError("explore runs its own rank pools; run it with python, not torchrun")
    try:
        check_request(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for problem in environment_problems():
        raise UsageError(problem)
    args.backend = check_device(args.device, args.backend)
    try:
        adapter = load_adapter(args.impl)
    except AdapterError as exc:
        raise UsageError(str(exc)) from None
    gloo_timeout = max(5.0, 0.75 * (args.timeout or 60.0 * args.deadline_scale))
    executor = PoolSet(
        gloo_timeout_s=gloo_timeout,
        device_type=args.device,
        backend=args.backend,
        preload=("conformance.running.runner",),
    )
    workdir = executor.run_workdir(args.workdir, "conformance-explore-")
    runner = Runner(adapter, executor, timeout=args.timeout, workdir=workdir, deadline_scale=args.deadline_scale)
    info = RunInfo(
        adapter.name,
        adapter.version,
        adapter.spec,
        args.world_sizes or [1, 2, 3, 4],
        [],
        launcher=executor.launcher,
        device=args.device,
        backend=args.backend,
        declaration=adapter.declaration(),
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        return run_command(args, adapter, runner, info)
    except KeyboardInterrupt:
        print("\nexploration interrupted; all ranks stopped", file=sys.stderr)
        return 1
    except ExploreUsageError as exc:
        raise UsageError(str(exc)) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        executor.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        stop_fork_server()


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
    ws = args.world_sizes or sorted({lay.world_size for lay in DRAWN.values()})
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
