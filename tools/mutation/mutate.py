"""Mutation testing: how sensitive the conformance suite is, measured.

Each mutant of ``tools/mutation/mutants.py`` (a small, realistic bug) is applied to a
copy of ``hyperdsd`` in a temporary directory, under the package name
``hyperdsd_mutant``, and the suite runs against it with
``--impl hyperdsd_mutant``. The copy has its own name so that only the
implementation under test is mutated: the suite's harness and oracle keep
importing the real ``hyperdsd.testing``.

For each mutant the suite runs in up to four stages: three of the matrix,
each with ``-x`` (stop at the first failing case): the mutant's hints (the
cases most likely to kill it), a quick slice (one case per clause and mode,
layouts rotating), the whole matrix; then generated scenarios,
``python -m conformance explore`` with a fixed budget and seed. A mutant is
killed by the first case (or explored scenario) that fails or errors; one
that passes everything SURVIVED. Before the campaign the quick slice (and
the exploration, with the same budget and seed) runs against the unmutated
copy: a suite that fails there measures nothing.

    python -m tools.mutation.mutate                   # every mutant
    python -m tools.mutation.mutate --only NAME ...   # some (repeatable, or comma-separated)
    python -m tools.mutation.mutate --list            # the mutants and what each models
    python -m tools.mutation.mutate --check           # every mutant applies, every hint selects a case; no run
    python -m tools.mutation.mutate --quick-only      # hints and quick slice only, no full matrix, no exploration
    python -m tools.mutation.mutate --no-explore      # the matrix stages only
    python -m tools.mutation.mutate --stages hints,explore   # exploration alone after the hints
    python -m tools.mutation.mutate --explore-budget 120s --explore-seed 0

Run from the repository root; the temporary copies are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from hyperdsd.testing import Status

from .anchor import AnchorError, Function, Package
from .anchor import apply as edit
from .mutants import MUTANTS, Mutant

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "hyperdsd_mutant"
MATRIX_STAGES = ("hints", "quick", "full")
STAGES = (*MATRIX_STAGES, "explore")
DEFAULT_STAGES = STAGES
EXPLORE_BUDGET = "120s"
# Beyond its budget, an exploration may take this long to start its pools and
# finish the scenario in flight before it is stopped (SIGTERM, then SIGKILL).
EXPLORE_GRACE_S = 300.0


def package(root: str | None = None) -> Package:
    """The functions of ``hyperdsd`` under ``root`` (the repository's), where the mutants find theirs."""
    return Package(os.path.join(root or ROOT, "hyperdsd"))


def locate(mutant: Mutant, pkg: Package | None = None) -> Function:
    """The function ``mutant`` plants its bug in, wherever it now is."""
    return (pkg or package()).find(mutant.function, mutant.pattern, mutant.replacement)


def apply(mutant: Mutant, pkg: Package | None = None) -> tuple[str, str]:
    """(the module, under hyperdsd/, and its source with the mutant's edit). An
    :class:`~tools.mutation.anchor.AnchorError` names the mutant and what is wrong: its
    function is gone or ambiguous, its pattern matches nothing or several times."""
    try:
        fn = locate(mutant, pkg)
        return fn.path, edit(fn, mutant.pattern, mutant.replacement)
    except AnchorError as exc:
        raise AnchorError(f"mutant {mutant.name}: {exc}") from None


def check(mutants, pkg: Package | None = None, hints: bool = True) -> tuple[list[str], list[str]]:
    """(problems, notes) of ``mutants`` against the current sources. A problem:
    a mutant that does not apply (see :func:`apply`), or a hint that selects no
    case. A note: a function found under another name than the mutant's (moved
    to another module: the mutant still applies, its name is worth updating)."""
    pkg = pkg or package()
    problems, notes = [], []
    for m in mutants:
        try:
            fn = locate(m, pkg)
            if fn.name != m.function:
                notes.append(f"mutant {m.name}: {m.function} is now {fn.name} (hyperdsd/{fn.where})")
            apply(m, pkg)
        except AnchorError as exc:
            problems.append(str(exc) if str(exc).startswith("mutant ") else f"mutant {m.name}: {exc}")
    if hints:
        known = set(known_patterns([h for m in mutants for h in m.hints]))
        for m in mutants:
            stale = [h for h in m.hints if h not in known]
            if stale:
                problems.append(f"mutant {m.name}: hints that select no case: {stale}")
    return problems, notes


def make_copy(mutant: Mutant | None, parent: str, pkg: Package | None = None) -> str:
    """A copy of hyperdsd named ``hyperdsd_mutant`` under ``parent``, with ``mutant`` applied."""
    dest = os.path.join(parent, PACKAGE)
    shutil.copytree(os.path.join(ROOT, "hyperdsd"), dest, ignore=shutil.ignore_patterns("__pycache__"))
    if mutant is not None:
        path, mutated = apply(mutant, pkg)
        with open(os.path.join(dest, path), "w") as f:
            f.write(mutated)
    return dest


def quick_slice() -> list[str]:
    """One case per (clause, mode), the layout and optimizer rotating from group to group."""
    from conformance.running.registry import all_cases

    groups: dict[tuple, list] = {}
    for case in all_cases():
        groups.setdefault((case.clause, case.mode), []).append(case)
    return [cases[i % len(cases)].id for i, cases in enumerate(groups.values())]


def known_patterns(patterns) -> list[str]:
    """The ``-k`` patterns that select at least one case (a hint may name a case that is gone)."""
    from conformance.running.registry import all_cases

    ids = [c.id for c in all_cases()]
    return [p for p in patterns if any(p in i for i in ids)]


@dataclass
class StageResult:
    killed_by: str = ""  # case ID, or a note when the run itself broke
    status: str = ""
    message: str = ""
    ran: int = 0
    token: str = ""  # explore: the shrunk scenario's replay token
    scenario: str = ""  # explore: the shrunk scenario, in words


def _env(parent: str) -> dict:
    return dict(
        os.environ, PYTHONPATH=os.pathsep.join([parent, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    )


def run_suite(parent: str, patterns: list[str] | None, report: str, log) -> StageResult:
    """The suite against the copy under ``parent`` with ``-x``; the first case that did not pass."""
    cmd = [sys.executable, "-m", "conformance", "--impl", PACKAGE, "-x", "--json", report]
    for p in patterns or []:
        cmd += ["-k", p]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(parent), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


# -- the exploration stage ------------------------------------------------------


@dataclass(frozen=True)
class ExploreSettings:
    budget: str = EXPLORE_BUDGET  # as explore's --budget takes it: 120, 120s, 2m
    seed: int = 0

    @property
    def budget_s(self) -> float:
        from conformance.exploring.strategy import parse_budget

        return parse_budget(self.budget)


def explore_command(settings: ExploreSettings, report: str) -> list[str]:
    """The exploration of the mutant's copy: a fixed budget and seed, one
    round (it ends once the first deviation is shrunk), its JSON report in ``report``."""
    return [
        sys.executable,
        "-m",
        "conformance",
        "explore",
        "--impl",
        PACKAGE,
        "--budget",
        settings.budget,
        "--seed",
        str(settings.seed),
        "--rounds",
        "1",  # the first deviation, shrunk, is the verdict: no round looking for others
        "--json",
        report,
    ]


def explore_result(data: dict, returncode: int) -> StageResult:
    """An exploration's verdict from its JSON report (the ``explore`` section)
    and exit status: the first deviation it found kills, named by its clause,
    with the shrunk scenario's replay token."""
    section = data.get("explore") or {}
    ran = int(section.get("ran", 0))
    findings = section.get("findings") or []
    if findings:
        f = findings[0]
        lines = [line.strip() for line in (f.get("message") or "").splitlines() if line.strip()]
        first = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else "")
        shrunk = "" if f.get("shrunk", True) else " (not shrunk)"
        return StageResult(
            killed_by=f"explore: {f.get('clause')}{shrunk}",
            status=f.get("status", ""),
            message=first,
            ran=ran,
            token=f.get("token", ""),
            scenario=f.get("description", ""),
        )
    complete = section.get("complete", True)
    if returncode != 0 or not complete:
        return StageResult(
            killed_by=f"(exploration exit {returncode}, {'complete' if complete else 'interrupted'})",
            status="broken",
            ran=ran,
        )
    return StageResult(ran=ran)


def run_explore(parent: str, settings: ExploreSettings, report: str, log) -> StageResult:
    """Exploration against the copy under ``parent``; stopped (the whole
    process group: its rank pools too) if it overruns its budget by
    :data:`EXPLORE_GRACE_S`."""
    cmd = explore_command(settings, report)
    limit = settings.budget_s + EXPLORE_GRACE_S
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(parent),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # explore reports what ran and stops its ranks
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        out += f"\n(exploration stopped after {limit:.0f} s)\n"
    log.write(out)
    log.flush()
    if not os.path.exists(report):
        tail = [line for line in out.strip().splitlines() if line.strip()][-1:] or [""]
        return StageResult(
            killed_by=f"(exploration did not run, exit {proc.returncode})", status="broken", message=tail[0]
        )
    with open(report) as f:
        data = json.load(f)
    os.remove(report)
    return explore_result(data, proc.returncode)


@dataclass
class Verdict:
    mutant: Mutant
    result: StageResult
    stage: str  # hints | quick | full | explore | "" (survived)
    seconds: float

    @property
    def killed(self) -> bool:
        return bool(self.result.killed_by)

    @property
    def killed_by_matrix(self) -> bool:
        return self.killed and self.stage in MATRIX_STAGES


def run_mutant(
    mutant: Mutant | None,
    quick: list[str],
    stages: tuple[str, ...],
    log,
    explore: ExploreSettings | None = None,
    pkg: Package | None = None,
) -> Verdict:
    start = time.monotonic()
    parent = tempfile.mkdtemp(prefix="hyperdsd-mutant-")
    try:
        make_copy(mutant, parent, pkg)
        report = os.path.join(parent, "report.json")
        hints = known_patterns(mutant.hints) if mutant is not None else []
        patterns = {"hints": hints, "quick": quick, "full": None}
        result, stage = StageResult(), ""
        for stage in stages:
            if stage == "hints" and not hints:
                continue
            log.write(f"\n===== {mutant.name if mutant else 'baseline'}: {stage} =====\n")
            if stage == "explore":
                result = run_explore(parent, explore or ExploreSettings(), report, log)
            else:
                result = run_suite(parent, patterns[stage], report, log)
            if result.killed_by:
                break
        else:
            stage = ""
        return Verdict(mutant, result, stage, time.monotonic() - start)
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def parse_stages(text: str) -> tuple[str, ...]:
    """``hints,quick,full,explore`` (any of them, run in that order)."""
    wanted = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in STAGES]
    if unknown or not wanted:
        raise ValueError(f"stages must be some of {','.join(STAGES)}, got {text!r}")
    return tuple(x for x in STAGES if x in wanted)


def scores(verdicts: list[Verdict]) -> dict:
    """Kills by the matrix stages alone, and by the matrix and exploration together."""
    total = len(verdicts)
    matrix = sum(v.killed_by_matrix for v in verdicts)
    killed = sum(v.killed for v in verdicts)
    return {
        "total": total,
        "killed": killed,
        "score": 100.0 * killed / total if total else 0.0,
        "matrix_killed": matrix,
        "matrix_score": 100.0 * matrix / total if total else 0.0,
        "explore_killed": sum(v.killed and v.stage == "explore" for v in verdicts),
    }


def _line(v: Verdict) -> str:
    if v.killed:
        what = f"killed by {v.result.killed_by} ({v.result.status}, {v.stage})"
        msg = f"\n      {v.result.message[:200]}" if v.result.message else ""
        if v.result.token:
            msg += f"\n      replay: python -m conformance explore --impl IMPL --replay {v.result.token}"
    else:
        what, msg = "SURVIVED", ""
    return f"{v.mutant.name:<38} {what}  [{v.seconds:.0f} s]{msg}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.mutation.mutate", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", default=[], help="run only these mutants (repeatable or comma-separated)")
    p.add_argument("--list", action="store_true", help="list the mutants and exit")
    p.add_argument(
        "--check",
        action="store_true",
        help="check that every mutant applies (its function is found, its pattern matches once) and that every "
        "hint selects a case; run nothing",
    )
    p.add_argument(
        "--quick-only", action="store_true", help="hints and the quick slice only; no full-matrix or exploration stage"
    )
    p.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGES),
        help=f"the stages to run, in this order, each only if the last did not kill (default {','.join(STAGES)}; "
        "e.g. hints,explore measures exploration alone)",
    )
    p.add_argument("--no-explore", action="store_true", help="no exploration stage: the matrix alone")
    p.add_argument(
        "--explore-budget", default=EXPLORE_BUDGET, help=f"exploration per mutant: 90s, 2m (default {EXPLORE_BUDGET})"
    )
    p.add_argument("--explore-seed", type=int, default=0, help="exploration's hypothesis seed (default 0)")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated quick-slice check")
    p.add_argument(
        "--log", default=os.path.join(tempfile.gettempdir(), "hyperdsd-mutate.log"), help="the suite's output goes here"
    )
    p.add_argument("--json", help="write the verdicts here")
    args = p.parse_args(argv)
    try:
        stages = parse_stages(args.stages)
        explore = ExploreSettings(args.explore_budget, args.explore_seed)
        explore.budget_s  # noqa: B018 - a budget that does not parse fails here, before any run
    except ValueError as exc:
        p.error(str(exc))
    if args.quick_only:
        stages = tuple(x for x in stages if x in ("hints", "quick"))
    if args.no_explore:
        stages = tuple(x for x in stages if x != "explore")
    if not stages:
        p.error("no stage left to run")

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
            print(f"{m.name:<38} {m.function:<52} {m.bug}")
        print(f"# {len(mutants)} mutants")
        return 0
    pkg = package()
    problems, notes = check(mutants, pkg, hints=args.check)
    for line in notes:
        print(f"note: {line}")
    for line in problems:
        print(line)
    if args.check:
        print(f"# {len(mutants)} mutants: " + (f"{len(problems)} problems" if problems else "every one applies"))
        return 1 if problems else 0
    if problems:  # fail before any run if a mutant has rotted
        return 2

    quick = quick_slice()
    start = time.monotonic()
    exploring = "explore" in stages
    plan = ", ".join(stages) + (f" (budget {explore.budget}, seed {explore.seed})" if exploring else "")
    print(
        f"{len(mutants)} mutants; stages {plan}; quick slice of {len(quick)} cases; suite output in {args.log}",
        flush=True,
    )
    with open(args.log, "w") as log:
        if not args.no_baseline:
            # The unmutated copy through the quick slice, and through the same exploration the mutants get:
            # a deviation found there would "kill" every mutant.
            base_stages = ("quick", "explore") if exploring else ("quick",)
            base = run_mutant(None, quick, base_stages, log, explore, pkg)
            if base.killed:
                print(
                    f"baseline (unmutated) fails at {base.stage}: {base.result.killed_by} ({base.result.status}): "
                    f"{base.result.message}" + (f"\n  replay: {base.result.token}" if base.result.token else "")
                )
                return 2
            print(f"baseline: {' and '.join(base_stages)} pass unmutated ({base.seconds:.0f} s)", flush=True)
        verdicts = []
        for i, m in enumerate(mutants, 1):
            v = run_mutant(m, quick, stages, log, explore, pkg)
            verdicts.append(v)
            print(f"[{i:>2}/{len(mutants)}] {_line(v)}", flush=True)
    elapsed = time.monotonic() - start
    sc = scores(verdicts)
    survivors = [v.mutant.name for v in verdicts if not v.killed]
    matrix = "+".join(x for x in stages if x in MATRIX_STAGES) or "none"
    print(
        f"\nscore: {sc['killed']}/{sc['total']} killed = {sc['score']:.1f}% (stages {','.join(stages)}); "
        f"{elapsed / 60:.1f} min"
    )
    if exploring:
        print(
            f"  matrix alone ({matrix}): {sc['matrix_killed']}/{sc['total']} = {sc['matrix_score']:.1f}%; "
            f"matrix + exploration: {sc['killed']}/{sc['total']} = {sc['score']:.1f}% "
            f"({sc['explore_killed']} by exploration, budget {explore.budget}, seed {explore.seed})"
        )
    if survivors:
        print("survivors: " + ", ".join(survivors))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    **sc,
                    "seconds": elapsed,
                    "stages": list(stages),
                    "quick_only": args.quick_only,
                    "explore": {"budget": explore.budget, "seed": explore.seed} if exploring else None,
                    "mutants": [
                        {
                            "name": v.mutant.name,
                            "function": v.mutant.function,
                            "bug": v.mutant.bug,
                            "killed_by": v.result.killed_by,
                            "status": v.result.status,
                            "stage": v.stage,
                            "killed_by_matrix": v.killed_by_matrix,
                            "message": v.result.message,
                            "token": v.result.token,
                            "scenario": v.result.scenario,
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
