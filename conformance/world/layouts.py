"""Layouts: how a model is laid out over ranks.

Layouts are data: each family is one :class:`LayoutKind` entry in
:data:`KINDS` (its name pattern, meshes, how it places and shards a model,
its data parallelism, the clauses it serves), and a name such as ``fsdp4``
or ``fsdp4+ep2x2`` parses into a :class:`Layout` of one of them.

A kind's functions take the :class:`~conformance.world.setup.Setup` being
built (``setup``) and fill in its meshes and shard its model; they leave it
unannotated, since setup.py imports this module.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from .. import _compat
from . import placing, policies
from .models import ModelConfig

# FSDP2 layouts train on CPU ranks; torch 2.6 needs this to run them there.
_compat.fsdp2_on_cpu()
# reshard_after_forward=<int> would create process groups per model (see there).
_compat.shared_post_forward_meshes()


@dataclass(frozen=True)
class Layout:
    """A named layout: its world, the meshes it builds, how it lays a model out."""

    name: str
    kind: "LayoutKind" = field(repr=False)
    world_size: int
    meshes: tuple[tuple[str, tuple[str, ...]], ...]  # (shape, dim names) of each mesh, e.g. ("2x2", ("ep", "dp"))
    pp: int = 1
    args: tuple[int, ...] = ()  # the numbers in the name
    policy: str = ""  # the FSDP2 policy variant after a dot (``fsdp4.bf16``; SPEC §2), "" for the base

    def __str__(self) -> str:
        return self.name

    @property
    def family(self) -> str:
        """The column of the console's summary its cases count in (:data:`FAMILIES`)."""
        return "policies" if self.policy else self.kind.family

    @property
    def wrapper(self) -> str:
        return self.kind.wrapper

    @property
    def needs(self) -> tuple[str, ...]:
        """The layout capabilities an adapter must declare to run on it."""
        return self.kind.needs + (("policies",) if self.policy else ())

    @property
    def base(self) -> str:
        """The layout's name without its policy variant."""
        return self.name.partition(".")[0]

    @property
    def mesh(self) -> str:
        """The main mesh (the one dense layers are sharded on), as a string."""
        return self.meshes[0][0]

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self.meshes[0][1]

    @property
    def mesh_specs(self) -> tuple[str, ...]:
        return tuple(spec for spec, _ in self.meshes)

    @property
    def spans(self) -> list[tuple[int, ...]]:
        """The ranks of each model (one model over the world, unless the kind places several)."""
        sizes = self.args if self.kind.parts else (self.world_size,)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [tuple(range(start, start + n)) for start, n in zip(starts, sizes)]


@dataclass(frozen=True)
class LayoutKind:
    """One family of layouts, as data: adding a layout is one entry in
    :data:`KINDS` plus, where no existing one fits, its sharding function.

    ``pattern`` matches names (its groups are the numbers in them);
    ``make(*numbers)`` gives (world size, meshes, pipeline stages);
    ``place(setup)`` builds this rank's meshes (every rank builds every mesh
    alike: creating one is a collective) and says which ranks the rank's
    model spans; ``shard(setup)`` lays the built model out (the adapter's
    own ``shard`` for what FSDP would shard); ``dp(setup)`` is the rank's
    (data-parallel rank, degree); ``model(cfg, setup)`` adjusts the model
    config; ``parts``: the numbers in the name are the sizes of disjoint
    parts of the world, one model each; ``serves`` lists the clauses whose
    sections take their layouts from here (:func:`serving`), with the
    layouts they run on.
    """

    name: str
    pattern: str
    make: Callable[..., tuple[int, tuple, int]]
    place: Callable[..., None]
    shard: Callable[..., None]
    dp: Callable[..., tuple[int, int]]
    model: Callable[..., ModelConfig] = lambda cfg, setup: cfg
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module
    parts: bool = False
    serves: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # What lays the model out, beyond the meshes: "none" (the suite holds the
    # modules' parameters itself), "ddp", "fsdp2" (the adapter's ``shard``), or
    # "fsdp1" (SPEC §2, 1.3: torch's FullyShardedDataParallel, whatever the
    # implementation; ``flat_params``: use_orig_params=False, the optimizer
    # steps FSDP1's flat parameters).
    wrapper: str = "none"
    flat_params: bool = False
    strategy: str = ""  # FSDP1's ShardingStrategy, by name
    # The layout capabilities (adapters.LAYOUT_CAPABILITIES) an adapter must
    # declare for cases on this kind; a policy variant adds "policies".
    needs: tuple[str, ...] = ()
    policies: bool = False  # its names take an FSDP2 policy variant after a dot (policies.py)
    # Which column of the console's summary its cases count in (:data:`FAMILIES`).
    family: str = "meshes"


