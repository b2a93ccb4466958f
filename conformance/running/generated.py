"""Cases from generated scenarios: the clauses a scenario exercises, each
clause's check on it as a case, and the scenarios exploration found, kept as
cases of the matrix.

:func:`clause_cases` turns a :class:`~conformance.world.scenario.Scenario`
into cases of the clauses it exercises, each running the clause's own check
function from ``conformance/sections`` on the scenario's model (the same
oracle and deadlines as the matrix), so that a failure is a failure of that
clause. ``python -m conformance explore`` draws scenarios; a shrunk failure
saved with ``--save-found`` becomes a regular case, ``CLAUSE[found-<hash>]``,
loaded from ``conformance/found/*.json`` and from the directories in
``$CONFORMANCE_FOUND`` (``os.pathsep``-separated).

This module is imported on every rank: it needs nothing beyond the suite.
"""

from __future__ import annotations

import glob
import json
import os
from functools import lru_cache

from ..world.scenario import Scenario
from . import clauses
from .cases import DEFAULT_DEADLINE_S, Case, Phase

FORMAT = 1
FOUND_ENV = "CONFORMANCE_FOUND"
# conformance/found/, which the package ships (this module is in conformance/running/).
FOUND_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "found")


# The order checks run in, most specific first: the first that fails names
# the scenario's failure (a round trip that fails because of an empty group
# is OPT-EMPTY-1's deviation before it is OPT-RT-1's).
# Resharding comes last: it counts only where the scenario round-trips on its own layout;
# so does a load into groups in another order (OPT-KEYS-1), which is a round trip and more.
def clauses_of(s: Scenario) -> tuple[str, ...]:
    """The clauses whose features ``s`` contains, in the order their checks run
    (each section declares its clauses' features and checks: conformance.running.clauses)."""
    return tuple(clause_id for clause_id, c in clauses.explored() if c.contains(s))


def scenario_case(s: Scenario, clause: str, tag: str | None = None) -> Case:
    """``clause``'s check on ``s`` as a case: ``CLAUSE[<tag or explore-<digest>>]``."""
    case_id = f"{clause}[{tag or 'explore-' + s.digest}]"
    source = json.dumps({"format": FORMAT, "id": case_id, "clause": clause, "scenario": s.to_dict()}, sort_keys=True)
    declared = clauses.clause(clause)
    if declared.build is not None:
        return declared.build(s, case_id, source)
    if declared.check is None:
        raise ValueError(f"no scenario check for clause {clause!r}")
    fn, params = declared.check(s)
    lay = s.built_on
    return Case(
        id=case_id,
        clause=clause,
        layout=lay,
        phases=(Phase(lay.world_size, fn, params),),
        deadline_s=DEFAULT_DEADLINE_S,
        meshes=lay.mesh_specs,
        mode=s.kind,
        source=source,
    )


def clause_cases(s: Scenario) -> list[Case]:
    return [scenario_case(s, clause) for clause in clauses_of(s)]


@lru_cache(maxsize=64)
def case_from_source(source: str) -> Case:
    """The case ``source`` (:attr:`Case.source`) describes, rebuilt on a rank."""
    data = json.loads(source)
    s = Scenario.from_dict(data["scenario"])
    clause, case_id = data["clause"], data["id"]
    tag = case_id[len(clause) + 1 : -1]
    return scenario_case(s, clause, tag)


# -- found scenarios: cases of the regression matrix --------------------------


def found_id(clause: str, s: Scenario) -> str:
    return f"{clause}[found-{s.digest}]"


def found_record(clause: str, s: Scenario, *, impl: str, status: str, message: str) -> dict:
    return {
        "format": FORMAT,
        "id": found_id(clause, s),
        "clause": clause,
        "scenario": s.to_dict(),
        "token": s.token,
        "found_on": impl,
        "status": status,
        "message": message,
        "description": s.describe(),
    }


def write_found(directory: str, record: dict) -> str:
    """Write ``record`` as ``<directory>/<clause>-found-<digest>.json``; returns the path."""
    os.makedirs(directory, exist_ok=True)
    name = record["id"].replace("[", "-").replace("]", "") + ".json"
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def found_dirs() -> list[str]:
    extra = [d for d in os.environ.get(FOUND_ENV, "").split(os.pathsep) if d]
    return [FOUND_DIR, *extra]


def load_found(path: str) -> Case:
    """The case a found-scenario file describes; a clear error naming the file otherwise."""
    try:
        with open(path) as f:
            data = json.load(f)
        s = Scenario.from_dict(data["scenario"])
        clause = data["clause"]
        if clause not in clauses_of(s):
            raise ValueError(f"clause {clause!r} is not one the scenario exercises ({', '.join(clauses_of(s))})")
        case = scenario_case(s, clause, f"found-{s.digest}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"found-scenario file {path}: {exc}") from None
    if data.get("id", case.id) != case.id:
        raise ValueError(f"found-scenario file {path}: its id {data['id']!r} is not {case.id!r} (edited scenario?)")
    return case


def found_cases() -> list[Case]:
    """Every found-scenario case in :func:`found_dirs`, sorted by file name within each directory."""
    out: list[Case] = []
    seen: set[str] = set()
    for directory in found_dirs():
        for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
            case = load_found(path)
            if case.id not in seen:
                seen.add(case.id)
                out.append(case)
    return out
