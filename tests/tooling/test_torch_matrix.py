"""tools/releases/torch_matrix.py: the summary it draws from the reports, and docs/TORCH_RELEASES.md, its rendering."""

import json
import os

from helpers import ROOT

from tools.releases import torch_matrix


def _report(torch_version, impl, statuses):
    cases = [
        {
            "id": cid,
            "clause": cid.split("[")[0],
            "layout": cid.split("[")[1].split("-")[0],
            "status": status,
            "message": message,
        }
        for cid, (status, message) in statuses.items()
    ]
    summary = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "xfail", "xpass", "n/a", "error")}
    return {
        "impl": {"name": impl, "version": "x"},
        "torch_version": torch_version,
        "suite_version": "0.2.0",
        "spec_version": "1.1",
        "started": "2026-12-01T06:00:00Z",
        "summary": summary,
        "cases": cases,
        "deviations": [],
    }


def test_the_summary_counts_clauses_traces_causes_and_diffs_releases(tmp_path):
    sgd = ("failed", "plain SGD: Expected device to be set")
    old = {
        "OPT-RT-1[single-sgd-full]": sgd,
        "OPT-RT-1[single-adamw-full]": ("passed", None),
        "MODEL-1[single-sharded]": ("failed", "something no cause explains"),
        "OPT-DT-4[single-sharded]": ("n/a", None),
    }
    new = dict(old, **{"OPT-RT-1[single-sgd-full]": ("passed", None)})
    for version, cases in (("2.6.0", old), ("2.7.1", new)):
        (tmp_path / f"{version}-torch.json").write_text(json.dumps(_report(version + "+cu124", "torch", cases)))
    (tmp_path / "2.6.0-env.json").write_text(json.dumps({"install_s": 485, "disk_bytes": 5_678_850_048}))
    (tmp_path / "2.6.0-torch.meta.json").write_text(json.dumps({"wall_s": 125}))
    summary = torch_matrix.build(str(tmp_path), shipped=None)
    first, second = summary["releases"]
    assert (first["version"], second["version"]) == ("2.6.0", "2.7.1")
    clauses = first["impls"]["torch"]["clauses"]
    assert clauses["OPT-RT-1"] == {"passed": 1, "ran": 2, "causes": {"plain SGD in full modes": 1}}
    assert clauses["MODEL-1"]["causes"] == {"untraced": 1} and clauses["OPT-DT-4"]["ran"] == 0
    assert second["impls"]["torch"]["clauses"]["OPT-RT-1"]["passed"] == 2
    (diff,) = summary["diffs"]
    assert (diff["old"], diff["new"], diff["clauses"]) == ("2.6.0", "2.7.1", {"OPT-RT-1": {"fixed": 1}})
    doc = torch_matrix.render(summary, "# preamble")
    assert doc.startswith("# preamble\n")
    row = "| 2.6.0 | 2.6.0+cu124 | torch | 0.2.0 | 2026-12-01 | 1 | 2 | 0 | 1 | 2 min 05 s | 8 min 05 s | 5.7 GB |"
    assert row in doc
    assert "| OPT-RT-1 | 1/2 | 2/2 | plain SGD in full modes (2.6.0: 1) |" in doc
    assert "| OPT-DT-4 | n/a | n/a |  |" in doc
    assert "- OPT-RT-1: 1 fixed" in doc


def test_verls_copy_is_a_column_of_its_own_with_torchs_causes(tmp_path):
    """verl's vendored copy is torch 2.7's code: its failures get torch's traced causes, it gets its own
    clause table, and only torch's own implementation is judged against a known-failures file."""
    cases = {
        "OPT-RT-1[single-sgd-full]": ("failed", "plain SGD: Expected device to be set"),
        "OPT-RT-1[single-adamw-full]": ("passed", None),
        "MODEL-1[single-sharded]": ("failed", "something no cause explains"),
    }
    report = _report("2.13.0+cpu", "verl-vendored-torch-2.7", cases)
    report["impl"]["version"] = "0.6.0"
    (tmp_path / "2.13.0-verl.json").write_text(json.dumps(report))
    (tmp_path / "2.13.0-torch.json").write_text(json.dumps(_report("2.13.0+cpu", "torch", cases)))
    summary = torch_matrix.build(str(tmp_path), shipped=None)
    (release,) = summary["releases"]
    assert list(release["impls"]) == ["torch", "verl"]
    verl = release["impls"]["verl"]
    assert verl["clauses"]["OPT-RT-1"]["causes"] == {"plain SGD in full modes": 1}
    assert verl["clauses"]["MODEL-1"]["causes"] == {"untraced": 1} and verl["known"] is None
    assert release["impls"]["torch"]["known"] is not None
    doc = torch_matrix.render(summary, "# preamble")
    assert "| 2.13.0 | 2.13.0+cpu | verl | 0.2.0 | 2026-12-01 | 1 | 2 | 0 | 0 |" in doc
    verl_table = doc.split("## verl, clause by clause", 1)[1].split("## What changed", 1)[0]
    assert "| OPT-RT-1 | 1/2 | plain SGD in full modes (1) |" in verl_table
    known_table = doc.split("## torch's known-failures files", 1)[1].split("## torch, clause by clause", 1)[0]
    assert "| 2.13.0 | `conformance/known/torch-2.13.txt` |" in known_table and "verl" not in known_table
    assert torch_matrix.IMPL_SPECS["verl"] == "tools.releases.verl_state_dict" and "verl" in torch_matrix.IMPLS


def test_a_release_without_reports_keeps_its_shipped_entry(tmp_path):
    shipped = {
        "releases": [{"version": "2.6.0", "impls": {"hyperdsd": {"kept": True}}, "env": None}],
        "diffs": [],
        "cause_links": {},
    }
    (tmp_path / "2.7.1-hyperdsd.json").write_text(json.dumps(_report("2.7.1", "hyperdsd", {})))
    summary = torch_matrix.build(str(tmp_path), shipped)
    assert [r["version"] for r in summary["releases"]] == ["2.6.0", "2.7.1"]
    assert summary["releases"][0]["impls"]["hyperdsd"] == {"kept": True}


def test_the_document_is_the_rendering_of_the_shipped_summary():
    """docs/TORCH_RELEASES.md is generated (python -m tools.releases.torch_matrix --reuse), never edited by hand."""
    with open(os.path.join(ROOT, "docs", "torch_releases.json")) as f:
        summary = json.load(f)
    with open(os.path.join(ROOT, "docs", "torch_releases_preamble.md")) as f:
        preamble = f.read()
    with open(os.path.join(ROOT, "docs", "TORCH_RELEASES.md")) as f:
        assert f.read() == torch_matrix.render(summary, preamble), "run python -m tools.releases.torch_matrix --reuse"
