"""Summarise a conformance JSON report by clause: a Markdown table of how many
cases passed, and the most common causes of the others. (An expected-failures
file is written by ``python -m tools.releases.trace_known``.)

    python -m tools.releases.verdict_table report.json [--causes 2]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

from conformance.reporting.deviations import signature
from conformance.running.results import Status


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.releases.verdict_table",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("report")
    parser.add_argument("--causes", type=int, default=2)
    args = parser.parse_args()
    data = json.load(open(args.report))
    by_clause: dict[str, list] = defaultdict(list)
    for case in data["cases"]:
        by_clause[case["clause"]].append(case)
    print(
        f"{data['impl']['name']} {data['impl']['version']}: "
        + ", ".join(f"{k} {v}" for k, v in data["summary"].items())
    )
    print()
    print("| clause | passed | not passed (most common causes) |")
    print("|---|---|---|")
    for clause, cases in by_clause.items():
        ran = [c for c in cases if c["status"] != Status.NOT_APPLICABLE]
        ok = sum(c["status"] in (Status.PASSED, Status.XPASS) for c in ran)
        causes = Counter(signature(c["message"]) for c in ran if c["status"] not in (Status.PASSED, Status.XPASS))
        text = "; ".join(f"{n}× {sig}" for sig, n in causes.most_common(args.causes))
        print(f"| {clause} | {ok}/{len(ran)} | {text} |")


if __name__ == "__main__":
    main()
