"""Reports: live progress and the summary matrix on the console, and the
JSON and JUnit files that CI systems read."""

from __future__ import annotations

import json
import platform
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from hyperdsd.testing import Status

from .. import SPEC_VERSION, __version__
from ..running.results import STATUSES, CaseResult
from . import deviations

_LABEL = {
    Status.PASSED: "PASS",
    Status.FAILED: "FAIL",
    Status.XFAIL: "XFAIL",
    Status.XPASS: "XPASS",
    Status.NOT_APPLICABLE: "N/A",
    Status.ERROR: "ERROR",
}


@dataclass
class RunInfo:
    impl_name: str
    impl_version: str
    impl_spec: str
    world_sizes: list[int]
    meshes: list[str]
    launcher: str = "pools"
    device: str = "cpu"
    backend: str = "gloo"
    started: float = field(default_factory=time.time)
    declaration: dict | None = None  # what the implementation declares (SPEC §1; Adapter.declaration())

    def header(self) -> dict:
        import torch

        return {
            "spec_version": SPEC_VERSION,
            "suite_version": __version__,
            "impl": {"name": self.impl_name, "version": self.impl_version, "spec": self.impl_spec},
            "declaration": self.declaration,
            "torch_version": torch.__version__,
            "world_sizes": self.world_sizes,
            "meshes": self.meshes,
            "launcher": self.launcher,
            "device": self.device,
            "backend": self.backend,
            "python": platform.python_version(),
            "machine": f"{platform.system()} {platform.machine()}",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
        }


def coverage(results: list[CaseResult]) -> dict:
    """Which core clauses the run exercised (SPEC §4): a clause is exercised
    when a core case of it ran (any verdict but not applicable)."""
    from ..running.registry import all_cases

    clauses = list(dict.fromkeys(c.clause for c in all_cases() if c.profile == "core"))
    ran = {r.case.clause for r in results if r.case.profile == "core" and r.status != Status.NOT_APPLICABLE}
    return {
        "exercised": [c for c in clauses if c in ran],
        "not_exercised": [c for c in clauses if c not in ran],
        "core_clauses": len(clauses),
    }


def coverage_line(cov: dict) -> str:
    line = f"{len(cov['exercised'])} of {cov['core_clauses']} core clauses exercised"
    if cov["not_exercised"]:
        line += "; not exercised: " + ", ".join(cov["not_exercised"])
    return line


def declaration_line(decl: dict | None) -> str:
    from ..adapters import describe_declaration

    return describe_declaration(decl) if decl else "everything"


def summary_counts(results: list[CaseResult]) -> dict[str, int]:
    counts = Counter(r.status for r in results)
    return {s.value: counts.get(s, 0) for s in STATUSES}


def time_by_section(results: list[CaseResult]) -> dict[str, dict]:
    """Seconds and cases per SPEC section (the clause without its number), slowest first."""
    out: dict[str, dict] = {}
    for r in results:
        section = r.case.clause.rsplit("-", 1)[0]
        entry = out.setdefault(section, {"seconds": 0.0, "cases": 0})
        entry["seconds"] += r.duration_s
        entry["cases"] += 1
    return {
        k: {"seconds": round(v["seconds"], 1), "cases": v["cases"]}
        for k, v in sorted(out.items(), key=lambda kv: -kv[1]["seconds"])
    }


def fault_counts(results: list[CaseResult]) -> dict[str, int]:
    """Faults of the ranks themselves over the run: deaths, hangs, leaks, pool restarts."""
    total: Counter = Counter()
    for r in results:
        total.update(r.faults)
    return dict(total)


class ConsoleReporter:
    """A line per case as it finishes, failures in full, then the matrix."""

    def __init__(self, total: int, stream=None, verbose: bool = False):
        self.total = total
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.done = 0
        self.counts: Counter = Counter()

    def write(self, text: str = "") -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, info: RunInfo) -> None:
        h = info.header()
        self.write(
            f"conformance {h['suite_version']} (spec {h['spec_version']}) "
            f"| impl {h['impl']['name']} {h['impl']['version']} "
            f"| torch {h['torch_version']} | world sizes {','.join(map(str, h['world_sizes']))} | {self.total} cases"
        )
        self.write(f"declared: {declaration_line(h['declaration'])}")

    def case_done(self, result: CaseResult) -> None:
        self.done += 1
        self.counts[result.status] += 1
        width = len(str(self.total))
        running = " ".join(f"{_LABEL[s].lower()} {self.counts[s]}" for s in STATUSES if self.counts[s])
        line = (
            f"[{self.done:>{width}}/{self.total}] {_LABEL[result.status]:<5} {result.case.id} "
            f"({result.duration_s:.2f} s) | {running}"
        )
        self.write(line)
        if result.status.unexpected:
            self.write(self.failure_text(result, details=self.verbose))
        elif result.status == Status.XPASS:
            self.write(f"    unexpectedly passed; the xfail entry says: {result.xfail_reason}")
        elif result.status == Status.NOT_APPLICABLE and self.verbose:
            self.write(f"    {result.message}")

    @staticmethod
    def failure_text(result: CaseResult, details: bool = False) -> str:
        lines = [f"    clause {result.case.clause} on {result.case.layout}"]
        lines += ["    " + line for line in result.message.splitlines()]
        if details and result.details:
            lines += ["      " + line for line in result.details.splitlines()]
        lines.append(f"    repro: {result.repro}")
        return "\n".join(lines)

    def finish(self, results: list[CaseResult], elapsed_s: float, warnings: list[str]) -> None:
        self.write("")
        self.write(render_matrix(results))
        counts = summary_counts(results)
        self.write("")
        self.write(" | ".join(f"{s}: {n}" for s, n in counts.items()) + f" | {elapsed_s:.1f} s")
        self.write("coverage: " + coverage_line(coverage(results)))
        sections = time_by_section(results)
        if sections:
            self.write(
                "time by section: " + ", ".join(f"{k} {v['seconds']:.0f} s ({v['cases']})" for k, v in sections.items())
            )
        faults = fault_counts(results)
        if faults:
            self.write("faults: " + ", ".join(f"{n} {k}" for k, n in faults.items()))
        bad = [r for r in results if r.unexpected]
        found = deviations.group(results)
        if found:
            unexpected = [d for d in found if d.status.unexpected]
            self.write(
                f"\n{len(bad)} case(s) failed or errored: {len(unexpected)} distinct deviation(s)"
                + (f", and {len(found) - len(unexpected)} expected" if len(found) > len(unexpected) else "")
            )
            for line in deviations.render(found):
                self.write(line)
        for w in warnings:
            self.write(f"warning: {w}")


