"""Mutation testing: how sensitive the conformance suite is, measured.

Each mutant of ``tools/mutants.py`` (a small, realistic bug) is applied to a
copy of ``hyperdsd`` in a temporary directory, under the package name
``hyperdsd_mutant``, and the suite runs against it with
``--impl hyperdsd_mutant``. The copy has its own name so that only the
implementation under test is mutated: the suite's harness and oracle keep
importing the real ``hyperdsd.testing``.

For each mutant the suite runs in up to three stages, each with ``-x`` (stop
at the first failing case): the mutant's hints (the cases most likely to
kill it), a quick slice (one case per clause and mode, layouts rotating),
then the whole matrix. A mutant is killed by the first case that fails or
errors; one that passes everything SURVIVED. Before the campaign the quick
slice runs against the unmutated copy: a suite that fails there measures
nothing.

    python -m tools.mutate                   # every mutant
    python -m tools.mutate --only NAME ...   # some (repeatable, or comma-separated)
    python -m tools.mutate --list            # the mutants and what each models
    python -m tools.mutate --quick-only      # hints and quick slice only, no full matrix

Run from the repository root; the temporary copies are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from hyperdsd.testing import Status

from .mutants import MUTANTS, Mutant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "hyperdsd_mutant"


def source_of(mutant: Mutant, root: str = ROOT) -> str:
    with open(os.path.join(root, "hyperdsd", mutant.file)) as f:
        return f.read()


def apply(mutant: Mutant, source: str) -> str:
    """``source`` with the mutant's edit; its target must occur exactly once."""
    n = source.count(mutant.target)
    if n != 1:
        raise ValueError(f"mutant {mutant.name}: its target occurs {n} times in hyperdsd/{mutant.file}, expected once")
    return source.replace(mutant.target, mutant.replacement)


def make_copy(mutant: Mutant | None, parent: str) -> str:
    """A copy of hyperdsd named ``hyperdsd_mutant`` under ``parent``, with ``mutant`` applied."""
    dest = os.path.join(parent, PACKAGE)
    shutil.copytree(os.path.join(ROOT, "hyperdsd"), dest, ignore=shutil.ignore_patterns("__pycache__"))
    if mutant is not None:
        path = os.path.join(dest, mutant.file)
        mutated = apply(mutant, source_of(mutant))
        with open(path, "w") as f:
            f.write(mutated)
    return dest


def quick_slice() -> list[str]:
    """One case per (clause, mode), the layout and optimizer rotating from group to group."""
    from conformance.registry import all_cases

    groups: dict[tuple, list] = {}
    for case in all_cases():
        groups.setdefault((case.clause, case.mode), []).append(case)
    return [cases[i % len(cases)].id for i, cases in enumerate(groups.values())]


def known_patterns(patterns) -> list[str]:
    """The ``-k`` patterns that select at least one case (a hint may name a case that is gone)."""
    from conformance.registry import all_cases

    ids = [c.id for c in all_cases()]
    return [p for p in patterns if any(p in i for i in ids)]


@dataclass
class StageResult:
    killed_by: str = ""  # case ID, or a note when the run itself broke
    status: str = ""
    message: str = ""
    ran: int = 0