KINDS: tuple[LayoutKind, ...] = (
    LayoutKind(
        "single",
        r"single",
        lambda: (1, (("1", ("shard",)),), 1),
        placing.no_mesh,
        placing.unsharded,
        placing.no_dp,
        family="plain",
    ),
    LayoutKind(
        "ddp",
        r"ddp",
        lambda: (2, (("2", ("shard",)),), 1),
        placing.world_mesh,
        placing.unsharded,
        placing.world_dp,
        wrap=placing.ddp,
        wrapper="ddp",
        family="ddp",
    ),
    LayoutKind(
        "fsdp",
        r"fsdp(\d+)",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        placing.world_mesh,
        placing.fsdp,
        placing.world_dp,
        wrapper="fsdp2",
        policies=True,
        family="fsdp2",
    ),
    LayoutKind(
        "hsdp",
        r"hsdp(\d+)x(\d+)",
        lambda r, s: (r * s, ((f"{r}x{s}", ("replicate", "shard")),), 1),
        placing.world_mesh,
        placing.fsdp,
        placing.world_dp,
        wrapper="fsdp2",
        policies=True,
        family="hsdp",
    ),
    LayoutKind(
        "pp",
        r"pp(\d+)",
        lambda p: (p, ((f"{p}", ("pp",)),), p),
        placing.stages,
        placing.unsharded,
        placing.no_dp,
        needs=("pipeline",),
        family="pipeline",
    ),
    LayoutKind(
        "ppfsdp",
        r"pp(\d+)xfsdp(\d+)",
        lambda p, s: (p * s, ((f"{p}x{s}", ("pp", "shard")),), p),
        placing.stages,
        placing.fsdp_on_shard_dim,
        placing.shard_dim_dp,
        wrapper="fsdp2",
        needs=("pipeline",),
        family="pipeline",
    ),
    LayoutKind(
        "tp",
        r"fsdp(\d+)xtp(\d+)",
        lambda d, t: (d * t, ((f"{d}x{t}", ("shard", "tp")),), 1),
        placing.world_mesh,
        placing.tp_then_fsdp,
        placing.shard_dim_dp,
        wrapper="fsdp2",
        needs=("tensor_parallel",),
    ),
    # A mixture of experts: dense layers sharded over the world, the experts
    # on an ``ep x dp`` mesh of their own (OPT-MESH-1).
    LayoutKind(
        "ep",
        r"fsdp(\d+)\+ep(\d+)x(\d+)",
        lambda n, e, d: (n, ((f"{n}", ("shard",)), (f"{e}x{d}", ("ep", "dp"))), 1),
        placing.world_mesh,
        placing.experts_on_ep_mesh,
        placing.world_dp,
        model=placing.experts,
        serves=(("OPT-MESH-1", ("fsdp4+ep2x2",)),),
        wrapper="fsdp2",
        needs=("several_meshes",),
    ),
    # ... with an expert-parallel degree of 1: the stacked experts FSDP-sharded on dim 0.
    LayoutKind(
        "ep1",
        r"fsdp(\d+)\+ep1",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        placing.world_mesh,
        lambda setup: placing.dense_children(setup, skip=()),
        placing.world_dp,
        model=placing.experts,
        serves=(("OPT-MESH-1", ("fsdp4+ep1",)),),
        wrapper="fsdp2",
        needs=("several_meshes",),
    ),
    # ... with the router replicated on sub-meshes of ``rep`` ranks.
    LayoutKind(
        "rep",
        r"fsdp(\d+)\+rep(\d+)",
        lambda n, r: (n, ((f"{n}", ("shard",)), (f"{n // r}x{r}", ("group", "rep"))), 1),
        placing.world_mesh,
        placing.router_replicated,
        placing.world_dp,
        model=placing.experts,
        serves=(("OPT-MESH-1", ("fsdp4+rep2",)),),
        wrapper="fsdp2",
        needs=("several_meshes",),
    ),
    # FSDP1 (SPEC §2, 1.3): FullyShardedDataParallel on every block and the root.
    LayoutKind(
        "fsdp1",
        r"fsdp1-(\d+)",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        placing.world_mesh,
        placing.fsdp1_units,
        placing.world_dp,
        wrapper="fsdp1",
        strategy="FULL_SHARD",
        needs=("fsdp1",),
        family="fsdp1",
    ),
    LayoutKind(
        "fsdp1-flat",
        r"fsdp1-(\d+)-flat",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        placing.world_mesh,
        placing.fsdp1_units,
        placing.world_dp,
        wrapper="fsdp1",
        strategy="FULL_SHARD",
        flat_params=True,
        needs=("fsdp1",),
        family="fsdp1",
    ),
    # SHARD_GRAD_OP: parameters stay unsharded from the forward to the backward.
    LayoutKind(
        "fsdp1-shard_grad_op",
        r"fsdp1-(\d+)-shard_grad_op",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        placing.world_mesh,
        placing.fsdp1_units,
        placing.world_dp,
        wrapper="fsdp1",
        strategy="SHARD_GRAD_OP",
        needs=("fsdp1",),
        family="fsdp1",
    ),
    LayoutKind(
        "hsdp1",
        r"hsdp1-(\d+)x(\d+)",
        lambda r, s: (r * s, ((f"{r}x{s}", ("replicate", "shard")),), 1),
        placing.world_mesh,
        placing.fsdp1_units,
        placing.world_dp,
        wrapper="fsdp1",
        strategy="HYBRID_SHARD",
        needs=("fsdp1",),
        family="fsdp1",
    ),
    # Models on disjoint parts of the world, each fully sharded on its own
    # mesh (colocated trainers: an actor on ranks 0-1, a critic on 2-3).
    LayoutKind(
        "halves",
        r"halves(\d+)\+(\d+)",
        lambda a, b: (a + b, ((f"{a}+{b}", ("shard",)),), 1),
        placing.parts,
        placing.fsdp,
        placing.part_dp,
        model=placing.second_model_differs,
        parts=True,
        serves=(("OPT-MESH-2", ("halves2+2",)),),
        wrapper="fsdp2",
        needs=("several_meshes", "part_of_world"),
    ),
)


