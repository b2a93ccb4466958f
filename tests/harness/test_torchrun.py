"""The suite under torchrun: every world size on sub-worlds of the launched
ranks, the same verdicts as with spawned pools, and worlds across two node
agents on loopback."""

import json
import os
import socket
import subprocess
import sys
import uuid
from unittest import mock

from helpers import ROOT, TESTS, lingering, scaled, slowness, wait_for

# Waits on an event (a process exits, a thread acts): only a hang reaches these.
EVENT_LIMIT_S = scaled(600)

# 1-, 2- and 3-rank cases, a failing rank's release and regroup, and
# resharding between world sizes (phases on sub-worlds of their own).
SLICE = [
    "-k",
    "OPT-RT-1[single-adamw-dcp]",
    "-k",
    "OPT-RT-1[fsdp2-sgd-full]",
    "-k",
    "OPT-RT-1[fsdp3-adamw-bcast]",
    "-k",
    "OPT-KEYS-1[fsdp4-adamw",
    "-k",
    "OPT-ATOM-4[fsdp2-bcast]",
    "-k",
    "OPT-RESHARD-1[fsdp4_to_fsdp2-sgd",
    "-k",
    "OPT-RESHARD-3[single_to_fsdp3",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, cwd, mark, launcher_args=("--standalone", "--nproc-per-node", "4")):
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([TESTS, ROOT]),
        HYPERDSD_TEST_MARK=mark,
        CONFORMANCE_DEADLINE_SCALE=f"{slowness():.2f}",
    )
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "conformance", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _statuses(path) -> dict:
    return {c["id"]: c["status"] for c in json.loads(path.read_text())["cases"]}


def test_every_world_size_runs_on_sub_worlds_with_the_pools_verdicts(tmp_path):
    mark = uuid.uuid4().hex
    launched = tmp_path / "torchrun.json"
    proc = _torchrun([*SLICE, "--json", str(launched)], str(tmp_path), mark)
    out, _ = proc.communicate(timeout=EVENT_LIMIT_S)
    assert proc.returncode == 0, out[-4000:]
    # The pools' verdict on every case of the slice is "passed" (the matrix test runs each on
    # pools): the launched world must select the same cases and pass them all, none n/a.
    from conformance.running.registry import all_cases

    patterns = SLICE[1::2]
    got, want = _statuses(launched), {c.id: "passed" for c in all_cases() if any(p in c.id for p in patterns)}
    assert got == want
    sizes = json.loads(launched.read_text())["world_sizes"]
    assert sizes == [1, 2, 3, 4]
    assert lingering(mark) == []


def test_a_failing_rank_under_torchrun_releases_the_others_and_the_run_goes_on(tmp_path):
    mark = uuid.uuid4().hex
    report = tmp_path / "faulty.json"
    adamw, sgd = "OPT-KEYS-1[fsdp4-adamw-sharded]", "OPT-KEYS-1[fsdp4-sgd-sharded]"
    args = [
        "--impl",
        "tools.perverse.faulty:raises",
        "-k",
        adamw,
        "-k",
        sgd,
        "--timeout",
        str(scaled(300)),
        "--json",
        str(report),
    ]
    proc = _torchrun(args, str(tmp_path), mark)
    out, _ = proc.communicate(timeout=EVENT_LIMIT_S)
    assert proc.returncode == 1, out[-4000:]
    cases = {c["id"]: c for c in json.loads(report.read_text())["cases"]}
    assert cases[adamw]["status"] == "failed" and cases[sgd]["status"] == "passed"
    message = cases[adamw]["message"]
    assert "rank 1 raised ValueError in get_optimizer_state_dict" in message, message
    assert "ranks 0,2,3 blocked in a collective until rank 1 left the process group" in message, message
    assert cases[adamw]["duration_s"] < scaled(300)  # released at once, not at the deadline
    assert lingering(mark) == []


def test_two_node_agents_on_loopback_form_one_world(tmp_path):
    mark = uuid.uuid4().hex
    port = str(_free_port())
    shared = tmp_path / "shared"
    shared.mkdir()
    reports = [tmp_path / f"node{n}.json" for n in (0, 1)]
    procs = [
        _torchrun(
            [
                "-k",
                "OPT-KEYS-1[fsdp4-adamw",
                "-k",
                "OPT-RT-1[single-adamw-dcp]",
                "-k",
                "OPT-RESHARD-1[fsdp4_to_fsdp2-sgd",
                "--workdir",
                str(shared),
                "--json",
                str(reports[n]),
            ],
            str(tmp_path),
            mark,
            launcher_args=(
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "static",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ),
        )
        for n in (0, 1)
    ]
    outs = [p.communicate(timeout=EVENT_LIMIT_S)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    data = json.loads(reports[0].read_text())  # rank 0 lives on node 0 and reports
    assert not reports[1].exists()
    assert data["launcher"] == "torchrun" and data["world_sizes"] == [1, 2, 4]
    assert set(_statuses(reports[0]).values()) == {"passed"} and len(data["cases"]) == 5
    assert os.listdir(shared) == [], "the run's case directories are removed, the shared directory kept"
    assert lingering(mark) == []


def test_a_rank_still_running_after_a_peer_left_releases_itself():
    """A rank blocked on a peer that left does not always see the connection
    drop; the watchdog closes its own after a grace period, once."""
    import threading
    import time

    from hyperdsd.testing import world

    left, released = threading.Event(), []
    dog = world._Watchdog(
        EVENT_LIMIT_S, lambda: None, None, peer_left=left.is_set, release=lambda: released.append(time.monotonic())
    )
    with dog:
        time.sleep(0.6)
        assert not released  # no peer left yet
        noticed = time.monotonic()
        left.set()
        assert wait_for(lambda: released, EVENT_LIMIT_S)
    dog._thread.join(EVENT_LIMIT_S)  # done watching: nothing more can be released
    assert len(released) == 1 and released[0] - noticed >= world._RELEASE_AFTER_S, (released, noticed)

    # Done before the grace period ends: nothing released. The period is made
    # long enough that no load can stretch the body past it.
    quick = []
    dog = world._Watchdog(EVENT_LIMIT_S, lambda: None, None, peer_left=lambda: True, release=lambda: quick.append(1))
    with mock.patch.object(world, "_RELEASE_AFTER_S", EVENT_LIMIT_S):
        with dog:
            time.sleep(0.3)
        dog._thread.join(EVENT_LIMIT_S)
    assert not quick
