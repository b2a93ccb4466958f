"""One place per clause: each SPEC clause is declared by one section module,
and everything else (the registry, what a case needs declared, the
exploration) finds it there."""

import types

import pytest

from conformance import spec
from conformance.running import clauses
from conformance.running.cases import make_case
from conformance.running.clauses import Clause
from conformance.running.registry import all_cases


def test_every_spec_clause_has_one_section_and_every_section_clause_is_in_spec():
    declared = clauses.declared()
    in_spec = set(spec.clauses())
    assert sorted(in_spec - set(declared)) == [], "SPEC clauses no section declares"
    assert sorted(set(declared) - in_spec) == [], "clauses sections declare that SPEC lacks"
    # Sections come in SPEC's order, so the matrix runs in it.
    first = [min(list(spec.clauses()).index(c) for c in m.CLAUSES) for m in clauses.sections()]
    assert first == sorted(first)


def test_every_case_belongs_to_a_clause_its_section_declares():
    owners = {cid: module for cid, (_, module) in clauses.declared().items()}
    for case in all_cases():
        assert case.clause in owners, case.id


def test_a_section_yielding_an_undeclared_clause_is_refused(monkeypatch):
    def phase(c):
        pass

    rogue = types.ModuleType("conformance.sections.rogue")
    rogue.CLAUSES = {"OPT-KEYS-1": Clause()}
    rogue.cases = lambda: [make_case("OPT-RT-1", "single", phase)]
    monkeypatch.setattr(clauses, "sections", lambda: (rogue,))
    all_cases.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="does not declare"):
            all_cases()
    finally:
        all_cases.cache_clear()


def test_each_explored_clause_can_build_its_check():
    for clause_id, c in clauses.explored():
        assert (c.check is None) != (c.build is None), f"{clause_id}: give check or build, not both"
    ranks = [c.rank for _, c in clauses.explored()]
    assert len(set(ranks)) == len(ranks), "explored clauses need distinct ranks: their order decides attribution"
