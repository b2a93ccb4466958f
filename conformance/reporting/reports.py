"""Reports: the run's header, what it counts, and the JSON and JUnit files
that CI systems read (the console's are in :mod:`.console`)."""

from __future__ import annotations

import json
import platform
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field

from hyperdsd.testing import Status

from .. import SPEC_VERSION, __version__
from ..running.results import STATUSES, CaseResult
from . import deviations


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
                "layout": r.case.layout.name,
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
        ET.SubElement(tprops, "property", name="layout", value=r.case.layout.name)
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