def render_matrix(results: list[CaseResult]) -> str:
    """Clause by layout; a cell is passed/total, marked when anything failed."""
    cells: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    layouts: list[str] = []
    for r in results:
        cells[r.case.clause][r.case.layout][r.status] += 1
        if r.case.layout not in layouts:
            layouts.append(r.case.layout)
    if not results:
        return "(no cases ran)"

    def cell(counter: Counter) -> str:
        if not counter:
            return "."
        total = sum(counter.values()) - counter[Status.NOT_APPLICABLE]
        if total == 0:
            return Status.NOT_APPLICABLE.value
        ok = counter[Status.PASSED] + counter[Status.XPASS]
        mark = "!" if counter[Status.FAILED] or counter[Status.ERROR] else ("x" if counter[Status.XFAIL] else "")
        return f"{ok}/{total}{mark}"

    clauses = list(cells)
    cw = max(len("clause"), *(len(c) for c in clauses))
    widths = [max(len(layout), 6) for layout in layouts]
    lines = ["clause".ljust(cw) + "  " + "  ".join(layout.rjust(w) for layout, w in zip(layouts, widths))]
    for clause in clauses:
        lines.append(
            clause.ljust(cw)
            + "  "
            + "  ".join(cell(cells[clause].get(layout, Counter())).rjust(w) for layout, w in zip(layouts, widths))
        )
    lines.append("cells: passed/ran; ! failed or errored, x expected failures, . not in this run")
    return "\n".join(lines)


def to_json(
    info: RunInfo, results: list[CaseResult], warnings: list[str], elapsed_s: float, complete: bool = True
) -> dict:
    return {
        **info.header(),
        "complete": complete,
        "elapsed_s": round(elapsed_s, 3),
        "cases": [
            {
                "id": r.case.id,
                "clause": r.case.clause,
                "layout": r.case.layout,
                "profile": r.case.profile,
                "status": r.status.value,
                "duration_s": round(r.duration_s, 4),
                "message": r.message,
                "ranks": r.ranks,
                "xfail_reason": r.xfail_reason,
                "repro": r.repro,
                "faults": r.faults,
            }
            for r in results
        ],
        "summary": summary_counts(results),
        "coverage": coverage(results),
        "deviations": [d.to_json() for d in deviations.group(results)],
        "faults": fault_counts(results),
        "time_by_section": time_by_section(results),
        "warnings": warnings,
    }


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")


def write_junit(path: str, info: RunInfo, results: list[CaseResult], elapsed_s: float) -> None:
    """JUnit XML: failed -> <failure>, error -> <error>, xfail and n/a -> <skipped>."""
    counts = summary_counts(results)
    suite = ET.Element(
        "testsuite",
        name=f"conformance[{info.impl_name}]",
        tests=str(len(results)),
        failures=str(counts[Status.FAILED]),
        errors=str(counts[Status.ERROR]),
        skipped=str(counts[Status.XFAIL] + counts[Status.NOT_APPLICABLE]),
        time=f"{elapsed_s:.3f}",
    )
    props = ET.SubElement(suite, "properties")
    header = info.header()
    for key in ("spec_version", "suite_version", "torch_version"):
        ET.SubElement(props, "property", name=key, value=str(header[key]))
    ET.SubElement(props, "property", name="impl", value=f"{info.impl_name} {info.impl_version}")
    ET.SubElement(props, "property", name="declaration", value=declaration_line(info.declaration))
    ET.SubElement(props, "property", name="coverage", value=coverage_line(coverage(results)))
    for r in results:
        tc = ET.SubElement(suite, "testcase", classname=r.case.clause, name=r.case.id, time=f"{r.duration_s:.3f}")
        tprops = ET.SubElement(tc, "properties")
        ET.SubElement(tprops, "property", name="status", value=r.status.value)
        ET.SubElement(tprops, "property", name="layout", value=r.case.layout)
        text = f"{r.message}\n\nrepro: {r.repro}\n\n{r.details}".strip()
        if r.status == Status.FAILED:
            ET.SubElement(tc, "failure", message=_first_line(r.message)).text = text
        elif r.status == Status.ERROR:
            ET.SubElement(tc, "error", message=_first_line(r.message)).text = text
        elif r.status == Status.XFAIL:
            why = f"expected failure: {r.xfail_reason}"
            ET.SubElement(tc, "skipped", type=Status.XFAIL.value, message=why).text = text
        elif r.status == Status.NOT_APPLICABLE:
            ET.SubElement(tc, "skipped", type=Status.NOT_APPLICABLE.value, message=f"not applicable: {r.message}")
        elif r.status == Status.XPASS:
            ET.SubElement(tc, "system-out").text = f"unexpectedly passed; xfail entry: {r.xfail_reason}"
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""
