"""Summarise a conformance JSON report by clause: a Markdown table of how many
cases passed, and the most common causes of the others.

    python tools/verdict_table.py report.json [--causes 2]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter, defaultdict


def signature(message: str) -> str:
    """A failure message without the parts that differ from case to case."""
    first = message.splitlines()[0] if message else ""
    first = re.sub(r"^(phase \d/\d on \d ranks: )?(ranks? [\d,]+: )", "", first)
    first = re.sub(r"'[^']*'", "'…'", first)
    first = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", first)
    return first[:140]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report")
    parser.add_argument("--causes", type=int, default=2)
    args = parser.parse_args()
    data = json.load(open(args.report))
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