# The kinds whose names take a policy variant.
POLICY_KINDS = tuple(kind.name for kind in KINDS if kind.policies)

# The console summary's columns: the kinds' families, FSDP2 policy variants
# (``fsdp4.bf16``) and moves between layouts (``fsdp4_to_fsdp2``, resharding).
FAMILIES = ("plain", "ddp", "fsdp2", "hsdp", "pipeline", "fsdp1", "meshes", "policies", "reshard")


@dataclass(frozen=True)
class Move:
    """A move between layouts (resharding): a case saves on ``source`` and loads
    on ``target``. Named ``fsdp4_to_fsdp2`` in case IDs and reports."""

    source: Layout
    target: Layout
    family = "reshard"

    @property
    def name(self) -> str:
        return f"{self.source.name}_to_{self.target.name}"

    def __str__(self) -> str:
        return self.name

    @property
    def ends(self) -> tuple[Layout, Layout]:
        return self.source, self.target

    @property
    def needs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.source.needs + self.target.needs))

    @property
    def mesh_specs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.source.mesh_specs + self.target.mesh_specs))


@functools.lru_cache(maxsize=None)
def parse_layout(name: str) -> Layout:
    """The layout ``name`` names. Parsed where names come in (the catalog, a case
    declared by name, a scenario's record); everything downstream holds the object."""
    base, dot, policy = name.partition(".")
    for kind in KINDS:
        match = re.fullmatch(kind.pattern, base)
        if match:
            if dot and (not kind.policies or policy not in policies.VARIANTS):
                raise ValueError(
                    f"unknown layout {name!r}: policy variants ({', '.join(policies.VARIANTS)}) "
                    f"apply to the {' and '.join(POLICY_KINDS)} layouts"
                )
            numbers = tuple(int(g) for g in match.groups())
            world_size, meshes, pp = kind.make(*numbers)
            return Layout(name, kind, world_size, meshes, pp, numbers, policy)
    raise ValueError(f"unknown layout {name!r}")


def serving(clause: str) -> tuple[str, ...]:
    """The layouts whose kinds say they serve ``clause``."""
    return tuple(name for kind in KINDS for c, names in kind.serves if c == clause for name in names)
