"""The manifest: every case the suite can run, derived from the matrix.

A case is one clause on one layout (or a pair of layouts, for resharding)
with one optimizer and mode where those apply. Its ID starts with the clause:
``OPT-RT-1[fsdp4-adamw-sharded]``. Section modules, one per SPEC section,
contribute cases through their ``cases()`` function.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable

from .adapters import GET_OF, Needs
from .layouts import parse_layout

SECTIONS = (
    "keys",
    "roundtrip",
    "purity",
    "atomicity",
    "partial",
    "empty_groups",
    "scheduler",
    "dtensor",
    "state",
    "meshes",
    "mpmd",
    "reshard",
    "model",
    "loop",
    "combined",
)

DEFAULT_DEADLINE_S = 60.0


@dataclass(frozen=True)
class Phase:
    """What every rank of a world of ``world_size`` runs: ``fn(c, **params)``."""

    world_size: int
    fn: Callable
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Case:
    id: str
    clause: str
    layout: str  # the matrix column: "fsdp4", or "fsdp4_to_fsdp2" for resharding
    phases: tuple[Phase, ...]
    deadline_s: float = DEFAULT_DEADLINE_S
    profile: str = "core"
    rtol: float = 0.0
    meshes: tuple[str, ...] = ()
    mode: str | None = None  # the mode the case runs in (None: modes do not apply)
    # A case built from a scenario (conformance.scenarios): the JSON every
    # rank rebuilds it from, since no registry lists a generated case.
    source: str | None = field(default=None, compare=False)

    @property
    def world_sizes(self) -> tuple[int, ...]:
        return tuple(p.world_size for p in self.phases)

    @property
    def needs(self) -> Needs:
        return needs_of(self)

    def manifest_entry(self) -> dict:
        return {
            "id": self.id,
            "clause": self.clause,
            "layout": self.layout,
            "profile": self.profile,
            "world_sizes": list(self.world_sizes),
            "meshes": list(self.meshes),
            "mode": self.mode,
            "needs": {k: v for k, v in vars(self.needs).items() if v},
            "phases": [f"{p.fn.__module__.rsplit('.', 1)[-1]}.{p.fn.__name__}@{p.world_size}" for p in self.phases],
            "deadline_s": self.deadline_s,
            "rtol": self.rtol,
        }


# Clauses whose cases only call get (SPEC §1: they run with any declared get
# mode); OPT-ATOM-3 only calls set, on the suite's own dict. Every other case
# takes a dict with the implementation's get and loads it with its set.
GET_SIDE = frozenset({"OPT-KEYS-1", "OPT-PURE-1", "OPT-PURE-2", "OPT-PURE-3", "OPT-RT-3", "OPT-DT-1"})
LOAD_SIDE = frozenset({"OPT-ATOM-3"})
# Clauses about the implementation's options type or one of its options.
OPTION_CLAUSES = {"OPT-ATOM-3": ("options_type",), "OPT-PART-3": ("ignore_frozen_params",)}
# Clauses about the combined get_state_dict and set_state_dict (SPEC §1, 1.3).
COMBINED_CLAUSES = frozenset({"API-1"})


def loads(fn: Callable) -> Callable:
    """Marks a check of a get-side clause that loads too (its cases need the mode's load declared)."""
    fn.loads = True
    return fn


def needs_of(case: Case) -> Needs:
    """What ``case`` needs declared: derived from its clause, mode, layout and
    parameters, in one place, so that the sections need not say it."""
    layouts = []
    parts = case.layout.replace("_to_", " ").split()
    if any("pp" in p for p in parts):
        layouts.append("pipeline")
    if any("tp" in p for p in parts):
        layouts.append("tensor_parallel")
    if any("+" in p for p in parts):  # fsdp4+ep2x2: experts on a mesh of their own
        layouts.append("several_meshes")
    if any(p.startswith("halves") for p in parts):
        layouts.append("part_of_world")
    if any("." in p for p in parts):  # fsdp4.bf16: an FSDP2 policy variant, passed to the adapter's shard
        layouts.append("policies")
    options = list(OPTION_CLAUSES.get(case.clause, ()))
    strict = [p.params.get("strict") for p in case.phases]
    # A consolidated file holds every stage; a stage loads its own with strict=False.
    if False in strict or (case.mode == "file" and "pipeline" in layouts):
        options.append("strict")
    mode = case.mode
    get = load = None
    if mode is not None:
        get = "flat" if mode == "dcp" and "pipeline" in layouts else GET_OF[mode]
        load = mode
    if case.clause in GET_SIDE and not any(getattr(p.fn, "loads", False) for p in case.phases):
        load = None
    if case.clause in LOAD_SIDE:
        get = None
    return Needs(get, load, tuple(layouts), tuple(dict.fromkeys(options)), case.clause in COMBINED_CLAUSES)


def case_id(clause: str, *parts: str | None) -> str:
    return f"{clause}[{'-'.join(p for p in parts if p)}]"


def make_case(
    clause: str,
    layout: str,
    fn: Callable,
    *,
    opt: str | None = None,
    mode: str | None = None,
    variant: str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    profile: str = "core",
    rtol: float = 0.0,
    **params: Any,
) -> Case:
    """The common shape: one phase, on one layout."""
    lay = parse_layout(layout)
    accepted = inspect.signature(fn).parameters
    params = {k: v for k, v in {"layout": layout, "opt": opt, "mode": mode}.items() if k in accepted} | params
    return Case(
        id=case_id(clause, layout, opt, mode, variant),
        clause=clause,
        layout=layout,
        phases=(Phase(lay.world_size, fn, params),),
        deadline_s=deadline_s,
        profile=profile,
        rtol=rtol,
        meshes=lay.mesh_specs,
        mode=mode,
    )


@lru_cache(maxsize=None)
def all_cases() -> tuple[Case, ...]:
    cases: list[Case] = []
    seen: set[str] = set()
    for name in SECTIONS:
        try:
            module = importlib.import_module(f"conformance.sections.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"conformance.sections.{name}":
                continue  # section not written yet
            raise
        for case in module.cases():
            if case.id in seen:
                raise RuntimeError(f"duplicate case id {case.id}")
            seen.add(case.id)
            cases.append(case)
    from .scenarios import found_cases

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
