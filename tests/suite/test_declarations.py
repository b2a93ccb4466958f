"""SPEC 1.2: what an implementation declares decides which cases run (§1); a
pass is the implementation's own (§4); extra state is MODEL-5's alone."""

import json

import pytest
from helpers import run_cli, slowness

from conformance.adapters import LAYOUT_CAPABILITIES, Adapter, AdapterError, load_adapter
from conformance.running.registry import all_cases, by_id
from conformance.running.runner import Runner, undeclared
from hyperdsd.testing import PoolSet

CONSOLIDATED = "conformance.examples.consolidated_adapter"


def _adapter(**declared):
    return Adapter("demo", *(lambda *a, **k: None,) * 4, options=dict, **declared)


def test_get_and_load_modes_are_declared_apart():
    a = _adapter(get_modes={"full_cpu"}, load_modes={"file"})
    assert a.modes == {"file"}  # the round trip a full_cpu get and a file load make
    assert not undeclared(a, by_id()["OPT-RT-1[fsdp4-adamw-file]"])
    assert not undeclared(a, by_id()["OPT-RT-3[fsdp4-adamw-full_cpu]"])  # get side: any declared get mode
    assert not undeclared(a, by_id()["OPT-ATOM-2[fsdp4-file-wrong_shape]"])
    assert "load mode 'full_cpu'" in undeclared(a, by_id()["OPT-RT-1[fsdp4-adamw-full_cpu]"])
    assert "get mode 'sharded', load mode 'dcp'" in undeclared(a, by_id()["OPT-RT-1[fsdp4-adamw-dcp]"])
    # ``modes`` still declares both sides; bcast and file loads read a full_cpu get.
    legacy = _adapter(modes={"full", "bcast"})
    assert legacy.get_modes == {"full", "full_cpu"} and legacy.load_modes == {"full", "bcast"}
    assert legacy.modes == {"full", "bcast"}
    assert _adapter().modes == set(a.load_modes) | {"sharded", "full", "full_cpu", "bcast", "flat", "dcp"}


def test_layouts_and_options_are_needs_too():
    a = _adapter(layouts=set(), supported_options={"strict"})
    assert "layout 'pipeline'" in undeclared(a, by_id()["OPT-RT-1[pp2-adamw-sharded]"])
    assert "layout 'tensor_parallel'" in a.lacks(by_id()["OPT-RT-1[fsdp2xtp2-adamw-sharded]"].needs)
    assert "layout 'several_meshes'" in undeclared(a, by_id()["OPT-MESH-1[fsdp4+ep2x2-adamw-sharded]"])
    assert "layout 'part_of_world'" in undeclared(a, by_id()["OPT-MESH-2[halves2+2-adamw-sharded]"])
    assert "option 'options_type'" in undeclared(a, by_id()["OPT-ATOM-3[single-optim]"])
    assert "option 'ignore_frozen_params'" in undeclared(a, by_id()["OPT-PART-3[single-sharded]"])
    assert not undeclared(a, by_id()["MODEL-2[single-sharded-nonstrict]"])
    no_strict = _adapter(supported_options=set())
    assert "option 'strict'" in undeclared(no_strict, by_id()["MODEL-2[single-sharded-nonstrict]"])
    assert not undeclared(no_strict, by_id()["MODEL-2[single-sharded-strict]"])
    with pytest.raises(AdapterError, match="layouts"):
        _adapter(layouts={"pipelines"})
    with pytest.raises(AdapterError, match="get modes"):
        _adapter(get_modes={"file"})


def test_every_case_knows_what_it_needs():
    for case in all_cases():
        needs = case.needs
        if case.mode is not None:
            assert needs.get or needs.load, case.id
        assert set(needs.layouts) <= set(LAYOUT_CAPABILITIES), case.id


def test_list_with_impl_says_what_would_run_and_why_not():
    proc, _ = run_cli(["--list", "--impl", CONSOLIDATED, "-k", "OPT-RT-1[fsdp4-adamw", "-k", "OPT-ATOM-3[single"])
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert rows["OPT-RT-1[fsdp4-adamw-file]"]["runs"] is True
    assert rows["OPT-RT-1[fsdp4-adamw-full_cpu]"]["not_applicable"].endswith("does not declare load mode 'full_cpu'")
    assert "option 'options_type'" in rows["OPT-ATOM-3[single-optim]"]["not_applicable"]
    assert "declares: get full_cpu; load file; layouts none; options none" in proc.stderr
    assert f"{sum(r['runs'] for r in rows.values())} would run for consolidated-example" in proc.stderr


@pytest.fixture(scope="module")
def pools():
    pools = PoolSet()
    yield pools
    pools.kill()


