"""The mutation list still applies to the current sources, so the measured
score (docs/CONFORMANCE.md, docs/MUTATION.md) cannot rot silently. No suite run here: ``python -m
tools.mutate`` runs the campaign."""

import ast

import pytest

from conformance.registry import all_cases
from tools.mutants import MUTANTS
from tools.mutate import apply, quick_slice, source_of

IDS = [m.name for m in MUTANTS]


def test_enough_mutants_with_unique_names():
    assert len(MUTANTS) >= 30
    assert len(set(IDS)) == len(IDS), "duplicate mutant names"


@pytest.mark.parametrize("mutant", MUTANTS, ids=IDS)
def test_target_occurs_once_and_the_mutant_compiles(mutant):
    source = source_of(mutant)
    assert source.count(mutant.target) == 1, (
        f"the target of {mutant.name} occurs {source.count(mutant.target)} times in hyperdsd/{mutant.file}; "
        "re-sync it with the source (tools/mutants.py)"
    )
    assert mutant.replacement != mutant.target
    mutated = apply(mutant, source)
    assert mutated != source
    ast.parse(mutated, filename=f"hyperdsd/{mutant.file} ({mutant.name})")


def test_every_hint_selects_a_case():
    ids = [c.id for c in all_cases()]
    stale = [(m.name, h) for m in MUTANTS for h in m.hints if not any(h in i for i in ids)]
    assert not stale, f"hints that select no case (rename them after the case): {stale}"


def test_apply_refuses_a_target_that_is_not_unique():
    m = MUTANTS[0]
    with pytest.raises(ValueError, match="occurs 2 times"):
        apply(m, m.target + m.target)
    with pytest.raises(ValueError, match="occurs 0 times"):
        apply(m, "")


def test_quick_slice_covers_every_clause_and_mode():
    cases = all_cases()
    chosen = {c.id: c for c in cases if c.id in set(quick_slice())}
    assert {(c.clause, c.mode) for c in chosen.values()} == {(c.clause, c.mode) for c in cases}


# -- the exploration stage's plumbing (no exploration runs here) ------------------------------------


def test_explore_command_has_the_budget_seed_and_copy():
    from tools.mutate import PACKAGE, ExploreSettings, explore_command

    cmd = explore_command(ExploreSettings("90s", 7), "/tmp/r.json")
    assert cmd[1:4] == ["-m", "conformance", "explore"]
    args = dict(zip(cmd[4::2], cmd[5::2]))
    assert args == {"--impl": PACKAGE, "--budget": "90s", "--seed": "7", "--rounds": "1", "--json": "/tmp/r.json"}
    assert ExploreSettings("2m").budget_s == 120.0
    with pytest.raises(ValueError, match="budget"):
        ExploreSettings("soon").budget_s


def _report(findings, complete=True, ran=5):
    return {"impl": "x", "explore": {"ran": ran, "complete": complete, "findings": findings}}


def test_explore_result_names_the_first_finding_its_clause_and_token():
    from tools.mutate import explore_result

    finding = {
        "clause": "MODEL-1",
        "status": "failed",
        "message": "full: the model state dict differs:\n  'head.weight' is missing\n  more",
        "token": "s1.abc",
        "description": "layout single (1 ranks), mode full",
        "shrunk": True,
    }
    r = explore_result(_report([finding, {**finding, "clause": "OPT-RT-1"}]), 1)
    assert (r.killed_by, r.status, r.token, r.ran) == ("explore: MODEL-1", "failed", "s1.abc", 5)
    assert r.message == "full: the model state dict differs: 'head.weight' is missing"
    assert r.scenario.startswith("layout single")
    unshrunk = explore_result(_report([{**finding, "shrunk": False}], complete=False), 1)
    assert unshrunk.killed_by == "explore: MODEL-1 (not shrunk)"


def test_explore_result_survives_only_a_complete_clean_run():
    from tools.mutate import explore_result

    assert explore_result(_report([]), 0).killed_by == ""
    assert explore_result(_report([]), 0).ran == 5
    broken = explore_result(_report([], complete=False), 1)
    assert broken.status == "broken" and "interrupted" in broken.killed_by
    assert explore_result({"explore": {"ran": 0, "findings": []}}, 2).status == "broken"


def test_stages_and_the_split_score():
    from tools.mutate import StageResult, Verdict, parse_stages, scores

    assert parse_stages("explore,hints") == ("hints", "explore")
    assert parse_stages("hints,quick,full,explore") == ("hints", "quick", "full", "explore")
    with pytest.raises(ValueError, match="stages"):
        parse_stages("hints,fuzz")
    m = MUTANTS[0]
    verdicts = [
        Verdict(m, StageResult("OPT-RT-1[x]", "failed"), "hints", 1.0),
        Verdict(m, StageResult("explore: MODEL-1", "failed"), "explore", 1.0),
        Verdict(m, StageResult(), "", 1.0),
    ]
    sc = scores(verdicts)
    assert (sc["total"], sc["killed"], sc["matrix_killed"], sc["explore_killed"]) == (3, 2, 1, 1)
