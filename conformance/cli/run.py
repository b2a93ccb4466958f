"""``python -m conformance``: run the matrix against an implementation."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from ..adapters import AdapterError, load_adapter
from ..running.registry import all_cases, select
from .common import DEFAULT_IMPL, UsageError, as_command, check_device, count, int_list, positive


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Run the distributed state-dict conformance matrix (SPEC.md) against an implementation.",
        epilog="Exit status: 0 when nothing failed or errored unexpectedly, 1 otherwise, 2 for usage errors. "
        "'python -m conformance diff OLD.json NEW.json' compares two runs' JSON reports; "
        "'python -m conformance explore --impl X' explores generated scenarios (see explore --help).",
    )
    p.add_argument(
        "--impl",
        default=None,
        help="implementation under test: hyperdsd, torch, some.module or some.module:attr "
        f"(default: $CONFORMANCE_IMPL or {DEFAULT_IMPL})",
    )
    p.add_argument("--world-sizes", type=int_list, help="only cases whose world sizes are all in this list, e.g. 1,2,4")
    p.add_argument("--mesh", action="append", default=[], help="only cases on these meshes (repeatable): 4, 2x2, ...")
    p.add_argument(
        "-k", dest="patterns", action="append", default=[], help="only cases whose ID contains this text (repeatable)"
    )
    p.add_argument("--xfails", help="expected failures: lines 'CASE_ID_OR_PREFIX  # reason, link'")
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--junit", help="write a JUnit XML report here")
    p.add_argument(
        "--report", metavar="DIR", help="write report.json, junit.xml, report.html and report.md (the certificate) here"
    )
    p.add_argument(
        "--explore-report",
        metavar="JSON",
        help="with --report: include this exploration's JSON report (python -m conformance explore --json) "
        "in the certificate",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print the manifest of selected cases and exit; with --impl, whether each would run for it and why not",
    )
    p.add_argument(
        "-x",
        "--exitfirst",
        action="store_true",
        help="stop after the first case that fails or errors (not under torchrun)",
    )
    p.add_argument("--timeout", type=positive, help="per-case deadline in seconds (default: each case's own, 60 s)")
    p.add_argument(
        "--deadline-scale",
        type=positive,
        default=float(os.environ.get("CONFORMANCE_DEADLINE_SCALE", "1")),
        help="multiply each case's own deadline, for a slow or busy machine (default: $CONFORMANCE_DEADLINE_SCALE "
        "or 1); ignored with --timeout",
    )
    p.add_argument(
        "--workdir", help="where cases keep checkpoints (must be shared by all nodes under multi-node torchrun)"
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="device every rank computes on: cpu (default), cuda, or another torch device type",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="process-group backend: gloo (default on cpu), nccl (default on cuda), or another by name",
    )
    p.add_argument(
        "--repeat",
        type=count,
        default=1,
        metavar="N",
        help="a soak: run the selection N times in the same rank processes and report every case whose verdict "
        "changed between runs (exit status 1 if one did); the reports hold the last run",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks, stacks and rank output of failures")
    return p


def run_main(argv: list[str]) -> int:
    """The matrix command: parse ``argv``, run, report; the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    args.impl_given = args.impl is not None
    args.explored = None
    if args.explore_report:
        try:
            with open(args.explore_report) as f:
                args.explored = json.load(f)["explore"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            print(
                f"python -m conformance: error: --explore-report {args.explore_report}: not an exploration's JSON "
                f"report ({type(exc).__name__}: {exc})",
                file=sys.stderr,
            )
            return 2
    return as_command("python -m conformance", _run, args)


def _run(args) -> int:
    cases = select(all_cases(), patterns=args.patterns, world_sizes=args.world_sizes, meshes=args.mesh or None)
    if args.mesh:
        from hyperdsd.testing import parse_mesh

        for m in args.mesh:
            try:
                parse_mesh(m)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    if args.list:
        return _list(args, cases)
    if not cases:
        raise UsageError("no case matches the selection (see --list)")
    from hyperdsd.testing import environment_problems

    for problem in environment_problems():
        raise UsageError(problem)
    args.backend = check_device(args.device, args.backend)
    try:
        adapter = load_adapter(args.impl)
    except AdapterError as exc:
        raise UsageError(str(exc)) from None

    xfails = None
    warnings: list[str] = []
    if args.xfails:
        from ..running.xfails import Xfails

        try:
            xfails = Xfails.load(args.xfails)
        except OSError as exc:
            raise UsageError(f"cannot read --xfails {args.xfails}: {exc}") from None
        xfails.mark_selected([c.id for c in all_cases()])
        warnings += [f"{xfails.source}:{e.line}: xfail entry {e.pattern!r} matches no case" for e in xfails.unmatched()]

    from hyperdsd.testing import stop_fork_server

    try:
        return _run_cases(args, cases, adapter, xfails, warnings)
    finally:
        stop_fork_server()  # in every ending, nothing the run started outlives it


def _list(args, cases) -> int:
    """The manifest; with ``--impl`` given, whether each case would run for it and why not (SPEC §1)."""
    adapter = None
    if args.impl_given:
        try:
            adapter = load_adapter(args.impl)
        except AdapterError as exc:
            raise UsageError(str(exc)) from None
        from ..reporting.reports import declaration_line
        from ..running.runner import undeclared

        print(f"# {adapter.name} declares: {declaration_line(adapter.declaration())}", file=sys.stderr)
    runs = 0
    for case in cases:
        entry = case.manifest_entry()
        if adapter is not None:
            why = undeclared(adapter, case)
            entry["runs"], entry["not_applicable"] = not why, why
            runs += not why
        print(json.dumps(entry))
    tail = f"; {runs} would run for {adapter.name}, {len(cases) - runs} not applicable" if adapter is not None else ""
    print(f"# {len(cases)} cases{tail}", file=sys.stderr)
    return 0


def _report(args, adapter, info, results, warnings, elapsed, complete=True, soak=None) -> None:
    from ..reporting.reports import to_json, write_json, write_junit

    if args.report:
        from ..reporting.certificate import write_report

        data = write_report(args.report, info, results, warnings, elapsed, adapter.profiles, args.explored)
        core = data["level"].get("core", {})
        print(f"certificate: {data['verdict']} ({core.get('why', '')}); written to {args.report}")
    if args.json:
        data = to_json(info, results, warnings, elapsed, complete)
        if soak is not None:
            data["soak"] = soak
        write_json(args.json, data)
    if args.junit:
        write_junit(args.junit, info, results, elapsed)


def _executor(args):
    """Spawned pools, or the world torchrun launched: the runner does not care which."""
    from hyperdsd.testing import PoolSet, TorchrunWorld, launched_by_torchrun

    gloo_timeout = max(5.0, 0.75 * (args.timeout or 60.0 * args.deadline_scale))
    if launched_by_torchrun():
        return TorchrunWorld(gloo_timeout_s=gloo_timeout, device_type=args.device, backend=args.backend)
    return PoolSet(
        gloo_timeout_s=gloo_timeout,
        device_type=args.device,
        backend=args.backend,
        preload=("conformance.running.runner",),
    )


def _run_cases(args, cases, adapter, xfails, warnings) -> int:
    import shutil

    from hyperdsd.testing import WorldLost

    from ..reporting.console import ConsoleReporter
    from ..running.runner import Runner

    executor = _executor(args)
    if args.exitfirst and executor.exitfirst_refusal:
        executor.close()
        raise UsageError(f"-x/--exitfirst is not supported here: {executor.exitfirst_refusal}")
    reporter = executor.reporter
    info = _run_info(args, cases, adapter, executor)
    console = ConsoleReporter(len(cases) * args.repeat, verbose=args.verbose)
    results: list = []
    start = time.monotonic()
    workdir = executor.run_workdir(args.workdir, "conformance-")
    runner = Runner(
        adapter, executor, timeout=args.timeout, xfails=xfails, workdir=workdir, deadline_scale=args.deadline_scale
    )
    if reporter:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        console.start(info)

    def partial(note: str) -> None:
        _report(args, adapter, info, results, warnings + [note], time.monotonic() - start, complete=False)

    def hung(outcome) -> None:
        # The reporting rank itself hung in a case: report it, then the run ends.
        if runner.current is not None and outcome is not None:
            on_result(runner.result_of_hang(runner.current, outcome))
        partial("a case missed its deadline; run aborted")

    def on_result(r):
        results.append(r)
        console.case_done(r)

    executor.on_expiry = hung if reporter else None
    # SIGTERM ends the run like Ctrl-C: ranks stopped, partial report written.
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    runs: list[list] = []
    try:
        for i in range(args.repeat):
            if reporter and args.repeat > 1:
                console.write(f"--- run {i + 1} of {args.repeat} ---")
            runs.append(runner.run(cases, on_result if reporter else None, exitfirst=args.exitfirst))
    except KeyboardInterrupt:
        executor.kill()
        if reporter:
            console.write(f"\ninterrupted after {len(results)} of {len(cases) * args.repeat} cases; all ranks stopped")
            console.deviations(results)
            partial("run interrupted")
        return 1
    except WorldLost as exc:
        # A rank stopped answering; others may be stuck in that case. Report
        # what ran and leave: torchrun stops the rest of the world.
        if reporter:
            console.write(f"\nrun aborted: {exc}")
            console.deviations(results)
            partial(f"run aborted: {exc}")
        sys.stdout.flush()
        os._exit(1)
    except BaseException:
        executor.kill()  # the suite's own bug: no rank outlives the run
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        if reporter:
            shutil.rmtree(workdir, ignore_errors=True)
    executor.close()
    if not reporter:
        return 0
    return _finish(args, adapter, info, runs, len(cases), console, warnings, time.monotonic() - start)


def _run_info(args, cases, adapter, executor):
    """What every report's header says of this run."""
    from ..reporting.reports import RunInfo

    return RunInfo(
        adapter.name,
        adapter.version,
        adapter.spec,
        sorted({w for c in cases for w in c.world_sizes if not executor.unfit([w])}),
        sorted({m for c in cases for m in c.meshes}),
        launcher=executor.launcher,
        device=args.device,
        backend=args.backend,
        declaration=adapter.declaration(),
    )


def _finish(args, adapter, info, runs: list[list], n_cases: int, console, warnings, elapsed: float) -> int:
    """The summary and the reports of a finished run (a soak's verdict changes too); the exit status."""
    last = runs[-1]
    soak = None
    if args.repeat > 1:
        soak = verdict_changes(runs)
        warnings = warnings + [
            f"verdict changed between runs: {c['id']}: {' -> '.join(c['verdicts'])}" for c in soak["changed"]
        ]
    console.finish(last, elapsed, warnings)
    if soak is not None:
        console.write(
            f"soak: {n_cases} cases run {args.repeat} times; {len(soak['changed'])} changed their verdict between runs"
        )
    _report(args, adapter, info, last, warnings, elapsed, soak=soak)
    return 1 if any(r.unexpected for r in last) or (soak and soak["changed"]) else 0


def verdict_changes(runs: list[list]) -> dict:
    """Every case whose verdict differs between the runs of a soak (``--repeat``)."""
    verdicts: dict[str, list[str]] = {}
    for run in runs:
        for r in run:
            verdicts.setdefault(r.case.id, []).append(r.status.value)
    changed = [{"id": k, "verdicts": v} for k, v in verdicts.items() if len(set(v)) > 1]
    return {"runs": len(runs), "cases": len(verdicts), "changed": changed}
