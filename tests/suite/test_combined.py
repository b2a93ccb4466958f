"""SPEC 1.3 API-1: the combined get_state_dict and set_state_dict are
declared (an implementation without them gets API-1 n/a, naming them) and
judged: each defect of tools.perverse.combined fails its case, none is an error."""

import json
import types

import pytest
from helpers import run_cli, scaled, slowness

from conformance.adapters import FUNCTIONS, Adapter, AdapterError, from_module, load_adapter
from conformance.running.registry import all_cases, by_id
from conformance.running.runner import Runner, undeclared
from hyperdsd.testing import PoolSet


def _noop(*args, **kwargs):
    return None


def test_a_module_with_the_combined_functions_declares_them():
    for impl in ("hyperdsd", "torch"):
        adapter = load_adapter(impl)
        assert adapter.combined and adapter.get_state_dict is not None and adapter.set_state_dict is not None
        assert adapter.declaration()["combined"] is True
    import hyperdsd

    four = types.SimpleNamespace(**{n: getattr(hyperdsd, n) for n in FUNCTIONS + ("StateDictOptions",)})
    assert not from_module(four, "four", version="0").combined
    four.get_state_dict = hyperdsd.get_state_dict  # one of the two: not declared
    assert not from_module(four, "one-of-two", version="0").combined


def test_an_adapter_without_them_makes_api_1_not_applicable_naming_them():
    adapter = Adapter("demo", *(_noop,) * 4, options=dict)
    assert adapter.combined is False and adapter.declaration()["combined"] is False
    api = [c for c in all_cases() if c.clause == "API-1"]
    assert api and all(c.needs.combined for c in api)
    assert not any(c.needs.combined for c in all_cases() if c.clause != "API-1")
    for case in api:
        assert undeclared(adapter, case).endswith("combined (get_state_dict, set_state_dict)"), case.id
    both = Adapter("demo", *(_noop,) * 4, options=dict, get_state_dict=_noop, set_state_dict=_noop)
    assert both.combined and not undeclared(both, by_id()["API-1[fsdp2-adamw-bcast]"])
    off = Adapter("demo", *(_noop,) * 4, options=dict, get_state_dict=_noop, set_state_dict=_noop, combined=False)
    assert "combined" in undeclared(off, by_id()["API-1[fsdp2-adamw-bcast]"])  # declared off
    with pytest.raises(AdapterError, match="give both"):
        Adapter("demo", *(_noop,) * 4, options=dict, get_state_dict=_noop)
    with pytest.raises(AdapterError, match="give both"):
        Adapter("demo", *(_noop,) * 4, options=dict, combined=True)


def test_api_1_runs_in_every_mode_on_the_layout_families():
    api = [c for c in all_cases() if c.clause == "API-1"]
    for layout in ("single", "ddp", "fsdp2", "hsdp2x2", "pp2xfsdp2"):
        assert {str(c.mode) for c in api if c.layout.name == layout} == {
            "sharded",
            "full",
            "full_cpu",
            "bcast",
            "file",
            "flat",
            "dcp",
        }, layout


def test_list_with_impl_says_why_api_1_does_not_run():
    proc, _ = run_cli(["--list", "--impl", "tools.perverse.combined:without_combined", "-k", "API-1[fsdp2-adamw-"])
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert rows and all(not r["runs"] for r in rows)
    assert all(
        r["not_applicable"] == "without-combined does not declare combined (get_state_dict, set_state_dict)"
        for r in rows
    )
    assert "; combined no" in proc.stderr


@pytest.fixture(scope="module")
def pools():
    pools = PoolSet()
    yield pools
    pools.kill()


def _run(pools, impl, case_id, **kwargs):
    runner = Runner(load_adapter(impl), pools, deadline_scale=slowness(), **kwargs)
    try:
        return runner.run_case(by_id()[case_id])
    finally:
        runner.close()


@pytest.mark.parametrize(
    "impl, case_id, status, words",
    [
        ("hyperdsd", "API-1[single-adamw-sharded]", "passed", ""),
        ("tools.perverse.combined:without_combined", "API-1[single-adamw-sharded]", "n/a", "does not declare combined"),
        ("tools.perverse.combined:get_returns_none", "API-1[single-adamw-sharded]", "failed", "returned NoneType"),
        ("tools.perverse.combined:get_drops_a_key", "API-1[single-adamw-full]", "failed", "absent, expected present"),
        (
            "tools.perverse.combined:set_ignores_strict",
            "API-1[fsdp2-adamw-sharded-strict]",
            "failed",
            "no error was raised",
        ),
    ],
)
def test_each_defect_of_the_combined_functions_fails_its_case(pools, impl, case_id, status, words):
    result = _run(pools, impl, case_id)
    assert result.status == status, f"{case_id}: {result.status}\n{result.message}"
    assert words in result.message


def test_a_broadcast_that_leaves_the_root_waiting_fails(pools):
    """torch's combined set: the other ranks skip the model's broadcast; the root waits (SPEC §4: failed)."""
    result = _run(
        pools, "tools.perverse.combined:set_skips_an_empty_model", "API-1[fsdp2-adamw-bcast]", timeout=scaled(20)
    )
    assert result.status == "failed", result.message
    assert "set_state_dict" in result.message
