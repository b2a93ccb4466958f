"""The catalog: the layouts the clauses' matrices run on, picked by what they are.

A section says which layouts a clause runs on as a :class:`Pick` over
:data:`CATALOG`, by traits (:func:`pick`), never by typing names: a layout
added to the catalog reaches every matrix whose traits it has. The picks
below are the catalog's atoms (each is one layout today, and says what it
exercises) and the few unions most clauses share; sections combine them with
``|``, ``&`` and ``-``, and a union keeps the catalog's order, which is the
order cases run in.

Layouts outside the catalog (tensor parallelism, experts on meshes of their
own, parts of the world) serve one clause each; their kinds say which
(:func:`conformance.world.layouts.serving`), or the section names them with
its reason.
"""

from __future__ import annotations

import functools

from .layouts import Layout, Move, parse_layout

# The layouts picks draw from, in the order their cases run: data parallelism
# by degree, then pipelines, then FSDP1 (SPEC §2, 1.3). Parsed here, once:
# picks hold the layouts themselves.
CATALOG_NAMES = (
    "single",
    "ddp",
    "fsdp2",
    "fsdp3",
    "fsdp4",
    "hsdp2x2",
    "pp2",
    "pp2xfsdp2",
    "fsdp1-2",
    "fsdp1-4-flat",
    "hsdp1-2x2",
    "fsdp1-2-shard_grad_op",
)
CATALOG: tuple[Layout, ...] = tuple(map(parse_layout, CATALOG_NAMES))


class Pick(tuple):
    """Layouts of the catalog, in its order; ``|``, ``&`` and ``-`` keep it."""

    def __or__(self, other: tuple) -> "Pick":
        return _ordered(set(self) | set(other))

    def __and__(self, other: tuple) -> "Pick":
        return _ordered(set(self) & set(other))

    def __sub__(self, other: tuple) -> "Pick":
        return _ordered(set(self) - set(other))

    def one(self) -> Layout:
        """The one layout of a pick that names one (a move's end, say)."""
        if len(self) != 1:
            raise ValueError(f"expected one layout, the pick has {list(self)}")
        return self[0]


def _ordered(layouts: set[Layout]) -> Pick:
    return Pick(lay for lay in CATALOG if lay in layouts)


def shard_degree(lay: Layout) -> int:
    """Over how many ranks a parameter's rows are split (1: each rank that
    holds a parameter holds it whole)."""
    if lay.wrapper not in ("fsdp2", "fsdp1"):
        return 1
    spec, dims = lay.meshes[0]
    return int(spec.split("x")[dims.index("shard")])


def replicas(lay: Layout) -> int:
    """How many replicas of each shard the layout keeps (HSDP's replicate dim; 1: none)."""
    spec, dims = lay.meshes[0]
    return int(spec.split("x")[dims.index("replicate")]) if "replicate" in dims else 1


@functools.cache
def traits(lay: Layout) -> dict:
    """What a layout is, as :func:`pick` filters on it (one dict per layout: read, never changed)."""
    return {
        "world_size": lay.world_size,
        "wrapper": lay.wrapper,
        "pp": lay.pp,
        "mesh_dims": len(lay.dim_names),
        "shard_degree": shard_degree(lay),
        "replicas": replicas(lay),
        "flat_params": lay.kind.flat_params,
        "strategy": lay.kind.strategy,
    }


def pick(**want) -> Pick:
    """The catalog's layouts whose traits (:func:`traits`) are as given; a
    tuple value allows any of its members."""
    known = traits(CATALOG[0]).keys()
    if set(want) - known:
        raise TypeError(f"no layout trait {sorted(set(want) - known)}; traits: {sorted(known)}")

    def fits(lay: Layout) -> bool:
        have = traits(lay)
        return all(have[k] in (v if isinstance(v, tuple) else (v,)) for k, v in want.items())

    return Pick(lay for lay in CATALOG if fits(lay))


