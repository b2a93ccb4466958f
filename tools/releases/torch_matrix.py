"""The suite across torch releases: which release fixed or broke which clause.

For each torch version, a virtual environment of its own (``.venvs/torch-X``,
reused when present) gets this project installed with that torch; the
matrix then runs against hyperdsd, against torch's own implementation and
against verl's vendored copy of torch 2.7.0's (``tools/releases/verl_state_dict.py``;
before its first run there, ``pip install --no-deps verl==0.6.0`` goes into
the release's environment), one JSON report each
(``out/torch-matrix/X-hyperdsd.json``, ``X-torch.json``, ``X-verl.json``),
with the install time (the environment's, without verl), the environment's
disk size and each run's wall time beside them (``X-env.json``,
``X-IMPL.meta.json``).

From those reports it writes ``docs/torch_releases.json`` (a compact summary:
per release and implementation, clause by clause, what passed and which
traced cause (``tools/releases/trace_known.py``) explains each failure of torch's code,
its own and verl's copy) and renders
``docs/TORCH_RELEASES.md`` from it, after the hand-written
``docs/torch_releases_preamble.md``. A test checks that the document is the
rendering of the summary, so neither is edited by hand. Releases whose
reports are not in --out keep their entries from the shipped summary.

    python -m tools.releases.torch_matrix --versions 2.6.0 --rm-venv   # one release, then free its disk
    python -m tools.releases.torch_matrix --versions 2.13.0 --impls hyperdsd -k OPT-RT-1 --no-doc
    python -m tools.releases.torch_matrix --reuse                  # the summary and document again, from the reports

Run from the repository root. Every release but 2.13.0 (the CPU build on
this machine's disk) is a CUDA build from the registry that runs on the CPU:
3 to 6 GB in its environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter

from hyperdsd.testing import Status
from tools.releases import verl_state_dict

# A report's summary is keyed by the statuses' values (JSON keys are plain strings).
PASSED, XPASS, FAILED, ERROR, NA = (
    s.value for s in (Status.PASSED, Status.XPASS, Status.FAILED, Status.ERROR, Status.NOT_APPLICABLE)
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The newest patch of every minor release in pyproject's range.
ALL_VERSIONS = ("2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")
SUMMARY = os.path.join(ROOT, "docs", "torch_releases.json")
DOC = os.path.join(ROOT, "docs", "TORCH_RELEASES.md")
PREAMBLE = os.path.join(ROOT, "docs", "torch_releases_preamble.md")
IMPLS = ("hyperdsd", "torch", "verl")
# verl's copy exists for its users on torch 2.6 (whose set_model_state_dict ran out of memory): it runs
# by default there only; --impls verl runs it on any release.
VERL_RELEASES = ("2.6.0",)
# What --impl each name of IMPLS runs; the name is the one in the reports' file names and the tables.
IMPL_SPECS = {"hyperdsd": "hyperdsd", "torch": "torch", "verl": "tools.releases.verl_state_dict"}
# Implementations that are torch's code, whose failures tools/trace_known's causes explain, by report impl name.
TORCH_CODE = ("torch", verl_state_dict.NAME)
VERL_PIN = verl_state_dict.PIN
_DEVIATIONS_SHOWN = 12
VERL_NOTE = (
    " verl's copy of torch 2.7.0's `state_dict.py` and `_state_dict_utils.py` (verl 0.6.0, "
    "`--impl tools.releases.verl_state_dict`) on each release's torch; torch's causes apply to it."
)
_ISSUE = re.compile(r"https://github\.com/pytorch/pytorch/issues/(\d+)")


def _disk_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            total += os.lstat(os.path.join(folder, name)).st_blocks * 512
    return total


def _read(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


def _venv(version: str, out: str, rebuild: bool) -> str:
    """The release's environment, created when absent; its install time and size go to ``X-env.json``."""
    path = os.path.join(ROOT, ".venvs", f"torch-{version}")
    python = os.path.join(path, "bin", "python")
    if os.path.exists(python) and not rebuild:
        return python
    print(f"[{version}] creating {path}", flush=True)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", "--clear", path], check=True)
    constraints = os.path.join(path, "constraints.txt")
    with open(constraints, "w") as f:
        f.write(f"torch=={version}\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-cache-dir", "-c", constraints, "-e", f"{ROOT}[test]"],
        check=True,
        cwd=ROOT,
    )
    env = {"install_s": round(time.monotonic() - start), "disk_bytes": _disk_bytes(path)}
    _write(os.path.join(out, f"{version}-env.json"), env)
    print(f"[{version}] installed in {env['install_s']} s, {env['disk_bytes'] / 1e9:.1f} GB", flush=True)
    return python


