"""SPEC LOOP: the loop points, the FSDP2 policy variants, and that a deviation
only a loop point can show fails LOOP, not the clauses taken at rest."""

import pytest
from helpers import runner_on

from conformance.modes import MODES
from conformance.running.generated import clauses_of
from conformance.running.registry import all_cases, by_id
from conformance.sections.loop import _sweep
from conformance.world.layouts import parse_layout
from conformance.world.loops import POINTS
from conformance.world.policies import VARIANTS, arguments
from conformance.world.scenario import Scenario


def test_policy_variants_parse_and_name_their_arguments():
    lay = parse_layout("fsdp4.titan")
    assert (lay.base, lay.policy, lay.world_size) == ("fsdp4", "titan", 4)
    assert parse_layout("hsdp2x2.bf16").mesh == "2x2"

    class Setup:
        device = __import__("torch").device("cpu")

    titan = {unit: arguments("titan", unit, Setup()) for unit in ("block", "last", "root")}
    assert [titan[u]["reshard_after_forward"] for u in ("block", "last", "root")] == [True, False, False]
    assert arguments("offload", "block", Setup())["offload_policy"].pin_memory is False
    assert arguments("", "root", Setup()) == {}
    with pytest.raises(ValueError, match="policy variants"):
        parse_layout("ddp.bf16")
    with pytest.raises(ValueError, match="policy variants"):
        parse_layout("fsdp4.fp8")


def test_loop_cases_cover_every_layout_point_and_mode():
    cases = [c for c in all_cases() if c.clause.startswith("LOOP-")]
    for clause in ("LOOP-1", "LOOP-2"):
        mine = [c for c in cases if c.clause == clause]
        for layout in ("single", "ddp", "fsdp2", "fsdp4", "hsdp2x2", "pp2xfsdp2"):
            on = [c for c in mine if c.layout.name == layout]
            assert {str(c.mode) for c in on} == {"sharded", "full", "full_cpu", "bcast", "file", "flat", "dcp"}, layout
            applies = POINTS["eval"].applies if clause == "LOOP-1" else POINTS["eval"].rollback
            assert applies(parse_layout(layout)) is None
            points = {c.phases[0].params["point"] for c in on}
            want = {
                n
                for n, p in POINTS.items()
                if (p.applies if clause == "LOOP-1" else p.rollback)(parse_layout(layout)) is None
            }
            assert points == want, (clause, layout, points)
        assert {str(c.mode) for c in mine if c.id.endswith("-eval]") and c.layout.name == "fsdp2"} == set(MODES)
        assert {c.layout.name for c in mine} >= {_sweep(v) for v in VARIANTS}
    loop3 = [c for c in cases if c.clause == "LOOP-3"]
    # Each policy in every mode (on 2 ranks, but reshard2, which means nothing there), and on 4 ranks and 2x2.
    assert {(c.layout.name, str(c.mode)) for c in loop3} >= {(_sweep(v), m) for v in VARIANTS for m in MODES}
    assert {c.layout.name for c in loop3} >= {f"{base}.{v}" for base in ("fsdp4", "hsdp2x2") for v in VARIANTS}
    assert _sweep("reshard2") == "fsdp4.reshard2" and _sweep("bf16") == "fsdp2.bf16"
    assert all(c.needs.layouts == ("policies",) for c in loop3)


def test_scenarios_draw_loop_points_and_policies_within_what_applies():
    s = Scenario(layout="fsdp4", mode="dcp", policy="titan", loop_point="unshard", warm=1)
    s.validate()
    assert clauses_of(s)[:4] == ("MODEL-1", "LOOP-1", "LOOP-2", "LOOP-3") and s.where == "fsdp4.titan"
    assert Scenario.from_token(s.token) == s
    assert "policy" not in Scenario().to_dict() and "loop_point" not in Scenario().to_dict()
    for bad, needle in (
        (Scenario(layout="ddp", policy="bf16"), "policies apply"),
        (Scenario(layout="fsdp3", policy="reshard2"), "even number of ranks"),
        (Scenario(layout="single", loop_point="unshard"), "FSDP2's"),
        (Scenario(layout="pp2xfsdp2", loop_point="accum"), "pipeline"),
        (Scenario(loop_point="eval", before=0), "after a first step"),
    ):
        with pytest.raises(ValueError, match=needle):
            bad.validate()


@pytest.mark.parametrize(
    "impl, failing, passing",
    [
        ("tools.perverse.faulty:reshards_on_get", "LOOP-1[fsdp2-dcp-eval]", "OPT-RT-1[fsdp2-adamw-sharded]"),
        ("tools.perverse.faulty:stale_unsharded_copy", "LOOP-2[fsdp2-full-eval]", "OPT-RT-5[fsdp2-sgd-sharded]"),
    ],
)
def test_a_deviation_only_the_loop_shows_fails_loop_only(pools, impl, failing, passing):
    # In this process, on the module's rank pools: the verdicts are the runner's, as the CLI reports them.
    ids = by_id()
    assert failing in ids and passing in ids, [i for i in (failing, passing) if i not in ids]
    with runner_on(pools, impl) as runner:
        verdicts = {i: runner.run_case(ids[i]) for i in (failing, passing)}
    statuses = {i: r.status.value for i, r in verdicts.items()}
    assert statuses == {failing: "failed", passing: "passed"}, {i: r.message[:1500] for i, r in verdicts.items()}
