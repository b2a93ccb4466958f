"""The certificate: level rules, Markdown, and the HTML matrix as a real browser renders it."""

import json
import re
import shutil
import subprocess

import pytest
from helpers import scaled

from conformance.reporting.certificate import level, write_report
from conformance.reporting.reports import RunInfo
from conformance.running.registry import all_cases
from conformance.running.results import CaseResult
from hyperdsd.testing import Status

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
COLOURS = {
    "passed": "rgb(200, 230, 201)",
    "failed": "rgb(239, 154, 154)",
    "error": "rgb(229, 115, 115)",
    "xfail": "rgb(255, 224, 130)",
    "n/a": "rgb(224, 224, 224)",
}


def results_for(statuses: dict[str, str], default="passed"):
    out = []
    for case in all_cases():
        status = statuses.get(case.id, default)
        if status is None:
            continue
        out.append(
            CaseResult(
                case,
                Status(status),
                0.01,
                message=f"{status} message" if status != "passed" else "",
                repro=f"python -m conformance -k '{case.id}'",
                xfail_reason="known" if status == "xfail" else "",
            )
        )
    return out


def info():
    return RunInfo("demo", "1.0", "demo.module", [1, 2, 3, 4], ["1", "2", "3", "4", "2x2"])


def test_core_certified_only_when_every_core_case_passed():
    core = [c.id for c in all_cases() if c.profile == "core"]
    assert level(results_for({}), frozenset())["core"]["reached"]
    for status in ("failed", "error", "xfail", "xpass", "n/a"):
        assert not level(results_for({core[3]: status}), frozenset())["core"]["reached"], status
    partial = level(results_for({core[0]: None}), frozenset())["core"]
    assert not partial["reached"] and "did not run" in partial["why"]
    assert level(results_for({}), frozenset())["inplace"] == {"reached": False, "why": "not claimed"}


def test_an_implementation_that_declares_less_is_certified_for_it_with_its_coverage():
    from conformance.adapters import Adapter
    from conformance.reporting.certificate import first_lines, verdict

    adapter = Adapter("demo", *(lambda *a, **k: None,) * 4, options=dict, get_modes={"full_cpu"}, load_modes={"file"})
    decl = adapter.declaration()
    results = results_for({c.id: "n/a" for c in all_cases() if adapter.lacks(c.needs)})
    core = level(results, frozenset())["core"]
    assert core["reached"] is False and core["reached_for_declaration"] is True
    cov = core["coverage"]
    assert "OPT-DT-1" in cov["not_exercised"] and "OPT-RT-1" in cov["exercised"]
    said = verdict({"core": core}, decl)
    assert (
        said == f"certified for {'get full_cpu; load file; layouts all; options all; combined no'}: "
        f"{len(cov['exercised'])} of {cov['core_clauses']} core clauses exercised"
    )
    assert "core certified" not in said
    lines = first_lines({"level": {"core": core}, "declaration": decl})
    assert lines[1].startswith("Coverage: ") and "not exercised: " in lines[1] and "OPT-DT-1" in lines[1]
    # Declaring less never reads cleaner: one failure in what ran, and nothing is certified.
    some = next(c.id for c in all_cases() if str(c.mode) == "file" and c.profile == "core")
    broken = level(
        results_for({**{c.id: "n/a" for c in all_cases() if adapter.lacks(c.needs)}, some: "failed"}), frozenset()
    )["core"]
    assert not broken["reached_for_declaration"] and verdict({"core": broken}, decl) == "not certified"
    # Everything declared and passed: the only clean certificate, every core clause exercised.
    full = level(results_for({}), frozenset())["core"]
    assert verdict({"core": full}) == "core certified" and not full["coverage"]["not_exercised"]


