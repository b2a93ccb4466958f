"""The command line: usage errors, faulty implementations, reports and xfails."""

import json
import os
import signal
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET

import pytest
import torch
from helpers import (
    ROOT,
    TESTS,
    is_multiprocessing_helper,
    kill_marked,
    left_behind,
    lingering,
    marked_processes,
    run_cli,
    scaled,
    wait_for,
)

from conformance import SPEC_VERSION

ADAMW = "OPT-KEYS-1[fsdp4-adamw-sharded]"
SGD = "OPT-KEYS-1[fsdp4-sgd-sharded]"
# The per-case deadline for a hung implementation, scaled to the machine:
# the hang test waits it out, the hang must be reached within it, and the
# SGD case after it must pass within it (each well under a second on a quiet
# reference machine). Faults that end a case as they happen get a deadline
# far above any load: only a harness that missed the event would reach it.
HANG_TIMEOUT = scaled(15)
FAULT_TIMEOUT = scaled(300)
# Waits on an event (the CLI exits, a case is printed): only a hang reaches these.
EVENT_LIMIT_S = scaled(300)


def test_list_prints_the_manifest():
    proc, _ = run_cli(["--list", "-k", "OPT-KEYS-1[fsdp4"])
    assert proc.returncode == 0
    entries = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {e["id"] for e in entries} == {
        ADAMW,
        SGD,
        "OPT-KEYS-1[fsdp4-adamw-full]",
        "OPT-KEYS-1[fsdp4-sgd-full]",
        "OPT-KEYS-1[fsdp4-adamw-full_cpu]",
    }
    assert all(e["clause"] == "OPT-KEYS-1" and e["world_sizes"] == [4] for e in entries)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--world-sizes", "x"], "comma-separated"),
        (["--impl", "no_such_module_here"], "cannot import"),
        (["-k", "NO-SUCH-CLAUSE"], "no case matches"),
        (["--mesh", "2y2"], "joined by 'x'"),
        (["--timeout", "-1"], "positive"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "nosuchdevice"], "not"),
        (["--device", "nosuchdevice"], "not a torch device type"),
        (["--device", "cuda:1"], "device type such as"),
        (["--backend", "nosuchbackend"], "no such process-group backend"),
    ],
)
def test_usage_errors_exit_2(args, needle, capsys, monkeypatch):
    # In process: a usage error is found before any rank starts.
    from conformance.cli import main
    from hyperdsd.testing import PoolSet

    monkeypatch.setattr(PoolSet, "__init__", lambda *a, **k: pytest.fail("a usage error started rank pools"))
    assert main(args) == 2
    assert needle in capsys.readouterr().err


def test_a_usage_error_is_the_commands_exit_status_2():
    proc, _ = run_cli(["--mesh", "2y2"])
    assert proc.returncode == 2 and "joined by 'x'" in proc.stderr, proc.stderr


def test_missing_numpy_is_one_clear_usage_error(monkeypatch, capsys):
    # torch's wheel does not pull numpy in, yet its object collectives need
    # it: without it every case would fail alike, so the run refuses to start.
    from conformance.cli import main

    monkeypatch.setitem(sys.modules, "numpy", None)  # makes `import numpy` raise ImportError
    assert main(["-k", "OPT-KEYS-1[single"]) == 2
    err = capsys.readouterr().err
    assert "numpy is not installed" in err and "pip install numpy" in err


@pytest.mark.parametrize(
    "fault, rank, words",
    [
        ("hang", 1, ("rank 1",)),
        ("exit3", 2, ("rank 2", "exited with code 3")),
        ("sigkill", 3, ("rank 3", "SIGKILL")),
        ("raises", 1, ("rank 1", "faulty implementation fails on rank 1")),
    ],
)
def test_faulty_implementation_is_reported_and_the_run_goes_on(tmp_path, fault, rank, words):
    report = tmp_path / "report.json"
    timeout = HANG_TIMEOUT if fault == "hang" else FAULT_TIMEOUT
    args = [
        "--impl",
        f"tools.perverse.faulty:{fault}",
        "-k",
        ADAMW,
        "-k",
        SGD,
        "--timeout",
        str(timeout),
        "--json",
        str(report),
    ]
    proc, mark = run_cli(args, env={"FAULTY_IMPL_MARKERS": str(tmp_path)})
    assert left_behind(mark) == []  # the run's ranks and helpers are gone when it returns
    assert proc.returncode == 1, proc.stdout + proc.stderr
    if fault == "hang":
        assert (tmp_path / "hang-rank1").exists(), f"the hang was not reached within {timeout} s:\n{proc.stdout}"
    data = json.loads(report.read_text())
    cases = {c["id"]: c for c in data["cases"]}
    bad, good = cases[ADAMW], cases[SGD]
    # The implementation's own fault (raising, hanging or dying inside its
    # call) is a deviation, never an error of the suite.
    assert bad["status"] == "failed", bad["message"]
    assert "in get_optimizer_state_dict" in bad["message"], bad["message"]
    for w in words:
        assert w in bad["message"], bad["message"]
    assert rank in bad["ranks"]
    if fault == "hang":
        # Cut off by --timeout, not by the case's own deadline or a gloo timeout.
        assert f"{timeout} s deadline" in bad["message"], bad["message"]
        assert bad["duration_s"] >= timeout
    else:
        assert bad["duration_s"] < timeout  # seen as it happened, not at the deadline
    assert (
        bad["repro"] == f"python -m conformance --impl tools.perverse.faulty:{fault} -k '{ADAMW}' --timeout {timeout}"
    )
    assert good["status"] == "passed", good["message"]
    # One line as it happened, then the deviation once with its repro.
    assert proc.stdout.count(f"FAIL  {ADAMW} ") == 1 and "D1 FAIL in 1 case(s) of OPT-KEYS-1" in proc.stdout
    assert f"repro: {bad['repro']}" in proc.stdout


