"""Runs the matrix against every perverse implementation (tools/perverse/twists.py)
and reports each ``error``: the suite must blame a surprising output on the
implementation (``failed``), never on itself (SPEC §4, 1.3).

    python -m tools.perverse                      # the whole matrix, every twist
    python -m tools.perverse --only none,items -k MODEL-2

Exit status 1 when any case errored.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tools.perverse.twists import PERVERSE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATUSES = ("passed", "failed", "n/a", "error")


def run_one(name: str, patterns: list[str], extra: list[str]) -> dict:
    """One CLI run; its JSON report's cases."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "-m", "conformance", "--impl", f"tools.perverse.twists:{name}", "--json", report]
        cmd += [arg for p in patterns for arg in ("-k", p)] + extra
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if not os.path.exists(report):
            raise SystemExit(f"{name}: the run wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}")
        with open(report) as f:
            return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PERVERSE), help="comma-separated twists (default: all)")
    parser.add_argument("-k", action="append", default=[], help="only cases whose ID contains this (repeatable)")
    parser.add_argument("--world-sizes", default=None, help="passed to the CLI")
    args = parser.parse_args(argv)
    extra = ["--world-sizes", args.world_sizes] if args.world_sizes else []
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(PERVERSE))
    if unknown:
        parser.error(f"unknown twists {unknown}; known: {list(PERVERSE)}")
    errors = []
    print(f"{'twist':<12} {'passed':>7} {'failed':>7} {'n/a':>7} {'error':>6}  seconds  what")
    for name in names:
        start = time.monotonic()
        cases = run_one(name, args.k, extra)["cases"]
        counts = {s: sum(c["status"] == s for c in cases) for s in STATUSES}
        errors += [(name, c) for c in cases if c["status"] == "error"]
        print(
            f"{name:<12} {counts['passed']:>7} {counts['failed']:>7} {counts['n/a']:>7} "
            f"{counts['error']:>6}  {time.monotonic() - start:>7.0f}  {PERVERSE[name].what}",
            flush=True,
        )
    for name, c in errors:
        print(f"\nERROR {name}: {c['id']}\n  {c['message'][:800]}")
    print(f"\n{len(errors)} error(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