def test_failures_are_grouped_into_distinct_deviations(tmp_path):
    same_cause = {  # one bug, two cases: names and numbers differ, the cause does not
        "OPT-RT-1[fsdp4-adamw-dcp]": "rank 1 raised KeyError in set_optimizer_state_dict: 'layers.0.fc1.weight'",
        "OPT-RT-1[fsdp2-sgd-dcp]": "ranks 0,1 raised KeyError in set_optimizer_state_dict: 'aux.bias'",
    }
    other = {
        "OPT-DT-3[single-adamw-full]": "rank 0 raised conformance.judging.oracle.CheckFailure: "
        "full: state dtypes or values were not kept:\n"
        "  state['aux.weight']['exp_avg']: dtype torch.bfloat16, expected torch.float32"
    }
    results = []
    for case in all_cases():
        message = {**same_cause, **other}.get(case.id)
        results.append(
            CaseResult(
                case,
                Status.FAILED if message else Status.PASSED,
                0.01,
                message=message or "",
                repro=f"python -m conformance -k '{case.id}'",
            )
        )
    write_report(str(tmp_path), info(), results, [], 12.0, frozenset())
    data = json.loads((tmp_path / "report.json").read_text())
    devs = data["deviations"]
    assert [d["count"] for d in devs] == [2, 1]
    assert sorted(devs[0]["cases"]) == sorted(same_cause) and devs[0]["clauses"] == ["OPT-RT-1"]
    assert devs[1]["clauses"] == ["OPT-DT-3"] and devs[1]["repro"].endswith("'OPT-DT-3[single-adamw-full]'")
    md = (tmp_path / "report.md").read_text()
    assert md.index("## Distinct deviations") < md.index("## Clause by layout")
    assert "1. **failed** in 2 case(s) of OPT-RT-1" in md
    assert "- **OPT-DT-3** dtypes are kept" in md  # the clause's SPEC text


def test_markdown_names_the_level_and_lists_failures(tmp_path):
    bad = "OPT-RT-1[fsdp4-adamw-dcp]"
    write_report(str(tmp_path), info(), results_for({bad: "failed"}), [], 12.0, frozenset())
    md = (tmp_path / "report.md").read_text()
    assert "**Level: not certified**" in md
    assert f"**{bad}** (failed)" in md and f"repro: `python -m conformance -k '{bad}'`" in md
    assert re.search(r"\| OPT-RT-1 \|.* FAIL", md)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["level"]["core"]["reached"] is False and (tmp_path / "junit.xml").exists()


@pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine (Debian: apt-get install chromium); .ci/run installs it"
)
def test_html_matrix_as_rendered_by_headless_chromium(tmp_path):
    statuses = {
        "OPT-RT-1[fsdp4-adamw-dcp]": "failed",
        "OPT-PURE-1[single-adamw-sharded-fresh]": "error",
        "OPT-KEYS-3[ddp-sharded]": "xfail",
    }
    results = results_for(statuses)
    write_report(str(tmp_path), info(), results, [], 12.0, frozenset())
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            (tmp_path / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=scaled(120),
    )
    dom = proc.stdout
    assert 'data-rendered="yes"' in dom, proc.stderr[-2000:]
    cells, links = {}, {}
    for attrs, href, text in re.findall(r'<td ([^>]*data-status[^>]*)><a href="#([^"]*)">([^<]*)</a></td>', dom):
        a = dict(re.findall(r'([\w-]+)="([^"]*)"', attrs))
        cells[(a["data-clause"], a["data-layout"])] = (a["data-status"], a["data-bg"], text)
        links[(a["data-clause"], a["data-layout"])] = href
    # Every (clause, layout) that ran has a cell, coloured by its worst status.
    expected = {}
    for r in results:
        expected.setdefault((r.case.clause, r.case.layout.name), []).append(r.status)
    assert set(cells) == set(expected)
    for key, got_statuses in expected.items():
        worst = next(s for s in ("error", "failed", "xfail", "passed") if s in got_statuses)
        status, bg, text = cells[key]
        assert status == worst, key
        assert bg == COLOURS[worst], (key, bg)
        assert text == f"{got_statuses.count('passed')}/{len(got_statuses)}", (key, text)
    # Each cell links to the list of its own cases.
    for (clause, layout), href in links.items():
        listed = re.search(rf'<details class="cell-cases" id="{href}"><summary>([^<]*)</summary>(.*?)</details>', dom)
        assert listed and listed.group(1).startswith(f"{clause} on {layout}: "), (clause, layout, href)
        assert sorted(re.findall(r"</span>([^<\s]+)", listed.group(2))) == sorted(
            r.case.id for r in results if (r.case.clause, r.case.layout.name) == (clause, layout)
        )
    assert "Level: not certified" in dom
    for cid in statuses:
        assert cid in dom  # listed under the cases that did not pass
    # The grid comes first, right under the verdict; each clause row carries its SPEC text.
    assert dom.index('id="level"') < dom.index('id="matrix"') < dom.index('id="deviations"')
    assert dom.count('class="deviation ') == 3
    assert "get, then set into a fresh model and optimizer of the same layout" in dom
