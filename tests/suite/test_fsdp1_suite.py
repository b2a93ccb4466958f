"""SPEC 1.3 §2's FSDP1 layouts in the suite (issue 37): ``fsdp1-{N}``,
``fsdp1-{N}-flat``, ``hsdp1-{R}x{S}`` and a SHARD_GRAD_OP variant; their cases
need the layout ``fsdp1`` declared, and a DCP checkpoint moves between FSDP1
and FSDP2 both ways."""

import json

import pytest

from conformance.adapters import LAYOUT_CAPABILITIES, Adapter
from conformance.running.registry import all_cases, by_id
from conformance.running.runner import undeclared
from conformance.world.layouts import parse_layout

FSDP1_LAYOUTS = ("fsdp1-2", "fsdp1-4-flat", "hsdp1-2x2", "fsdp1-2-shard_grad_op")


def _fsdp1_cases():
    return [c for c in all_cases() if any(p.startswith(("fsdp1-", "hsdp1-")) for p in c.layout.name.split("_to_"))]


def test_fsdp1_layouts_parse():
    lay = parse_layout("fsdp1-2")
    assert (lay.kind.name, lay.world_size, lay.mesh, lay.wrapper, lay.kind.flat_params) == (
        "fsdp1",
        2,
        "2",
        "fsdp1",
        False,
    )
    flat = parse_layout("fsdp1-4-flat")
    assert (flat.world_size, flat.kind.flat_params) == (4, True)
    hsdp = parse_layout("hsdp1-2x2")
    assert (hsdp.world_size, hsdp.mesh, hsdp.dim_names) == (4, "2x2", ("replicate", "shard"))
    assert parse_layout("fsdp1-2-shard_grad_op").kind.name == "fsdp1-shard_grad_op"
    assert parse_layout("fsdp4").wrapper == "fsdp2" and parse_layout("fsdp1").kind.name == "fsdp"  # FSDP2 on one rank
    with pytest.raises(ValueError, match="policy variants"):
        parse_layout("fsdp1-2.bf16")
    with pytest.raises(ValueError, match="unknown layout"):
        parse_layout("fsdp1-2-flat-shard_grad_op")


def test_fsdp1_cases_need_the_layout_fsdp1_and_cover_the_clauses():
    cases = _fsdp1_cases()
    assert 300 <= len(cases) <= 450, len(cases)
    # Every core clause runs on FSDP1 but these, each with its reason in docs/CONFORMANCE.md
    # ("FSDP1 layouts"): by subject, or by FSDP1's own behaviour.
    core = {c.clause for c in all_cases() if c.profile == "core"}
    assert core - {c.clause for c in cases} == {
        *("OPT-DT-1", "OPT-DT-2", "OPT-MESH-1", "OPT-MESH-2", "OPT-MPMD-1", "OPT-MPMD-2", "OPT-MPMD-3", "LOOP-3"),
        "OPT-PART-5",
    }
    assert all("fsdp1" in c.needs.layouts for c in cases)
    assert "fsdp1" in LAYOUT_CAPABILITIES
    assert not any("fsdp1" in c.needs.layouts for c in all_cases() if c not in cases)
    on = {layout: {c.clause for c in cases if c.layout.name == layout} for layout in FSDP1_LAYOUTS}
    assert all({"OPT-RT-1", "OPT-RT-5", "OPT-PURE-2", "MODEL-1"} <= clauses for clauses in on.values()), on
    modes = {(c.layout.name, str(c.mode)) for c in cases if c.clause == "OPT-RT-1"}
    assert modes == {
        (lay, m) for lay in FSDP1_LAYOUTS for m in ("sharded", "full", "full_cpu", "bcast", "file", "flat", "dcp")
    }
    ids = by_id()  # the matrix test runs these on hyperdsd: a DCP checkpoint moves between FSDP1 and FSDP2
    for pair in (
        "fsdp1-4-flat_to_fsdp4",
        "fsdp4_to_fsdp1-4-flat",
        "fsdp4_to_fsdp1-2",
        "fsdp1-2_to_fsdp2",
        "fsdp2_to_fsdp1-2",
    ):
        assert f"OPT-RESHARD-1[{pair}-adamw-dcp]" in ids, pair
    keys2 = {c.id for c in cases if c.clause == "OPT-KEYS-2"}
    assert {"OPT-KEYS-2[fsdp1-2-sharded-checkpoint+compile]", "OPT-KEYS-2[fsdp1-2-full-compile]"} <= keys2
    assert any(c.layout.name == "fsdp1-2-shard_grad_op" and c.clause == "LOOP-1" for c in cases)


def test_an_adapter_without_fsdp1_gets_them_not_applicable():
    a = Adapter("demo", *(lambda *a, **k: None,) * 4, options=dict, layouts=set())
    assert "layout 'fsdp1'" in undeclared(a, by_id()["OPT-RT-1[fsdp1-2-adamw-sharded]"])
    assert "layout 'fsdp1'" in undeclared(a, by_id()["OPT-RESHARD-1[fsdp4_to_fsdp1-2-adamw-dcp]"])
    assert not undeclared(a, by_id()["OPT-RT-1[fsdp4-adamw-sharded]"])


def test_list_shows_the_fsdp1_cases(capsys):
    from conformance.cli import main

    assert main(["--list", "-k", "fsdp1-4-flat"]) == 0
    entries = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert entries and all(e["needs"]["layouts"] == ["fsdp1"] for e in entries)
    assert "OPT-RESHARD-1[fsdp1-4-flat_to_fsdp4-adamw-dcp]" in {e["id"] for e in entries}
