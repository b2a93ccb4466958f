"""The certificate: a report a vendor can publish.

``python -m conformance --report DIR`` writes ``report.json``,
``junit.xml``, a self-contained ``report.html`` (no network, one file) and
``report.md``. The level reached is ``core certified`` only when every core
case of the suite ran and passed: none skipped, none not applicable, none
expected to fail. An implementation that declares less (SPEC §1) is
``certified for <declaration>: N of M core clauses exercised`` when every
core case that ran passed; every report names the clauses not exercised.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

from hyperdsd.testing import Status

from .. import spec
from ..adapters import PROFILES
from ..running.registry import all_cases
from ..running.results import CaseResult
from .html import render_html
from .reports import RunInfo, coverage, coverage_line, declaration_line, to_json, write_json, write_junit

_ORDER = (Status.ERROR, Status.FAILED, Status.XFAIL, Status.XPASS, Status.NOT_APPLICABLE, Status.PASSED)  # worst first


def level(results: list[CaseResult], profiles: frozenset[str]) -> dict:
    """Which level the run reached per profile, and why not a higher one.

    ``reached``: every case of the profile ran and passed, none not
    applicable. ``reached_for_declaration``: every case that ran passed, and
    some did not apply (an implementation that declares less, SPEC §1): it is
    certified for what it declares, with the clauses it never exercised
    named (``coverage``). Declaring less never reads cleaner: a filtered
    run, a failure, an error or an expected failure certifies nothing.
    """
    ran = {r.case.id: r for r in results}
    out = {}
    for profile in PROFILES:
        wanted = [c.id for c in all_cases() if c.profile == profile]
        if not wanted:
            continue
        if profile != "core" and profile not in profiles:
            out[profile] = {"reached": False, "why": "not claimed"}
            continue
        missing = [cid for cid in wanted if cid not in ran]
        bad = [cid for cid in wanted if cid in ran and ran[cid].status not in (Status.PASSED, Status.NOT_APPLICABLE)]
        na = [cid for cid in wanted if cid in ran and ran[cid].status == Status.NOT_APPLICABLE]
        if missing:
            why = f"{len(missing)} of {len(wanted)} cases did not run (a filtered run cannot certify)"
        elif bad:
            kinds = Counter(ran[cid].status.value for cid in bad)
            why = (
                f"{len(bad)} of {len(wanted)} cases did not pass ("
                + ", ".join(f"{n} {k}" for k, n in kinds.items())
                + ")"
            )
        elif na:
            why = f"all {len(wanted) - len(na)} cases that ran passed; {len(na)} of {len(wanted)} were not applicable"
        else:
            why = f"all {len(wanted)} cases passed"
        entry = {"reached": not missing and not bad and not na, "why": why}
        if profile == "core":
            entry["reached_for_declaration"] = not missing and not bad and bool(na)
            entry["coverage"] = coverage(results)
        out[profile] = entry
    return out


def verdict(level_: dict, declaration: dict | None = None) -> str:
    """``core certified``; ``certified for <declaration>: N of M core clauses exercised``; or ``not certified``."""
    core = level_.get("core", {})
    if core.get("reached"):
        return "core certified"
    if core.get("reached_for_declaration"):
        cov = core["coverage"]
        return (
            f"certified for {declaration_line(declaration)}: {len(cov['exercised'])} of {cov['core_clauses']} "
            "core clauses exercised"
        )
    return "not certified"


def first_lines(data: dict) -> list[str]:
    """The certificate's first screen: the verdict, then what was not exercised (SPEC §4)."""
    cov = data.get("coverage") or data["level"].get("core", {}).get("coverage")
    lines = [f"Level: {_verdict(data)}"]
    if cov:
        lines.append("Coverage: " + coverage_line(cov))
    lines.append("Declared: " + declaration_line(data.get("declaration")))
    return lines


def matrix(results: list[CaseResult]) -> tuple[list[str], list[str], dict]:
    """Clauses, layouts and, per cell, the count of each status."""
    clauses, layouts = [], []
    cells: dict = defaultdict(Counter)
    for r in results:
        if r.case.clause not in clauses:
            clauses.append(r.case.clause)
        if r.case.layout.name not in layouts:
            layouts.append(r.case.layout.name)
        cells[(r.case.clause, r.case.layout.name)][r.status] += 1
    return clauses, layouts, cells


def worst(counter: Counter) -> str:
    return next((s for s in _ORDER if counter.get(s)), "")


