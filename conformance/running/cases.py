"""A case: one clause on one layout (or a pair of layouts, for resharding)
with one optimizer and mode where those apply, as the phases every rank
runs. Its ID starts with the clause: ``OPT-RT-1[fsdp4-adamw-sharded]``.
Section modules declare a clause's matrix with :func:`grid` (layouts from
:mod:`conformance.world.catalog`, by what they are), or build one case with
:func:`make_case`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from .. import modes
from ..adapters import LAYOUT_CAPABILITIES, Needs
from ..modes import Mode
from ..world.layouts import Layout, Move, parse_layout
from .clauses import clause

DEFAULT_DEADLINE_S = 60.0


@dataclass(frozen=True)
class Phase:
    """What every rank of a world of ``world_size`` runs: ``fn(c, **params)``."""

    world_size: int
    fn: Callable
    params: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Case:
    """A case as typed values, built once where the matrix is expanded: its
    layout (or, resharding, its move between two), its mode."""

    id: str
    clause: str
    layout: Layout | Move  # the matrix column: fsdp4, or fsdp4_to_fsdp2 (a move) for resharding
    phases: tuple[Phase, ...]
    deadline_s: float = DEFAULT_DEADLINE_S
    profile: str = "core"
    rtol: float = 0.0
    meshes: tuple[str, ...] = ()
    mode: Mode | None = None  # the mode the case runs in (None: modes do not apply)
    # A case built from a scenario (conformance.running.generated): the JSON every
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
            "layout": self.layout.name,
            "profile": self.profile,
            "world_sizes": list(self.world_sizes),
            "meshes": list(self.meshes),
            "mode": modes.name(self.mode),
            "needs": {k: v for k, v in vars(self.needs).items() if v},
            "phases": [f"{p.fn.__module__.rsplit('.', 1)[-1]}.{p.fn.__name__}@{p.world_size}" for p in self.phases],
            "deadline_s": self.deadline_s,
            "rtol": self.rtol,
        }


def loads(fn: Callable) -> Callable:
    """Marks a check of a get-side clause that loads too (its cases need the mode's load declared)."""
    fn.loads = True
    return fn


def needs_of(case: Case) -> Needs:
    """What ``case`` needs declared: derived from its clause, mode, layout and
    parameters, in one place, so that the sections need not say it."""
    found = set(case.layout.needs)
    layouts = [need for need in LAYOUT_CAPABILITIES if need in found]
    declared = clause(case.clause)
    options = list(declared.options)
    strict = [p.params.get("strict") for p in case.phases]
    mode, pipeline = case.mode, "pipeline" in layouts
    # A consolidated file holds every stage; a stage loads its own with strict=False.
    if False in strict or (mode is not None and not mode.strict_on(pipeline)):
        options.append("strict")
    get = load = None
    if mode is not None:
        get, load = mode.on(pipeline).get, mode.name
    if declared.side == "get" and not any(getattr(p.fn, "loads", False) for p in case.phases):
        load = None
    if declared.side == "load":
        get = None
    return Needs(get, load, tuple(layouts), tuple(dict.fromkeys(options)), declared.combined)


def layout_of(which: Layout | str) -> Layout:
    """A layout a section names (one outside the catalog: tensor parallelism,
    experts on meshes of their own) made its object, here where the matrix is
    expanded; a layout is itself."""
    return which if isinstance(which, Layout) else parse_layout(which)


def move(source: Layout | str, target: Layout | str) -> Move:
    """A move between two layouts, either named (see :func:`layout_of`)."""
    return Move(layout_of(source), layout_of(target))


def case_id(clause: str, *parts: str | None) -> str:
    return f"{clause}[{'-'.join(p for p in parts if p)}]"


def make_case(
    clause: str,
    layout: Layout | str,
    fn: Callable,
    *,
    opt: str | None = None,
    mode: Mode | str | None = None,
    variant: str | None = None,
    deadline_s: float = DEFAULT_DEADLINE_S,
    profile: str = "core",
    rtol: float = 0.0,
    **params: Any,
) -> Case:
    """The common shape: one phase, on one layout. A layout or mode given by
    name is made its object here, where the matrix is expanded: the case and
    its function get objects."""
    lay = layout_of(layout)
    kind = None if mode is None else modes.mode_of(mode)
    accepted = inspect.signature(fn).parameters
    params = {k: v for k, v in {"layout": lay, "opt": opt, "mode": kind}.items() if k in accepted} | params
    return Case(
        id=case_id(clause, lay.name, opt, modes.name(kind), variant),
        clause=clause,
        layout=lay,
        phases=(Phase(lay.world_size, fn, params),),
        deadline_s=deadline_s,
        profile=profile,
        rtol=rtol,
        meshes=lay.mesh_specs,
        mode=kind,
    )


def grid(
    clause: str,
    layouts: Iterable[Layout | str],
    fn: Callable,
    *,
    opts: Iterable[str | None] = (None,),
    modes: Iterable[Mode | str | None] = (None,),
    variants: Mapping[str | None, Mapping[str, Any]] | None = None,
    **params: Any,
) -> Iterator[Case]:
    """A clause's matrix as data: one case per layout, optimizer, mode and
    variant (a variant's name and its parameters), in that order, each with
    ``params`` besides."""
    for value, what in ((opts, "opts"), (modes, "modes"), (layouts, "layouts")):
        if isinstance(value, str):
            raise TypeError(f"grid({clause}): {what} takes a sequence, not the string {value!r}")
    for layout in layouts:
        for opt in opts:
            for mode in modes:
                for variant, extra in (variants or {None: {}}).items():
                    yield make_case(clause, layout, fn, opt=opt, mode=mode, variant=variant, **params, **extra)
