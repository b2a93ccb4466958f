"""The suite across torch releases: which release fixed or broke which clause.

For each torch version, a virtual environment of its own (``.venvs/torch-X``,
reused when present) gets this project installed with that torch; the
matrix then runs against hyperdsd and against torch's own implementation,
one JSON report each (``out/torch-matrix/X-hyperdsd.json``, ``X-torch.json``).
At the end a table shows, clause by clause, what passed on each version,
and ``python -m conformance diff`` between consecutive versions says what
changed.

    python -m tools.torch_matrix                          # 2.13.0 and 2.14.1
    python -m tools.torch_matrix --versions 2.13.0 --impls hyperdsd -k OPT-RT-1
    python -m tools.torch_matrix --reuse                  # the table again, from the reports

Run from the repository root. pip takes 2.13.0 (CPU) and 2.14.1 (a CUDA
build that runs on the CPU, about 5.5 GB in a venv) from this machine's
disk; another version is downloaded if the registry has it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict

from hyperdsd.testing import Status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VERSIONS = ("2.13.0", "2.14.1")


def _venv(version: str, rebuild: bool) -> str:
    path = os.path.join(ROOT, ".venvs", f"torch-{version}")
    python = os.path.join(path, "bin", "python")
    if os.path.exists(python) and not rebuild:
        return python
    print(f"[{version}] creating {path}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", path], check=True)
    constraints = os.path.join(path, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={version}\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "-c", constraints, "-e", f"{ROOT}[test]"], check=True, cwd=ROOT
    )
    return python


def _run(python: str, version: str, impl: str, out: str, extra: list[str]) -> dict:
    report = os.path.join(out, f"{version}-{impl}.json")
    log = os.path.join(out, f"{version}-{impl}.log")
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(
            [python, "-m", "conformance", "--impl", impl, "--json", report, *extra],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    took = time.monotonic() - start
    if not os.path.exists(report):
        print(f"[{version}] {impl}: no report (exit {proc.returncode}); see {log}", flush=True)
        return {}
    with open(report) as f:
        data = json.load(f)
    print(f"[{version}] {impl}: {data['summary']} in {took:.0f} s ({data['torch_version']})", flush=True)
    return data


def _table(results: dict[tuple[str, str], dict], versions: list[str], impls: list[str]) -> list[str]:
    columns = [(v, i) for v in versions for i in impls if results.get((v, i))]
    cells: dict[str, dict] = defaultdict(dict)
    clauses: list[str] = []
    for col in columns:
        per: dict[str, Counter] = defaultdict(Counter)
        for case in results[col]["cases"]:
            per[case["clause"]][case["status"]] += 1
            if case["clause"] not in clauses:
                clauses.append(case["clause"])
        for clause, counts in per.items():
            ran = sum(counts.values()) - counts[Status.NOT_APPLICABLE]
            cells[clause][col] = f"{counts[Status.PASSED] + counts[Status.XPASS]}/{ran}" if ran else "n/a"
    heads = [f"{i} {v}" for v, i in columns]
    lines = ["| clause | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    for clause in clauses:
        lines.append(f"| {clause} | " + " | ".join(cells[clause].get(col, "") for col in columns) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.torch_matrix", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--versions", default=",".join(DEFAULT_VERSIONS))
    parser.add_argument("--impls", default="hyperdsd,torch")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "torch-matrix"))
    parser.add_argument("--rebuild", action="store_true", help="recreate the virtual environments")
    parser.add_argument("-k", dest="patterns", action="append", default=[], help="passed on to python -m conformance")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use reports already in --out (VERSION-IMPL.json, written by an earlier run) instead of running again",
    )
    args = parser.parse_args()
    versions = [v for v in args.versions.split(",") if v]
    impls = [i for i in args.impls.split(",") if i]
    os.makedirs(args.out, exist_ok=True)
    extra = [x for p in args.patterns for x in ("-k", p)]
    results: dict[tuple[str, str], dict] = {}
    for version in versions:
        python = None
        for impl in impls:
            existing = os.path.join(args.out, f"{version}-{impl}.json")
            if args.reuse and os.path.exists(existing):
                with open(existing) as f:
                    results[(version, impl)] = data = json.load(f)
                print(f"[{version}] {impl}: {data['summary']} ({data['torch_version']}, reused {existing})", flush=True)
                continue
            python = python or _venv(version, args.rebuild)
            results[(version, impl)] = _run(python, version, impl, args.out, extra)
    print()
    print("\n".join(_table(results, versions, impls)))
    for impl in impls:
        for old, new in zip(versions, versions[1:]):
            a, b = (os.path.join(args.out, f"{v}-{impl}.json") for v in (old, new))
            if os.path.exists(a) and os.path.exists(b):
                print(f"\n{impl}: torch {old} -> {new}")
                subprocess.run([sys.executable, "-m", "conformance", "diff", a, b], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