def write_report(
    directory: str,
    info: RunInfo,
    results: list[CaseResult],
    warnings: list[str],
    elapsed_s: float,
    profiles: frozenset[str],
    explore: dict | None = None,
) -> dict:
    """``explore``: the ``explore`` section of an exploration's JSON report, shown beside the matrix."""
    os.makedirs(directory, exist_ok=True)
    data = to_json(info, results, warnings, elapsed_s)
    if explore is not None:
        data["explore"] = explore
    data["level"] = level(results, profiles)
    data["verdict"] = verdict(data["level"], info.declaration)
    texts = spec.clauses()
    data["clauses"] = {c: texts.get(c, "") for c in dict.fromkeys(r.case.clause for r in results)}
    data["layout_families"] = {r.case.layout.name: r.case.layout.family for r in results}
    write_json(os.path.join(directory, "report.json"), data)
    write_junit(os.path.join(directory, "junit.xml"), info, results, elapsed_s)
    with open(os.path.join(directory, "report.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(data, results))
    with open(os.path.join(directory, "report.html"), "w", encoding="utf-8") as f:
        f.write(render_html(data, _verdict(data), first_lines(data), _reached))
    return data


def _reached(entry: dict) -> str:
    if entry.get("reached"):
        return "yes"
    if entry.get("reached_for_declaration"):
        return "yes, for what it declares"
    return "no"


def _verdict(data: dict) -> str:
    return data.get("verdict") or verdict(data["level"], data.get("declaration"))


def render_markdown(data: dict, results: list[CaseResult]) -> str:
    impl = data["impl"]
    lines = [
        f"# Conformance report: {impl['name']} {impl['version']}",
        "",
        *(f"**{line}**  " if i == 0 else f"{line}  " for i, line in enumerate(first_lines(data))),
        "",
        "| | |",
        "|---|---|",
        f"| implementation | `{impl['spec']}` ({impl['name']} {impl['version']}) |",
        f"| spec / suite | {data['spec_version']} / {data['suite_version']} |",
        f"| torch | {data['torch_version']} |",
        f"| machine | {data['machine']}, Python {data['python']} |",
        f"| world sizes / meshes | {', '.join(map(str, data['world_sizes']))} / {', '.join(data['meshes'])} |",
        f"| started | {data['started']} ({data['elapsed_s']:.0f} s) |",
        "",
        "| profile | reached | |",
        "|---|---|---|",
    ]
    for profile, v in data["level"].items():
        lines.append(f"| {profile} | {_reached(v)} | {v['why']} |")
    lines += ["", " | ".join(f"{k}: {n}" for k, n in data["summary"].items()), ""]
    devs = data.get("deviations", [])
    if devs:
        lines += ["## Distinct deviations", ""]
        for i, d in enumerate(devs, 1):
            known = f" (expected: {d['xfail_reason']})" if d.get("xfail_reason") else ""
            lines.append(f"{i}. **{d['status']}** in {d['count']} case(s) of {', '.join(d['clauses'])}{known}")
            for line in d["message"].splitlines()[:4]:
                lines.append(f"   - {line}")
            lines.append(f"   - repro: `{d['repro']}`")
        lines.append("")
    lines += ["## Clause by layout", ""]
    clauses, layouts, cells = matrix(results)
    lines.append("| clause | " + " | ".join(layouts) + " |")
    lines.append("|---|" + "---|" * len(layouts))
    for clause in clauses:
        row = []
        for layout in layouts:
            c = cells.get((clause, layout))
            if not c:
                row.append("")
                continue
            ran = sum(c.values()) - c[Status.NOT_APPLICABLE]
            mark = {Status.ERROR: " ERROR", Status.FAILED: " FAIL", Status.XFAIL: " xfail", Status.XPASS: " xpass"}.get(
                worst(c), ""
            )
            row.append(f"{c[Status.PASSED]}/{ran}{mark}" if ran else Status.NOT_APPLICABLE.value)
        lines.append(f"| {clause} | " + " | ".join(row) + " |")
    texts = data.get("clauses", {})
    if texts:
        lines += ["", "## Clauses", ""]
        lines += [f"- **{c}** {t}" for c, t in texts.items()]
    if data.get("explore"):
        lines += ["", *explore_markdown(data["explore"])]
    bad = [r for r in results if r.status in (Status.FAILED, Status.ERROR, Status.XFAIL, Status.XPASS)]
    if bad:
        lines += ["", "## Cases that did not pass", ""]
        for r in bad:
            lines.append(f"- **{r.case.id}** ({r.status}){': ' + r.xfail_reason if r.xfail_reason else ''}")
            for line in r.message.splitlines()[:6]:
                lines.append(f"  - {line}")
            lines.append(f"  - repro: `{r.repro}`")
    return "\n".join(lines) + "\n"


def explore_markdown(section: dict) -> list[str]:
    """The explored-scenarios section (python -m conformance explore): what ran, and each shrunk deviation."""
    lines = ["## Explored scenarios", ""]
    if section.get("replay"):
        lines.append(f"One scenario replayed: {section.get('verdict', '?')}.")
    else:
        by_clause = section.get("failures_by_clause") or {}
        lines.append(
            f"{section['ran']} generated scenarios in {section['elapsed_s']:.0f} s (budget {section['budget_s']:g} s, "
            f"seed {section['seed']}, world sizes {', '.join(map(str, section['world_sizes']))}; "
            f"{section['scenarios_per_minute']:.1f} per minute): {len(section['findings'])} deviations"
            + (f" ({', '.join(f'{c}: {n}' for c, n in by_clause.items())})" if by_clause else "")
            + "."
        )
    for i, f in enumerate(section.get("findings", []), 1):
        lines.append(f"{i}. **{f['status']}** {f['clause']}")
        lines += [f"   - {line}" for line in f["description"].splitlines()]
        lines += [f"   - {line}" for line in f["message"].splitlines()[:4]]
        lines.append(f"   - replay: `{f['repro']}`")
    return lines
