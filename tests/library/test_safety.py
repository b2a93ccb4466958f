"""Checkpoint safety and process hygiene: no pickle execution, private
directories that are removed, rendezvous on loopback only."""

import ast
import os
import pathlib
import pickle

import pytest
import safety_tasks
from helpers import scaled, slowness

from conformance.world.saving import read_full
from hyperdsd.testing import PoolSet, Task

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_torch_load_in_the_project_is_weights_only():
    offenders = []
    for path in (
        list(ROOT.glob("hyperdsd/**/*.py"))
        + list(ROOT.glob("conformance/**/*.py"))
        + list(ROOT.glob("tools/*.py"))
        + list(ROOT.glob("tests/*.py"))
    ):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                safe = any(
                    k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                    for k in node.keywords
                )
                if not safe:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_full_state_file_with_a_pickle_payload_is_refused(tmp_path):
    marker = tmp_path / "payload-ran"
    evil = tmp_path / "full.pt"
    import torch

    with open(evil, "wb") as f:
        pickle.dump({"model": {"w": _Payload(str(marker))}, "optim": {}}, f)
    with pytest.raises(pickle.UnpicklingError):
        read_full(str(evil))
    assert not marker.exists(), "the pickled payload ran"
    # a legitimate full-state file still loads
    torch.save(
        {"model": {"w": torch.ones(2)}, "optim": {"state": {}, "param_groups": [{"params": [], "lr": 0.1}]}},
        tmp_path / "ok.pt",
    )
    assert read_full(str(tmp_path / "ok.pt"))["optim"]["param_groups"][0]["lr"] == 0.1


@pytest.fixture(scope="module")
def pools():
    ps = PoolSet()
    yield ps
    ps.kill()


def test_pool_and_case_directories_are_private_and_removed(pools, tmp_path):

    from conformance.adapters import load_adapter
    from conformance.running.registry import by_id
    from conformance.running.runner import Runner

    outcome = pools.run(2, Task(safety_tasks.workdir_mode), scaled(30))
    assert [v["pool"] for v in outcome.values] == [0o700, 0o700]
    pool_dir = pools.pool(2).workdir
    runner = Runner(load_adapter("hyperdsd"), pools, workdir=str(tmp_path), deadline_scale=slowness())
    case_dir = runner._case_dir(by_id()["OPT-KEYS-1[single-adamw-sharded]"])
    assert os.stat(case_dir).st_mode & 0o777 == 0o700
    os.rmdir(case_dir)
    result = runner.run_case(by_id()["OPT-KEYS-1[single-adamw-sharded]"])
    assert result.status == "passed" and os.listdir(tmp_path) == [], "the case directory was not removed"
    pools.close()
    assert not os.path.exists(pool_dir), "the pool directory was not removed"


def test_rendezvous_listens_on_loopback_only(pools):
    outcome = pools.run(2, Task(safety_tasks.listening_addresses), scaled(30))
    addresses = [a for v in outcome.values for a in v]
    assert addresses, "found no listening socket to check"
    assert all(a in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for a in addresses), addresses
