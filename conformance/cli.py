"""``python -m conformance``: run the matrix against an implementation."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from .adapters import AdapterError, load_adapter
from .registry import all_cases, select

DEFAULT_IMPL = "hyperdsd"


class UsageError(Exception):
    pass


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("the timeout must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Run the distributed state-dict conformance matrix (SPEC.md) against an implementation.",
        epilog="Exit status: 0 when nothing failed or errored unexpectedly, 1 otherwise, 2 for usage errors.",
    )
    p.add_argument("--impl", default=os.environ.get("CONFORMANCE_IMPL", DEFAULT_IMPL),
                   help="implementation under test: hyperdsd, torch, some.module or some.module:attr "
                        f"(default: $CONFORMANCE_IMPL or {DEFAULT_IMPL})")
    p.add_argument("--world-sizes", type=_int_list, help="only cases whose world sizes are all in this list, e.g. 1,2,4")
    p.add_argument("--mesh", action="append", default=[], help="only cases on these meshes (repeatable): 4, 2x2, ...")
    p.add_argument("-k", dest="patterns", action="append", default=[], help="only cases whose ID contains this text (repeatable)")
    p.add_argument("--xfails", help="expected failures: lines 'CASE_ID_OR_PREFIX  # reason, link'")
    p.add_argument("--json", help="write the JSON report here")
    p.add_argument("--junit", help="write a JUnit XML report here")
    p.add_argument("--report", metavar="DIR", help="write report.json, junit.xml, report.html and report.md (the certificate) here")
    p.add_argument("--list", action="store_true", help="print the manifest of selected cases and exit")
    p.add_argument("--timeout", type=_positive, help="per-case deadline in seconds (default: each case's own, 60 s)")
    p.add_argument("--workdir", help="where cases keep checkpoints (must be shared by all nodes under multi-node torchrun)")
    p.add_argument("-v", "--verbose", action="store_true", help="print tracebacks, stacks and rank output of failures")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        return _run(args)
    except UsageError as exc:
        print(f"python -m conformance: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from hyperdsd.testing import launched_by_torchrun

    cases = select(all_cases(), patterns=args.patterns, world_sizes=args.world_sizes, meshes=args.mesh or None)
    if args.mesh:
        from hyperdsd.testing import parse_mesh

        for m in args.mesh:
            try:
                parse_mesh(m)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
    if args.list:
        for case in cases:
            print(json.dumps(case.manifest_entry()))
        print(f"# {len(cases)} cases", file=sys.stderr)
        return 0
    if not cases:
        raise UsageError("no case matches the selection (see --list)")
    from hyperdsd.testing import environment_problems

    for problem in environment_problems():
        raise UsageError(problem)
    try:
        adapter = load_adapter(args.impl)
    except AdapterError as exc:
        raise UsageError(str(exc)) from None

    xfails = None
    warnings: list[str] = []
    if args.xfails:
        from .xfails import Xfails

        try:
            xfails = Xfails.load(args.xfails)
        except OSError as exc:
            raise UsageError(f"cannot read --xfails {args.xfails}: {exc}") from None
        xfails.mark_selected([c.id for c in all_cases()])
        warnings += [f"{xfails.source}:{e.line}: xfail entry {e.pattern!r} matches no case" for e in xfails.unmatched()]

    if launched_by_torchrun():
        return _run_torchrun(args, cases, adapter, xfails, warnings)
    return _run_pools(args, cases, adapter, xfails, warnings)


def _report(args, info, results, warnings, elapsed, complete=True) -> None:
    from .reporting import to_json, write_json, write_junit

    if args.report:
        from .adapters import load_adapter
        from .certificate import write_report

        data = write_report(args.report, info, results, warnings, elapsed, load_adapter(args.impl).profiles)
        core = data["level"].get("core", {})
        print(f"certificate: {'core certified' if core.get('reached') else 'not certified'} ({core.get('why', '')}); written to {args.report}")
    if args.json:
        write_json(args.json, to_json(info, results, warnings, elapsed, complete))
    if args.junit:
        write_junit(args.junit, info, results, elapsed)


def _run_pools(args, cases, adapter, xfails, warnings) -> int:
    from hyperdsd.testing import PoolSet

    from .reporting import ConsoleReporter, RunInfo
    from .runner import Runner

    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    info = RunInfo(adapter.name, adapter.version, args.impl, sorted({w for c in cases for w in c.world_sizes}), sorted({m for c in cases for m in c.meshes}))
    console = ConsoleReporter(len(cases), verbose=args.verbose)
    console.start(info)
    results: list = []
    start = time.monotonic()
    # SIGTERM ends the run like Ctrl-C: pools killed, partial report written.
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    gloo_timeout = max(5.0, 0.75 * (args.timeout or 60.0))
    pools = PoolSet(gloo_timeout_s=gloo_timeout)
    try:
        runner = Runner(args.impl, timeout=args.timeout, xfails=xfails, pools=pools, workdir=args.workdir)

        def on_result(r):
            results.append(r)
            console.case_done(r)

        runner.run(cases, on_result)
    except KeyboardInterrupt:
        pools.kill()
        elapsed = time.monotonic() - start
        console.write(f"\ninterrupted after {len(results)} of {len(cases)} cases; all ranks stopped")
        _report(args, info, results, warnings + ["run interrupted"], elapsed, complete=False)
        return 1
    finally:
        pools.kill()
        signal.signal(signal.SIGTERM, previous)
    elapsed = time.monotonic() - start
    console.finish(results, elapsed, warnings)
    _report(args, info, results, warnings, elapsed)
    return 1 if any(r.unexpected for r in results) else 0


def _run_torchrun(args, cases, adapter, xfails, warnings) -> int:
    from hyperdsd.testing import ExistingWorld

    from .reporting import ConsoleReporter, RunInfo
    from .runner import Runner, WorldLost

    world = ExistingWorld(gloo_timeout_s=max(5.0, 0.75 * (args.timeout or 60.0)))
    rank0 = world.rank == 0
    info = RunInfo(adapter.name, adapter.version, args.impl, [world.world_size], sorted({m for c in cases for m in c.meshes}), launcher="torchrun")
    console = ConsoleReporter(len(cases), verbose=args.verbose)
    results: list = []
    start = time.monotonic()
    if rank0:
        for w in warnings:
            print(f"warning: {w}", file=sys.stderr)
        console.start(info)
        # A hung case ends the process; keep what ran so far.
        world.on_expiry = lambda: _report(args, info, results, warnings + ["a case missed its deadline; run aborted"], time.monotonic() - start, complete=False)
    runner = Runner(args.impl, timeout=args.timeout, xfails=xfails, world=world, workdir=args.workdir)

    def on_result(r):
        results.append(r)
        console.case_done(r)

    try:
        runner.run(cases, on_result)
    except WorldLost as exc:
        # Other ranks are stuck in the lost case; report what ran and leave,
        # torchrun stops the rest of the world.
        console.write(f"\nrun aborted: {exc}")
        _report(args, info, results, warnings + [f"run aborted: {exc}"], time.monotonic() - start, complete=False)
        sys.stdout.flush()
        os._exit(1)
    if not rank0:
        return 0
    elapsed = time.monotonic() - start
    console.finish(results, elapsed, warnings)
    _report(args, info, results, warnings, elapsed)
    return 1 if any(r.unexpected for r in results) else 0