def _run(pools, impl, case_id):
    runner = Runner(load_adapter(impl), pools, deadline_scale=slowness())
    try:
        return runner.run_case(by_id()[case_id])
    finally:
        runner.close()


def test_an_error_the_adapter_raises_is_no_pass_and_a_refusal_is_not_applicable(pools):
    raised = _run(pools, "tools.perverse.declared:adapter_raises", "OPT-ATOM-3[single-optim]")
    assert raised.status == "failed" and "outside the implementation's own call" in raised.message
    refused = _run(pools, "tools.perverse.declared:adapter_refuses", "OPT-ATOM-3[single-optim]")
    assert refused.status == "n/a" and "has no options type" in refused.message
    own = _run(pools, "hyperdsd", "OPT-ATOM-3[single-optim]")  # raised inside the implementation: its pass
    assert own.status == "passed", own.message


@pytest.mark.parametrize(
    "case_id, status",
    [
        ("MODEL-1[fsdp2-full]", "passed"),
        ("MODEL-2[single-sharded-strict]", "passed"),
        ("MODEL-3[fsdp2-bcast]", "passed"),
        ("MODEL-4[fsdp2-bcast]", "passed"),
        ("MODEL-5[fsdp2-full-tensor]", "passed"),
        ("MODEL-5[fsdp2-full-dict]", "failed"),
        ("MODEL-5[fsdp2-sharded-object]", "failed"),
    ],
)
def test_an_extra_state_defect_fails_model_5_only(pools, case_id, status):
    result = _run(pools, "tools.perverse.declared:tensors_only", case_id)
    assert result.status == status, f"{case_id}: {result.status}\n{result.message}"
    if status == "failed":
        assert "_extra_state" in result.message


@pytest.mark.parametrize(
    "case_id, status, words",
    [
        ("OPT-RT-1[fsdp2-adamw-file]", "passed", ""),  # a full_cpu get read back by a file load
        ("OPT-KEYS-1[fsdp4-adamw-full_cpu]", "passed", ""),  # get side with the declared get mode
        ("OPT-ATOM-2[single-file-wrong_shape]", "failed", "no error was raised"),  # the positional load
        ("OPT-ATOM-1[single-file-unknown_fqn]", "failed", "no error was raised"),
        ("OPT-ATOM-3[single-optim]", "n/a", "option 'options_type'"),
        ("MODEL-2[single-file-nonstrict]", "n/a", "option 'strict'"),
        ("OPT-RT-1[pp2-adamw-file]", "n/a", "layout 'pipeline'"),
        ("OPT-RT-1[fsdp2-adamw-sharded]", "n/a", "get mode 'sharded', load mode 'sharded'"),
    ],
)
def test_the_consolidated_example_deviates_where_it_really_does(pools, case_id, status, words):
    result = _run(pools, CONSOLIDATED, case_id)
    assert result.status == status, f"{case_id}: {result.status}\n{result.message}"
    assert words in result.message


def test_rank_device_is_the_parameters_or_the_runs_for_a_meta_model():
    import torch
    import torch.nn as nn

    from conformance import adapters

    with torch.device("meta"):
        on_meta = nn.Linear(2, 2)
    assert adapters.rank_device(nn.Linear(2, 2)) == torch.device("cpu")
    saved = list(adapters._RANK_DEVICE)
    try:
        adapters.set_rank_device(torch.device("cuda", 1))  # what --device cuda gives local rank 1
        assert adapters.rank_device(on_meta) == torch.device("cuda", 1)
        assert adapters.rank_device(nn.Linear(2, 2)) == torch.device("cpu")  # where its parameters are
    finally:
        adapters._RANK_DEVICE[:] = saved


def test_every_report_states_the_declaration_and_the_coverage(tmp_path):
    proc, _ = run_cli(
        [
            "--impl",
            CONSOLIDATED,
            "-k",
            "OPT-RT-1[single-adamw-file]",
            "-k",
            "OPT-ATOM-3[single-optim]",
            "--report",
            str(tmp_path),
            "--json",
            str(tmp_path / "run.json"),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    declared = "get full_cpu; load file; layouts none; options none"
    assert f"declared: {declared}" in proc.stdout
    assert "coverage: 1 of " in proc.stdout and "not exercised: OPT-KEYS-1, " in proc.stdout
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["declaration"]["load_modes"] == ["file"] and data["coverage"]["exercised"] == ["OPT-RT-1"]
    md = (tmp_path / "report.md").read_text().splitlines()
    assert md[2].startswith("**Level: not certified**")  # a filtered run certifies nothing
    assert md[3].startswith("Coverage: 1 of ") and md[4].startswith(f"Declared: {declared}")
    assert f"Declared: {declared}" in (tmp_path / "report.html").read_text()
    assert declared in (tmp_path / "junit.xml").read_text()
