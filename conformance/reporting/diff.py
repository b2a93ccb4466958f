"""``python -m conformance diff OLD.json NEW.json``: what changed between two runs.

Lists, clause by clause, the cases that appeared, disappeared or changed
status, and the distinct deviations that appeared or went away. How vendors
track progress and regressions, and how a torch upgrade is judged. Exit
status 1 when something regressed: a case that did not fail before fails or
errors now, or a case that passed is gone.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict

from ..running.results import Status
from .deviations import signature

_BAD = (Status.FAILED, Status.ERROR)
_GOOD = (Status.PASSED, Status.XPASS)


def _load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"python -m conformance diff: error: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or "cases" not in data:
        raise SystemExit(f"python -m conformance diff: error: {path} is not a conformance JSON report")
    return data


def _label(data: dict) -> str:
    impl = data.get("impl", {})
    return (
        f"{impl.get('name', '?')} {impl.get('version', '?')}, torch {data.get('torch_version', '?')}, "
        f"suite {data.get('suite_version', '?')}"
    )


def compare(old: dict, new: dict) -> tuple[list[str], bool]:
    """(report lines, whether something regressed)."""
    before = {c["id"]: c for c in old["cases"]}
    after = {c["id"]: c for c in new["cases"]}
    by_clause: dict[str, list[str]] = defaultdict(list)
    added: dict[str, Counter] = defaultdict(Counter)
    removed: dict[str, Counter] = defaultdict(Counter)
    regressed = fixed = 0
    for cid in sorted(set(before) | set(after)):
        o, n = before.get(cid), after.get(cid)
        clause = (n or o)["clause"]
        if o is None:
            added[clause][n["status"]] += 1
            if n["status"] in _BAD:
                regressed += 1
                by_clause[clause].append(f"    REGRESSED: {cid}: {n['status']} (new case)")
        elif n is None:
            removed[clause][o["status"]] += 1
            if o["status"] in _GOOD:
                regressed += 1
                by_clause[clause].append(f"    REGRESSED: {cid}: was {o['status']}, not in the new run")
        elif o["status"] != n["status"]:
            worse = n["status"] in _BAD and o["status"] not in _BAD
            better = o["status"] in _BAD and n["status"] not in _BAD
            mark = "REGRESSED" if worse else ("fixed" if better else "changed")
            regressed += worse
            fixed += better
            by_clause[clause].append(f"    {mark}: {cid}: {o['status']} -> {n['status']}")
            if worse and n.get("message"):
                by_clause[clause].append(f"        {n['message'].splitlines()[0][:200]}")
    for clause, counts in added.items():
        by_clause[clause].insert(
            0, f"    + {sum(counts.values())} new case(s): " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        )
    for clause, counts in removed.items():
        by_clause[clause].insert(
            0,
            f"    - {sum(counts.values())} case(s) not in the new run: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        )
    lines = [f"old: {_label(old)}", f"new: {_label(new)}", ""]
    if by_clause:
        for clause in sorted(by_clause):
            lines.append(f"  {clause}")
            lines += by_clause[clause]
    else:
        lines.append("  every case has the same status in both runs")
    old_dev, new_dev = _by_cause(old), _by_cause(new)
    appeared = [new_dev[s] for s in new_dev if s not in old_dev]
    gone = [old_dev[s] for s in old_dev if s not in new_dev]
    if appeared or gone:
        lines.append("")
        lines.append("deviations:")
        for d in appeared:
            lines.append(
                f"  + {d['status']} in {d['count']} case(s) of {', '.join(d['clauses'])}: "
                f"{d['message'].splitlines()[0][:200]}"
            )
        for d in gone:
            lines.append(
                f"  - gone: was in {d['count']} case(s) of {', '.join(d['clauses'])}: "
                f"{d['message'].splitlines()[0][:200]}"
            )
    lines.append("")
    lines.append(f"{regressed} regressed, {fixed} fixed")
    return lines, regressed > 0


def _by_cause(report: dict) -> dict[str, dict]:
    """A report's deviations keyed by the signature of their message as this
    suite computes it now, so that two reports written by different suite
    releases or torch builds pair up by cause."""
    out: dict[str, dict] = {}
    for d in report.get("deviations", []):
        key = signature(d["message"]) if d.get("message") else d["signature"]
        if key in out:
            merged = out[key]
            out[key] = {
                **merged,
                "count": merged["count"] + d["count"],
                "clauses": sorted(set(merged["clauses"]) | set(d["clauses"])),
            }
        else:
            out[key] = d
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conformance diff", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("old", help="the earlier run's JSON report (--json)")
    parser.add_argument("new", help="the later run's JSON report")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        lines, regressed = compare(_load(args.old), _load(args.new))
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 1 if regressed else 0
