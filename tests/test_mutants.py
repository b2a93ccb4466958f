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
