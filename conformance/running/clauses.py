"""What the suite knows of each SPEC clause, declared once, in the section
module that judges it.

A section module (``conformance/sections/*.py``) declares ``CLAUSES``, a
dict of clause ID to :class:`Clause`, and yields the clauses' cases from
``cases()``. Everything else finds them here: the registry (the cases, and
what each needs declared), the exploration (which clauses a scenario
contains, and their checks on it). Adding a clause is one section module,
plus SPEC and the docs; a test ties SPEC's clauses to the sections.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, Callable

from .. import spec


@dataclass(frozen=True)
class Clause:
    """One clause, as its section declares it.

    ``side``: "get" when its cases only call get (SPEC §1: they run with any
    declared get mode; a check marked ``loads`` loads too), "load" when they
    only call set on the suite's own dict, "" when both. ``options``: the
    options it needs declared. ``combined``: it judges the combined functions.

    Exploration (conformance.running.generated): ``contains(scenario)`` says whether
    a generated scenario has the clause's features; ``check(scenario)`` gives
    its check there, ``(fn, params)``, or, for a check in two phases,
    ``build(scenario, case_id, source)`` gives the whole case. ``rank``
    orders the checks of one scenario: narrower features first, so that a
    deviation is found under the clause about it before the round trips
    that would see it too.
    """

    side: str = ""
    options: tuple[str, ...] = ()
    combined: bool = False
    contains: Callable[[Any], bool] | None = None
    check: Callable[[Any], tuple] | None = None
    build: Callable[..., Any] | None = None
    rank: int = 0


PACKAGE = "conformance.sections"


@lru_cache(maxsize=None)
def sections() -> tuple[ModuleType, ...]:
    """Every section module, in the order of SPEC's clauses (by the first clause each declares)."""
    package = importlib.import_module(PACKAGE)
    modules = [importlib.import_module(f"{PACKAGE}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]
    order = {clause: i for i, clause in enumerate(spec.clauses())}
    missing = [m.__name__ for m in modules if not getattr(m, "CLAUSES", None)]
    if missing:
        raise RuntimeError(f"section modules without CLAUSES: {missing}")
    return tuple(sorted(modules, key=lambda m: min(order.get(c, len(order)) for c in m.CLAUSES)))


@lru_cache(maxsize=None)
def declared() -> dict[str, tuple[Clause, ModuleType]]:
    """Clause ID -> (its declaration, the section module declaring it)."""
    out: dict[str, tuple[Clause, ModuleType]] = {}
    for module in sections():
        for clause_id, clause in module.CLAUSES.items():
            if clause_id in out:
                raise RuntimeError(f"{clause_id} is declared by {out[clause_id][1].__name__} and {module.__name__}")
            out[clause_id] = (clause, module)
    return out


def clause(clause_id: str) -> Clause:
    """The declaration of ``clause_id``; a clause no section declares has none of the optional traits."""
    found = declared().get(clause_id)
    return found[0] if found else Clause()


@lru_cache(maxsize=None)
def explored() -> tuple[tuple[str, Clause], ...]:
    """The clauses a generated scenario may contain, in the order their checks run."""
    out = [(cid, c) for cid, (c, _) in declared().items() if c.contains is not None]
    return tuple(sorted(out, key=lambda item: item[1].rank))
