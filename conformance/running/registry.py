"""The manifest: every case the suite can run. Section modules, one per SPEC
section, contribute cases through their ``cases()`` function
(conformance.running.clauses finds them); scenarios exploration found join them.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterable

from . import clauses
from .cases import DEFAULT_DEADLINE_S, Case, Phase, case_id, loads, make_case, needs_of
from .generated import found_cases

__all__ = ["Case", "DEFAULT_DEADLINE_S", "Phase", "all_cases", "by_id", "case_id", "loads", "make_case", "needs_of"]


@lru_cache(maxsize=None)
def all_cases() -> tuple[Case, ...]:
    cases: list[Case] = []
    seen: set[str] = set()
    for module in clauses.sections():
        for case in module.cases():
            if case.id in seen:
                raise RuntimeError(f"duplicate case id {case.id}")
            if case.clause not in module.CLAUSES:
                raise RuntimeError(f"{module.__name__} yields {case.id} of a clause it does not declare")
            seen.add(case.id)
            cases.append(case)
    for case in found_cases():  # scenarios exploration found: cases like any other
        if case.id in seen:
            raise RuntimeError(f"duplicate case id {case.id}")
        seen.add(case.id)
        cases.append(case)
    return tuple(cases)


@lru_cache(maxsize=None)
def by_id() -> dict[str, Case]:
    return {c.id: c for c in all_cases()}


def select(
    cases: Iterable[Case],
    *,
    patterns: Iterable[str] = (),
    world_sizes: Iterable[int] | None = None,
    meshes: Iterable[str] | None = None,
) -> list[Case]:
    """Filter by ``-k`` substrings (any matches), world sizes and meshes."""
    patterns = list(patterns)
    ws = set(world_sizes) if world_sizes else None
    ms = set(meshes) if meshes else None
    out = []
    for case in cases:
        if patterns and not any(p in case.id for p in patterns):
            continue
        if ws is not None and not set(case.world_sizes) <= ws:
            continue
        if ms is not None and not set(case.meshes) <= ms:
            continue
        out.append(case)
    return out