def _install_verl(python: str, version: str) -> None:
    """verl, without its dependencies (only two of its files are loaded), into the release's environment."""
    pinned = VERL_PIN.split("==")[1]
    probe = "import importlib.metadata as m, sys; sys.exit(m.version('verl') != sys.argv[1])"
    if subprocess.run([python, "-c", probe, pinned], capture_output=True).returncode == 0:
        return
    print(f"[{version}] installing {VERL_PIN} (--no-deps)", flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-cache-dir", "--no-deps", VERL_PIN], check=True)


def _run(python: str, version: str, impl: str, out: str, extra: list[str], suffix: str = "") -> dict | None:
    report = os.path.join(out, f"{version}-{impl}{suffix}.json")
    log = os.path.join(out, f"{version}-{impl}{suffix}.log")
    if impl == "verl":
        _install_verl(python, version)
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(
            [python, "-m", "conformance", "--impl", IMPL_SPECS.get(impl, impl), "--json", report, *extra],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    took = time.monotonic() - start
    if not os.path.exists(report):
        print(f"[{version}] {impl}: no report (exit {proc.returncode}); see {log}", flush=True)
        return None
    if not suffix:
        _write(os.path.join(out, f"{version}-{impl}.meta.json"), {"wall_s": round(took)})
    data = _read(report)
    print(f"[{version}] {impl}: {data['summary']} in {took:.0f} s ({data['torch_version']})", flush=True)
    return data


def _with_supplement(report: dict, supplement: dict | None) -> dict:
    """A full run's report with the cases of a later run of some of them (``--supplement``) in their place,
    or added, and its summary counted again."""
    if supplement is None:
        return report
    later = {c["id"]: c for c in supplement["cases"]}
    cases = [later.pop(c["id"], c) for c in report["cases"]] + list(later.values())
    summary = dict.fromkeys(report["summary"], 0)
    for c in cases:
        summary[c["status"]] = summary.get(c["status"], 0) + 1
    return {**report, "cases": cases, "summary": summary}


def _cause_of(case: dict) -> str:
    """The traced cause of a failing case (tools/releases/trace_known.py), or 'untraced'."""
    from tools.releases.trace_known import cause_of

    return cause_of(case) or "untraced"


def summarize(report: dict, meta: dict | None, version: str) -> dict:
    """One implementation on one release, clause by clause: passed, ran (not n/a) and failures by cause
    (traced causes for torch's code: its own implementation and verl's copy; statuses otherwise);
    for torch's own implementation, how the release's known-failures file fares against the run."""
    clauses: dict[str, dict] = {}
    for case in report["cases"]:
        entry = clauses.setdefault(case["clause"], {"passed": 0, "ran": 0, "causes": {}})
        status = Status(case["status"])
        if status == Status.NOT_APPLICABLE:
            continue
        entry["ran"] += 1
        if status in (Status.PASSED, Status.XPASS):
            entry["passed"] += 1
        else:
            cause = _cause_of(case) if report["impl"]["name"] in TORCH_CODE else status.value
            entry["causes"][cause] = entry["causes"].get(cause, 0) + 1
    known = None
    if report["impl"]["name"] == "torch":
        from tools.releases.trace_known import check, known_file

        if os.path.exists(known_file(version)):
            known = {
                k: (len(v) if isinstance(v, list) else v)
                for k, v in check(report["cases"], known_file(version)).items()
            }
    return {
        "known": known,
        "torch_build": report["torch_version"],
        "suite_version": report["suite_version"],
        "spec_version": report["spec_version"],
        "started": report["started"],
        "summary": report["summary"],
        "wall_s": (meta or {}).get("wall_s"),
        "clauses": clauses,
    }


def diff(old: dict, new: dict) -> dict:
    """What changed between two releases' reports (``conformance diff``), in counts per clause."""
    from conformance.reporting.diff import compare

    lines, _ = compare(old, new)
    per: dict[str, Counter] = {}
    clause = None
    for line in lines:
        if line.startswith("  ") and not line.startswith("   ") and "-" in line and " " not in line.strip():
            clause = line.strip()
        elif clause and line.startswith("    ") and ":" in line and not line.startswith("        "):
            head = line.strip().split(":", 1)[0]
            if head[0] in "+-":  # "+ 3 new case(s)", "- 2 case(s) not in the new run"
                per.setdefault(clause, Counter())["new" if head[0] == "+" else "gone"] += int(head.split()[1])
            else:
                per.setdefault(clause, Counter())[head.lower()] += 1
    deviations = (
        [line.strip() for line in lines[lines.index("deviations:") + 1 :] if line.startswith("  ")]
        if "deviations:" in lines
        else []
    )
    return {
        "total": lines[-1],
        "clauses": {k: dict(sorted(v.items())) for k, v in sorted(per.items())},
        "deviations": deviations,
    }


def build(out: str, shipped: dict | None) -> dict:
    """The summary from the reports in ``out``; releases without reports keep their shipped entries."""
    from tools.releases.trace_known import CAUSES

    old = {r["version"]: r for r in (shipped or {}).get("releases", [])}
    old_diffs = {(d["impl"], d["old"], d["new"]): d for d in (shipped or {}).get("diffs", [])}
    releases, reports = [], {}
    for version in ALL_VERSIONS:
        entry = {"version": version, "impls": {}}
        env = _read(os.path.join(out, f"{version}-env.json"))
        for impl in IMPLS:
            report = _read(os.path.join(out, f"{version}-{impl}.json"))
            if report is not None:
                report = _with_supplement(report, _read(os.path.join(out, f"{version}-{impl}.supplement.json")))
                reports[(version, impl)] = report
                entry["impls"][impl] = summarize(
                    report, _read(os.path.join(out, f"{version}-{impl}.meta.json")), version
                )
            elif impl in old.get(version, {}).get("impls", {}):
                entry["impls"][impl] = old[version]["impls"][impl]
        if not entry["impls"]:
            continue
        entry["env"] = env or old.get(version, {}).get("env")
        releases.append(entry)
    diffs = []
    for impl in IMPLS:
        ran = [r["version"] for r in releases if impl in r["impls"]]
        for a, b in zip(ran, ran[1:]):
            if (a, impl) in reports and (b, impl) in reports:
                diffs.append({"impl": impl, "old": a, "new": b, **diff(reports[(a, impl)], reports[(b, impl)])})
            elif (impl, a, b) in old_diffs:
                diffs.append(old_diffs[(impl, a, b)])
    links = {c.title: m.group(0) for c in CAUSES if (m := _ISSUE.search(c.reason))}
    return {"releases": releases, "diffs": diffs, "cause_links": links}


def _cause(title: str, links: dict[str, str]) -> str:
    url = links.get(title)
    return f"{title} ([#{url.rsplit('/', 1)[1]}]({url}))" if url else title


def _fmt_s(seconds) -> str:
    return "" if seconds is None else f"{seconds // 60} min {seconds % 60:02d} s"


def render(summary: dict, preamble: str) -> str:
    """The document: the preamble, then tables drawn from the summary alone."""
    releases, links = summary["releases"], summary["cause_links"]
    out = [
        preamble.rstrip(),
        "",
        "<!-- Generated by python -m tools.releases.torch_matrix from docs/torch_releases.json;"
        " edit docs/torch_releases_preamble.md or the tool, never this file. -->",
        "",
        "## The runs",
        "",
        "| torch | build | impl | suite | run on | passed | failed | error | n/a | wall time | install | venv disk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in releases:
        env = r.get("env") or {}
        disk = f"{env['disk_bytes'] / 1e9:.1f} GB" if env.get("disk_bytes") else ""
        for impl, s in r["impls"].items():
            n = s["summary"]
            out.append(
                f"| {r['version']} | {s['torch_build']} | {impl} | {s['suite_version']} | {s['started'][:10]} "
                f"| {n[PASSED] + n.get(XPASS, 0)} | {n[FAILED]} | {n[ERROR]} | {n[NA]} "
                f"| {_fmt_s(s['wall_s'])} | {_fmt_s(env.get('install_s'))} | {disk} |"
            )
    out += [
        "",
        "## torch's known-failures files",
        "",
        "Each release's `conformance/known/torch-X.Y.txt` judged against that release's run of torch's "
        "implementation, as `--xfails` would: failures it does not list, listed cases that passed (xpass), "
        "errors, and entries that match no case. Green is 0 of each.",
        "",
        "| torch | file | unlisted failures | xpass | error | stale entries | |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in releases:
        k = r["impls"].get("torch", {}).get("known")
        if r["impls"].get("torch") is None:
            continue
        if not k:
            out.append(f"| {r['version']} | none | | | | | not traced |")
            continue
        green = not any(k[key] for key in ("unlisted", "xpass", "error", "stale"))
        out.append(
            f"| {r['version']} | `{k['file']}` | {k['unlisted']} | {k['xpass']} | {k['error']} | {k['stale']} "
            f"| {'green' if green else 'not green'} |"
        )
    for impl in IMPLS:
        cols = [r for r in releases if impl in r["impls"]]
        if not cols:
            continue
        clauses = list(dict.fromkeys(c for r in cols for c in r["impls"][impl]["clauses"]))
        out += [
            "",
            f"## {impl}, clause by clause",
            "",
            "Passed of the cases that ran (n/a when none applies); the last column gives each failure's "
            "traced cause and, where the count is not the same on every release, the count per release."
            + (VERL_NOTE if impl == "verl" else "")
            if impl in ("torch", "verl")
            else "Passed of the cases that ran; failures are counted by status.",
            "",
            "| clause | " + " | ".join(r["version"] for r in cols) + " | failures |",
            "|---|" + "---|" * (len(cols) + 1),
        ]
        for clause in clauses:
            cells, causes = [], {}
            for r in cols:
                c = r["impls"][impl]["clauses"].get(clause)
                cells.append("" if c is None else f"{c['passed']}/{c['ran']}" if c["ran"] else NA)
                for title, n in (c or {}).get("causes", {}).items():
                    causes.setdefault(title, {})[r["version"]] = n
            notes = []
            for title, per in causes.items():
                counts = set(per.values())
                where = (
                    f"{counts.pop()}"
                    if len(counts) == 1 and len(per) == len(cols)
                    else ", ".join(f"{v}: {n}" for v, n in per.items())
                )
                notes.append(f"{_cause(title, links)} ({where})")
            out.append(f"| {clause} | " + " | ".join(cells) + " | " + "; ".join(notes) + " |")
    out += [
        "",
        "## What changed from release to release",
        "",
        "`python -m conformance diff` between the reports of consecutive releases, counted per clause.",
    ]
    for d in summary["diffs"]:
        out += ["", f"### {d['impl']}: torch {d['old']} -> {d['new']}: {d['total']}", ""]
        if not d["clauses"]:
            out.append("Every case has the same status.")
        for clause, marks in d["clauses"].items():
            out.append(f"- {clause}: " + ", ".join(f"{n} {m}" for m, n in marks.items()))
        if d["deviations"]:
            shown = d["deviations"][:_DEVIATIONS_SHOWN]
            out += ["", "Deviations that appeared (+) or went (-):", ""] + [f"- `{line}`" for line in shown]
            if len(d["deviations"]) > len(shown):
                out.append(f"- and {len(d['deviations']) - len(shown)} more (`python -m conformance diff`)")
    return "\n".join(out) + "\n"


def write_doc(out: str) -> None:
    summary = build(out, _read(SUMMARY))
    _write(SUMMARY, summary)
    with open(PREAMBLE) as f:
        preamble = f.read()
    with open(DOC, "w") as f:
        f.write(render(summary, preamble))
    print(f"wrote {SUMMARY} and {DOC}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.releases.torch_matrix",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--versions", default=",".join(ALL_VERSIONS))
    parser.add_argument(
        "--impls",
        default=None,
        help=f"comma-separated, of {', '.join(IMPLS)} (default: all; verl only on {', '.join(VERL_RELEASES)})",
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "torch-matrix"))
    parser.add_argument("--rebuild", action="store_true", help="recreate the virtual environments")
    parser.add_argument(
        "--rm-venv",
        action="store_true",
        help="remove a release's environment once its reports are written (they are 3 to 6 GB)",
    )
    parser.add_argument("-k", dest="patterns", action="append", default=[], help="passed on to python -m conformance")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="use reports already in --out (VERSION-IMPL.json, written by an earlier run) instead of running again",
    )
    parser.add_argument(
        "--supplement",
        action="store_true",
        help="run only the cases -k selects (cases added since a release's full run, such as found scenarios) "
        "and keep them as VERSION-IMPL.supplement.json, whose cases take their place in the full run's report",
    )
    parser.add_argument(
        "--no-doc",
        action="store_true",
        help="do not rewrite docs/torch_releases.json and docs/TORCH_RELEASES.md (implied by -k)",
    )
    args = parser.parse_args()
    if args.supplement and not args.patterns:
        parser.error("--supplement needs -k: the cases to run again")
    versions = [v for v in args.versions.split(",") if v]
    impls = [i for i in (args.impls or ",".join(IMPLS)).split(",") if i]
    os.makedirs(args.out, exist_ok=True)
    extra = [f"-k={p}" for p in args.patterns]  # "-k=-step0": a pattern may start with a dash
    for version in versions:
        python = None
        for impl in impls:
            if impl == "verl" and args.impls is None and version not in VERL_RELEASES:
                continue
            if args.reuse and os.path.exists(os.path.join(args.out, f"{version}-{impl}.json")):
                continue
            python = python or _venv(version, args.out, args.rebuild)
            _run(python, version, impl, args.out, extra, ".supplement" if args.supplement else "")
        if python and args.rm_venv:
            shutil.rmtree(os.path.join(ROOT, ".venvs", f"torch-{version}"))
            print(f"[{version}] removed its environment", flush=True)
    if not (args.no_doc or (args.patterns and not args.supplement)):
        write_doc(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
