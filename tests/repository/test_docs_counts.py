"""Every count docs/ADAPTERS.md gives comes from the manifest (``--list``): recomputed here, so none goes stale."""

import os
import re
from collections import Counter

from conformance.adapters import load_adapter
from conformance.running.registry import all_cases
from conformance.running.runner import undeclared

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "ADAPTERS.md")
CONSOLIDATED = "conformance.examples.consolidated_adapter"


def _doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def _count(selection: str) -> int:
    cases = all_cases()
    if selection == "all":
        return len(cases)
    kind, _, what = selection.partition(" ")
    if kind == "mode":
        return Counter(str(c.mode) for c in cases)[what]
    if kind == "clause":
        return Counter(c.clause for c in cases)[what]
    if kind == "runs":
        adapter = load_adapter(what.removeprefix("for "))
        return sum(not undeclared(adapter, c) for c in cases)
    raise AssertionError(f"docs/ADAPTERS.md: unknown count selection {selection!r}")


def test_the_case_counts_table_matches_the_manifest():
    rows = re.findall(r"^\| (all|mode \w+|clause [\w-]+|runs for [\w.:]+) \| (\d+) \|$", _doc(), re.MULTILINE)
    assert len(rows) >= 10
    wrong = {sel: (int(n), _count(sel)) for sel, n in rows if int(n) != _count(sel)}
    assert not wrong, f"docs/ADAPTERS.md counts (documented, --list): {wrong}"


def test_no_count_of_cases_outside_the_table():
    """A count written elsewhere would go stale unchecked: the guide points at the table instead."""
    outside = [m.group(0) for m in re.finditer(r"\b\d+ (?:core )?cases\b", _doc())]
    assert not outside, f"counts of cases outside the table: {outside}"


def test_the_consolidated_example_figures():
    adapter = load_adapter(CONSOLIDATED)
    runs = [c for c in all_cases() if not undeclared(adapter, c)]
    core = {c.clause for c in all_cases() if c.profile == "core"}
    exercised = {c.clause for c in runs if c.profile == "core"}
    doc = _doc()
    for n, m in re.findall(r"(\d+) of (\d+) core clauses exercised", doc):
        assert (int(n), int(m)) == (len(exercised), len(core))
    passed, failed = map(int, re.search(r"(\d+) passed, (\d+) failed, no error", doc).groups())
    assert passed + failed == len(runs)
    # The failures it quotes are file-mode cases that run for it: 2 of OPT-ATOM-1 and -4,
    # OPT-PART-1 and -6 and OPT-RT-1's SGD step-0 resume each, 4 of OPT-ATOM-2 and OPT-RT-5's
    # step-0 rollback.
    failing = Counter(
        c.clause
        for c in runs
        if c.clause in ("OPT-ATOM-1", "OPT-ATOM-2", "OPT-ATOM-4", "OPT-PART-1", "OPT-PART-6")
        or (c.clause == "OPT-RT-5" and c.id.endswith("-step0]"))
        or (c.clause == "OPT-RT-1" and c.id.endswith("-sgd-file-step0]"))
    )
    assert sum(failing.values()) == failed


def test_every_spec_clause_has_its_row_in_the_adapters_guide():
    """docs/ADAPTERS.md's "What each clause calls" names every clause of SPEC.md
    (rows list clauses as ``OPT-KEYS-2/3/4``, comma-separated)."""
    from conformance import spec

    with open(DOC) as f:
        text = f.read()
    table = text[text.index("## What each clause calls") :].split("\n\n## ", 1)[0]
    named = set()
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| clause"):
            for item in line.split("|")[1].split(","):
                m = re.fullmatch(r"\s*((?:[A-Z]+-)+)(\d+(?:/\d+)*)\s*", item)
                if m:
                    named |= {m.group(1) + n for n in m.group(2).split("/")}
    missing = [c for c in spec.clauses() if c not in named]
    assert not missing, f"docs/ADAPTERS.md's clause table lacks {missing}"
    assert not named - set(spec.clauses()), (
        f"the table names clauses SPEC.md lacks: {sorted(named - set(spec.clauses()))}"
    )