# -- the atoms: what each layout exercises -----------------------------------

# One rank holds the whole model: no collective, nothing sharded.
ONE_RANK = pick(world_size=1)
# DDP: every rank holds every parameter whole, wrapped.
REPLICATED = pick(wrapper="ddp")
# FSDP2 over two ranks: each parameter in two pieces (3 rows as 2 and 1).
HALVED = pick(wrapper="fsdp2", mesh_dims=1, shard_degree=2)
# FSDP2 over three: uneven pieces (8 rows as 3, 3 and 2).
THIRDS = pick(wrapper="fsdp2", mesh_dims=1, shard_degree=3)
# FSDP2 over four: a 3-row parameter leaves one rank an empty piece.
QUARTERS = pick(wrapper="fsdp2", mesh_dims=1, shard_degree=4)
# HSDP: sharded over one dim of a 2-D mesh, replicated over the other.
HYBRID = pick(wrapper="fsdp2", replicas=2)
# Pipeline stages: each rank holds its stage's parameters whole.
STAGES = pick(wrapper="none", pp=2)
# Pipeline stages, each sharded with FSDP2 over its own ranks.
SHARDED_STAGES = pick(wrapper="fsdp2", pp=2)
# FSDP1 (torch's FullyShardedDataParallel), every strategy and parameter kind.
FSDP1 = pick(wrapper="fsdp1")
# FSDP1's default: FULL_SHARD with the original parameters.
FSDP1_FULL = pick(wrapper="fsdp1", strategy="FULL_SHARD", flat_params=False)
# FSDP1 with flat parameters (use_orig_params=False): the optimizer steps them.
FSDP1_FLAT_PARAMS = pick(wrapper="fsdp1", flat_params=True)
# FSDP1's HYBRID_SHARD on a 2-D mesh.
FSDP1_HYBRID = pick(wrapper="fsdp1", strategy="HYBRID_SHARD", replicas=2)
# FSDP1's SHARD_GRAD_OP: parameters stay whole from the forward to the backward.
FSDP1_SHARD_GRAD_OP = pick(wrapper="fsdp1", strategy="SHARD_GRAD_OP")
# FSDP1 with the original parameters, each FQN an optimizer parameter of its own.
FSDP1_ORIGINAL = pick(wrapper="fsdp1", flat_params=False)

# -- the unions most matrices share ------------------------------------------

# The data-parallel and pipeline layouts most clauses run on, and the ones
# generated scenarios draw from (conformance.world.scenario).
BASE = pick(wrapper=("none", "ddp", "fsdp2"))
# The two ends of sharding: everything on one rank, and pieces down to an
# empty one: the fewest layouts that tell a sharded path from an unsharded.
ENDS = ONE_RANK | QUARTERS
# One of each data-parallel kind: none, replicated, sharded, hybrid.
DATA_PARALLEL = ONE_RANK | REPLICATED | QUARTERS | HYBRID
# Every layout that shards with FSDP2 (on one mesh).
SHARDED = pick(wrapper="fsdp2")
# FSDP1's FULL_SHARD, with original and with flat parameters.
FSDP1_FULL_SHARD = FSDP1_FULL | FSDP1_FLAT_PARAMS


def moves(*pairs: tuple[Pick, Pick]) -> tuple[Move, ...]:
    """Moves between layouts (resharding: save on one, load on the other),
    each end a pick of one layout."""
    return tuple(Move(src.one(), dst.one()) for src, dst in pairs)


# The layouts wrappers of the model run on (OPT-KEYS-2, MODEL-1), each with its
# wrapper variants: torch.compile, activation checkpointing, both.
WRAPPERS = {  # layout -> wrapper variants
    ONE_RANK.one(): (("compile",), ("checkpoint",), ("checkpoint", "compile")),
    REPLICATED.one(): ((), ("compile",)),
    HALVED.one(): (("checkpoint",),),
    HYBRID.one(): (("checkpoint",),),
}
