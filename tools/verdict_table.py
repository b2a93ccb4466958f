"""Summarise a conformance JSON report by clause: a Markdown table of how many
cases passed, and the most common causes of the others. With --xfails-draft,
print a draft expected-failures file instead: the shortest ID prefixes that
cover the failing cases (a whole clause, a clause on one layout, or single
cases), each with its most common cause as a placeholder reason to rewrite.

    python -m tools.verdict_table report.json [--causes 2]
    python -m tools.verdict_table report.json --xfails-draft > known.txt
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict

from conformance.deviations import signature


def _bad(case: dict) -> bool:
    return case["status"] in ("failed", "error", "xfail")


def draft_xfails(cases: list[dict]) -> list[str]:
    """Shortest prefixes that cover exactly the failing cases."""
    lines = []
    by_clause: dict[str, list] = defaultdict(list)
    for c in cases:
        if c["status"] != "n/a":
            by_clause[c["clause"]].append(c)

    def reason(group) -> str:
        return Counter(signature(c["message"]) for c in group).most_common(1)[0][0]

    for clause, group in by_clause.items():
        bad = [c for c in group if _bad(c)]
        if not bad:
            continue
        if len(bad) == len(group):
            lines.append(f"{clause}[  # {reason(bad)}")
            continue
        by_layout: dict[str, list] = defaultdict(list)
        for c in group:
            by_layout[c["layout"]].append(c)
        for layout, lg in by_layout.items():
            lbad = [c for c in lg if _bad(c)]
            if lbad and len(lbad) == len(lg):
                lines.append(f"{clause}[{layout}-  # {reason(lbad)}")
            else:
                lines += [f"{c['id']}  # {signature(c['message'])}" for c in lbad]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.verdict_table", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--causes", type=int, default=2)
    parser.add_argument("--xfails-draft", action="store_true")
    args = parser.parse_args()
    data = json.load(open(args.report))
    if args.xfails_draft:
        for line in draft_xfails(data["cases"]):
            print(line)
        return
    by_clause: dict[str, list] = defaultdict(list)
    for case in data["cases"]:
        by_clause[case["clause"]].append(case)
    print(f"{data['impl']['name']} {data['impl']['version']}: " + ", ".join(f"{k} {v}" for k, v in data["summary"].items()))
    print()
    print("| clause | passed | not passed (most common causes) |")
    print("|---|---|---|")
    for clause, cases in by_clause.items():
        ran = [c for c in cases if c["status"] != "n/a"]
        ok = sum(c["status"] in ("passed", "xpass") for c in ran)
        causes = Counter(signature(c["message"]) for c in ran if c["status"] not in ("passed", "xpass"))
        text = "; ".join(f"{n}× {sig}" for sig, n in causes.most_common(args.causes))
        print(f"| {clause} | {ok}/{len(ran)} | {text} |")


if __name__ == "__main__":
    main()