def run_suite(parent: str, patterns: list[str] | None, report: str, log) -> StageResult:
    """The suite against the copy under ``parent`` with ``-x``; the first case that did not pass."""
    cmd = [sys.executable, "-m", "conformance", "--impl", PACKAGE, "-x", "--json", report]
    for p in patterns or []:
        cmd += ["-k", p]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([parent, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write(proc.stdout)
    log.flush()
    if not os.path.exists(report):
        tail = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1:] or [""]
        return StageResult(killed_by=f"(suite did not run, exit {proc.returncode})", status="broken", message=tail[0])
    with open(report) as f:
        data = json.load(f)
    os.remove(report)
    for case in data["cases"]:
        if case["status"] in (Status.FAILED, Status.ERROR):
            lines = [line.strip() for line in case["message"].splitlines() if line.strip()]
            first = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
            return StageResult(case["id"], case["status"], first, len(data["cases"]))
    if proc.returncode != 0:
        return StageResult(
            killed_by=f"(suite exit {proc.returncode})", status="broken", message="", ran=len(data["cases"])
        )
    return StageResult(ran=len(data["cases"]))


@dataclass
class Verdict:
    mutant: Mutant
    result: StageResult
    stage: str  # hints | quick | full | "" (survived)
    seconds: float

    @property
    def killed(self) -> bool:
        return bool(self.result.killed_by)


def run_mutant(mutant: Mutant | None, quick: list[str], quick_only: bool, log) -> Verdict:
    start = time.monotonic()
    parent = tempfile.mkdtemp(prefix="hyperdsd-mutant-")
    try:
        make_copy(mutant, parent)
        report = os.path.join(parent, "report.json")
        hints = known_patterns(mutant.hints) if mutant is not None else []
        stages = [("hints", hints)] if hints else []
        stages.append(("quick", quick))
        if not quick_only:
            stages.append(("full", None))
        result, stage = StageResult(), ""
        for stage, patterns in stages:
            log.write(f"\n===== {mutant.name if mutant else 'baseline'}: {stage} =====\n")
            result = run_suite(parent, patterns, report, log)
            if result.killed_by:
                break
        else:
            stage = ""
        return Verdict(mutant, result, stage, time.monotonic() - start)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _line(v: Verdict) -> str:
    if v.killed:
        what = f"killed by {v.result.killed_by} ({v.result.status}, {v.stage})"
        msg = f"\n      {v.result.message[:200]}" if v.result.message else ""
    else:
        what, msg = "SURVIVED", ""
    return f"{v.mutant.name:<38} {what}  [{v.seconds:.0f} s]{msg}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.mutate", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], help="run only these mutants (repeatable or comma-separated)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument("--quick-only", action="store_true", help="hints and the quick slice only; no full-matrix stage")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated quick-slice check")
    p.add_argument(
        "--log", default=os.path.join(tempfile.gettempdir(), "hyperdsd-mutate.log"), help="the suite's output goes here"
    )
    p.add_argument("--json", help="write the verdicts here")
    args = p.parse_args(argv)

    mutants = list(MUTANTS)
    if args.only:
        wanted = [n for part in args.only for n in part.split(",") if n]
        known = {m.name for m in MUTANTS}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            p.error(f"unknown mutants {unknown}; see --list")
        mutants = [m for m in MUTANTS if m.name in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.name:<38} hyperdsd/{m.file:<20} {m.bug}")
        print(f"# {len(mutants)} mutants")
        return 0
    for m in mutants:  # fail before any run if a target has rotted
        apply(m, source_of(m))

    quick = quick_slice()
    start = time.monotonic()
    print(f"{len(mutants)} mutants; quick slice of {len(quick)} cases; suite output in {args.log}", flush=True)
    with open(args.log, "w") as log:
        if not args.no_baseline:
            base = run_mutant(None, quick, True, log)
            if base.killed:
                print(
                    f"baseline (unmutated) fails: {base.result.killed_by} ({base.result.status}): {base.result.message}"
                )
                return 2
            print(f"baseline: the quick slice passes unmutated ({base.seconds:.0f} s)", flush=True)
        verdicts = []
        for i, m in enumerate(mutants, 1):
            v = run_mutant(m, quick, args.quick_only, log)
            verdicts.append(v)
            print(f"[{i:>2}/{len(mutants)}] {_line(v)}", flush=True)
    elapsed = time.monotonic() - start
    killed = sum(v.killed for v in verdicts)
    score = 100.0 * killed / len(verdicts) if verdicts else 0.0
    survivors = [v.mutant.name for v in verdicts if not v.killed]
    scope = " (hints and quick slice only)" if args.quick_only else ""
    print(f"\nscore: {killed}/{len(verdicts)} killed = {score:.1f}%{scope}; {elapsed / 60:.1f} min")
    if survivors:
        print("survivors: " + ", ".join(survivors))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "score": score,
                    "killed": killed,
                    "total": len(verdicts),
                    "seconds": elapsed,
                    "quick_only": args.quick_only,
                    "mutants": [
                        {
                            "name": v.mutant.name,
                            "file": v.mutant.file,
                            "bug": v.mutant.bug,
                            "killed_by": v.result.killed_by,
                            "status": v.result.status,
                            "stage": v.stage,
                            "message": v.result.message,
                            "seconds": round(v.seconds, 1),
                        }
                        for v in verdicts
                    ],
                },
                f,
                indent=1,
            )
    return 0 if not survivors else 1


if __name__ == "__main__":
    sys.exit(main())