def _env(mark: str, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]), HYPERDSD_TEST_MARK=mark, **extra)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except OSError:
        return 0  # gone


def test_nothing_the_run_started_outlives_it_with_a_hanging_rank(tmp_path):
    # A CI step that looks for leftover processes right after the run finds
    # none: not the fork server, not its resource tracker, not a rank.
    mark = uuid.uuid4().hex
    env = _env(mark, FAULTY_IMPL_MARKERS=str(tmp_path))
    out_path = tmp_path / "out.txt"
    with open(out_path, "w") as out:  # not a pipe: reading one to its end waits for every holder
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "conformance",
                "--impl",
                "tools.perverse.faulty:hang",
                "-k",
                ADAMW,
                "--timeout",
                str(scaled(8)),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        assert wait_for(lambda: (tmp_path / "hang-rank1").exists() or proc.poll() is not None, EVENT_LIMIT_S)
        started = marked_processes(mark)
        helpers = [pid for pid in started if is_multiprocessing_helper(pid) and _parent(pid) == proc.pid]
        proc.wait(timeout=EVENT_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert left_behind(mark) == []  # the moment it returned
    out = out_path.read_text()
    assert proc.returncode == 1 and "missed the" in out, out
    assert len(helpers) == 2, "the run had started a fork server and a resource tracker"
    assert len(started) >= 7, "the CLI, its two helpers and four ranks were running at the hang"


def test_json_and_junit_agree_and_unused_xfail_warns(tmp_path):
    xfails = tmp_path / "xfails.txt"
    xfails.write_text(
        "# expected failures\n"
        "OPT-PART-2[single-sharded]  # lazy state: torch raises on a parameter without state\n"
        "OPT-NOPE-9  # matches nothing\n"
    )
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    proc, mark = run_cli(
        [
            "--impl",
            "torch",
            "-k",
            "OPT-PART-2[single-sharded]",
            "-k",
            "OPT-KEYS-1[single-sgd",
            "--xfails",
            str(xfails),
            "--json",
            str(report),
            "--junit",
            str(junit),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OPT-NOPE-9" in proc.stderr and "matches no case" in proc.stderr
    data = json.loads(report.read_text())
    assert data["spec_version"] == SPEC_VERSION and data["impl"]["name"] == "torch"
    assert set(data) >= {"spec_version", "suite_version", "impl", "torch_version", "world_sizes", "cases", "summary"}
    assert any("OPT-NOPE-9" in w for w in data["warnings"])
    statuses = {c["id"]: c["status"] for c in data["cases"]}
    assert statuses["OPT-PART-2[single-sharded]"] == "xfail"
    assert sum(data["summary"].values()) == len(data["cases"]) == 3

    suite = ET.parse(junit).getroot().find("testsuite")
    assert int(suite.get("tests")) == 3
    from_junit = {}
    for tc in suite.findall("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.find("properties")}
        child = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), None)
        skipped = tc.find("skipped")
        expected_child = {"failed": "failure", "error": "error", "xfail": "skipped", "n/a": "skipped"}.get(
            props["status"]
        )
        assert child == expected_child
        if skipped is not None:
            assert skipped.get("type") == props["status"]
        from_junit[tc.get("name")] = props["status"]
    assert from_junit == statuses
    assert int(suite.get("failures")) == data["summary"]["failed"]
    assert int(suite.get("errors")) == data["summary"]["error"]
    assert left_behind(mark) == []


# `python -m conformance` as a terminal starts it: with Ctrl-C's default
# handler. A shell without job control starts a background job (`.ci/run &`)
# with SIGINT ignored, every child inherits that, and the run would ignore the
# Ctrl-C this test sends.
_WITH_CTRL_C = [
    sys.executable,
    "-c",
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('conformance', run_name='__main__', alter_sys=True)",
]


@pytest.mark.parametrize("stage", ["while-ranks-start", "mid-run"])
def test_ctrl_c_stops_every_rank_and_writes_a_partial_report(tmp_path, stage):
    report, out_path = tmp_path / "partial.json", tmp_path / "out.txt"
    mark = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]), HYPERDSD_TEST_MARK=mark)
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [*_WITH_CTRL_C, "--impl", "torch", "-k", "OPT-RT-1[fsdp4", "--json", str(report)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    if stage == "while-ranks-start":

        def reached():
            return len(marked_processes(mark)) >= 5  # the CLI and its four ranks
    else:

        def reached():
            return "OPT-RT-1[" in out_path.read_text()  # the first of 30 cases is done

    try:
        assert wait_for(lambda: reached() or proc.poll() is not None, EVENT_LIMIT_S), f"{stage} not reached"
        assert proc.poll() is None, "the run ended before Ctrl-C:\n" + out_path.read_text()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=EVENT_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            kill_marked(mark)
    assert left_behind(mark) == []  # checked the moment the run returned
    out = out_path.read_text()
    assert proc.returncode == 1, out
    assert "interrupted" in out
    data = json.loads(report.read_text())
    assert data["complete"] is False
    if stage == "mid-run":
        assert 1 <= len(data["cases"]) < 30


def test_torchrun_runs_cases_on_the_launched_world(tmp_path):
    report = tmp_path / "torchrun.json"
    mark = uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]), HYPERDSD_TEST_MARK=mark)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "conformance",
            "--impl",
            "hyperdsd",
            "-k",
            "OPT-KEYS-1[fsdp2-adamw",
            "-k",
            "OPT-KEYS-1[single-adamw-sharded]",
            "-k",
            "OPT-KEYS-1[fsdp4-adamw-sharded]",
            "--json",
            str(report),
            "-v",
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=EVENT_LIMIT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["launcher"] == "torchrun" and data["world_sizes"] == [1, 2]
    statuses = {c["id"]: c for c in data["cases"]}
    assert statuses["OPT-KEYS-1[single-adamw-sharded]"]["status"] == "passed"  # on a sub-world of one rank
    assert statuses["OPT-KEYS-1[fsdp2-adamw-sharded]"]["status"] == "passed"
    assert statuses["OPT-KEYS-1[fsdp2-adamw-full]"]["status"] == "passed"
    na = statuses["OPT-KEYS-1[fsdp4-adamw-sharded]"]
    assert na["status"] == "n/a" and "needs world size 4" in na["message"]
    assert proc.stdout.count("PASS  OPT-KEYS-1[fsdp2-adamw-sharded]") == 1, "only rank 0 reports"
    assert lingering(mark) == []


def test_torchrun_hang_ends_the_run_with_stacks_and_a_partial_report(tmp_path):
    # The hung case trains before it reaches the planted hang, for as long as
    # the machine makes it. A deadline that ran out first was judged right
    # (still training) but says nothing of the hang: the run is then repeated
    # with twice the deadline. The premise is the hang's own marker, not a time.
    timeout = scaled(8)
    for attempt in range(3):
        report, markers = tmp_path / f"hang{attempt}.json", tmp_path / f"markers{attempt}"
        markers.mkdir()
        mark = uuid.uuid4().hex
        env = _env(mark, FAULTY_IMPL_MARKERS=str(markers))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "4",
                "-m",
                "conformance",
                "--impl",
                "tools.perverse.faulty:hang",
                "-k",
                SGD,
                "-k",
                ADAMW,
                "--timeout",
                str(timeout),
                "--json",
                str(report),
            ],
            cwd=str(tmp_path),
            env=env,
            capture_output=True,
            text=True,
            timeout=EVENT_LIMIT_S + 4 * timeout,
        )
        assert lingering(mark) == []
        if (markers / "hang-rank1").exists():
            break
        timeout *= 2
    else:
        pytest.fail(f"the hang was not reached within a {timeout // 2} s deadline in 3 runs:\n{proc.stdout[-3000:]}")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Ended by the deadline (the run did not wait for the subprocess limit).
    assert "run aborted" in out and f"did not report within the {timeout} s deadline" in out, out[-3000:]
    data = json.loads(report.read_text())
    assert data["complete"] is False
    statuses = {c["id"]: c["status"] for c in data["cases"]}
    assert statuses == {ADAMW: "failed"}, statuses  # the run stops at the hung case, a hang of the implementation
    assert "in get_optimizer_state_dict" in data["cases"][0]["message"], data["cases"][0]["message"]


def test_exitfirst_stops_after_the_first_failure(tmp_path):
    report = tmp_path / "x.json"
    proc, mark = run_cli(
        ["--impl", "tools.perverse.faulty:raises", "-k", ADAMW, "-k", SGD, "-x", "--json", str(report)]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert [c["id"] for c in data["cases"]] == [ADAMW] and data["cases"][0]["status"] == "failed"
    assert left_behind(mark) == []
