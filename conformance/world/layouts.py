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

import re
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

from hyperdsd.testing import NotApplicable

from .. import _compat, tensors
from . import policies
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


# -- how each kind builds its meshes ---------------------------------------


def _no_mesh(setup) -> None:
    setup.mesh = None


def _world_mesh(setup) -> None:
    """The layout's meshes over the whole world; the first is the model's."""
    meshes = [setup.c.mesh(spec, dims) for spec, dims in setup.layout.meshes]
    setup.mesh, setup.meshes = meshes[0], meshes


def _stages(setup) -> None:
    _world_mesh(setup)
    setup.stage = setup.mesh.get_coordinate()[0]


def _parts(setup) -> None:
    """Disjoint parts of the world (as many as the name has numbers), each
    with its own 1-D mesh; the rank's model lives on its own part's."""
    spans = setup.layout.spans
    meshes = submeshes(setup.c, spans)
    setup.part = next(i for i, span in enumerate(spans) if setup.c.rank in span)
    setup.ranks, setup.mesh, setup.meshes = spans[setup.part], meshes[setup.part], meshes


def model_group(c, layout: str):
    """The process group of this rank's model on ``layout`` (None: the whole world)."""
    lay = parse_layout(layout)
    if not lay.kind.parts:
        return None
    spans = lay.spans
    return submeshes(c, spans)[next(i for i, span in enumerate(spans) if c.rank in span)].get_group()


def submeshes(c, spans: list[tuple[int, ...]]) -> list:
    """A 1-D mesh over each span of ranks, built once per world on every rank
    alike (a mesh over part of the world is still made by all of it).

    Its dim is named ``part``, a name no other layout uses: torch 2.6 to 2.9
    compare meshes by ranks and dim names, and DTensor's caches and mesh
    registry would hand a model on ranks 2-3 the ``shard`` slice of an
    earlier case's pp x shard mesh over the same ranks, with that mesh's
    groups (one program would not build both)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = ("submeshes", tuple(spans))
    if key not in c.rank_ctx.cache:
        device = c.rank_ctx.device_type
        c.rank_ctx.cache[key] = [DeviceMesh(device, list(span), mesh_dim_names=("part",)) for span in spans]
    return c.rank_ctx.cache[key]


# -- how each kind shards a model ------------------------------------------


def _unsharded(setup) -> None:
    pass


def stack_mesh(setup, mesh):
    """``mesh`` (torch's ``DeviceMesh``) as the adapter's ``shard`` takes it:
    the stack's own mesh, built from its description once per rank, where the
    adapter builds meshes (``Adapter.mesh``, SPEC 1.6); torch's otherwise.
    Every rank of the layout shards alike, so every rank of ``mesh`` asks for
    it at the same point."""
    if setup.c.adapter.mesh is None:
        return mesh
    description = tensors.MeshDescription.of(mesh)
    key = ("stack-mesh", description)
    cache = setup.c.rank_ctx.cache
    if key not in cache:
        cache[key] = setup.c.iut.mesh(description)
    return cache[key]


def _blocks_and_root(setup, mesh) -> None:
    shard, policy = setup.c.iut.shard, setup.layout.policy
    mesh = stack_mesh(setup, mesh)
    refusal = _compat.cpu_reshard_refusal() if policies.reshards(policy) and setup.device.type == "cpu" else ""
    if refusal:
        raise NotApplicable(refusal)
    blocks = list(setup.module.layers.values())
    for i, block in enumerate(blocks):
        shard(block, mesh=mesh, **policies.arguments(policy, "last" if i == len(blocks) - 1 else "block", setup))
    shard(setup.module, mesh=mesh, **policies.arguments(policy, "root", setup))


def _fsdp(setup) -> None:
    _blocks_and_root(setup, setup.mesh)


def _fsdp_on_shard_dim(setup) -> None:
    _blocks_and_root(setup, setup.mesh["shard"])


def _tp_then_fsdp(setup) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in setup.module.layers.values():
        parallelize_module(block, setup.mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    _fsdp_on_shard_dim(setup)


def _dense_children(setup, *, skip: tuple[str, ...]) -> None:
    """Every module but the experts' own fully sharded over the world, each on
    its own (the root is not: it would take over the parameters the layout
    placed itself)."""
    shard, mesh, module = setup.c.iut.shard, stack_mesh(setup, setup.mesh), setup.module
    for block in module.layers.values():
        shard(block, mesh=mesh)
    for name in ("tok", "norm", "head", "aux"):
        shard(getattr(module, name), mesh=mesh)
    for name in ("router", "experts"):
        if name not in skip:
            shard(getattr(module.moe, name), mesh=mesh)


def _experts_on_ep_mesh(setup) -> None:
    """Experts over ``ep`` (whole experts per rank), each expert's rows over
    ``dp``: a 2-D DTensor on the ``ep x dp`` mesh; the rest as FSDP lays it."""
    from torch.distributed.tensor import Shard

    _place(setup.module.moe.experts, setup.meshes[1], [Shard(0), Shard(1)])
    _dense_children(setup, skip=("experts",))


def _router_replicated(setup) -> None:
    """The router replicated on a sub-mesh (the ``rep`` slice of the second
    mesh), as tensor-parallel layers keep their norms; the rest as FSDP lays it."""
    from torch.distributed.tensor import Replicate

    _place(setup.module.moe.router, setup.meshes[1]["rep"], [Replicate()])
    _dense_children(setup, skip=("router",))


def _place(module: nn.Module, mesh, placements) -> None:
    """The suite distributes ``module``'s weight itself, as the stack under test's value (``from_torch``)."""
    with torch.no_grad():
        placed = _compat.distribute_locally(module.weight.detach(), mesh, placements)
        module.weight = nn.Parameter(tensors.from_torch(placed))


def _experts(cfg: ModelConfig, setup) -> ModelConfig:
    return replace(cfg, experts=4)


def _second_model_differs(cfg: ModelConfig, setup) -> ModelConfig:
    """Each sub-world's model is another model (as an actor and a critic are)."""
    return replace(cfg, n_layers=cfg.n_layers + setup.part)


def _fsdp1_units(setup) -> None:
    """FSDP1 (torch's ``FullyShardedDataParallel``) on every block, then on the
    root, with ``device_id`` the rank's device (SPEC §2). The suite wraps with
    torch's own class, whatever the implementation under test: it is judged on
    its state-dict functions, and FSDP1 has no sharding API to adapt (FSDP2's
    ``fully_shard`` is the adapter's ``shard``). ``setup.module`` becomes the
    root wrapper: its own ``state_dict`` (FSDP1's full state dict, canonical
    keys) is the suite's reference way for the model."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    kind = setup.layout.kind
    kwargs = {
        "device_id": setup.device,
        "use_orig_params": not kind.flat_params,
        "sharding_strategy": ShardingStrategy[kind.strategy],
    }
    if kind.strategy == "HYBRID_SHARD":
        kwargs["device_mesh"] = setup.mesh
    module = setup.module
    if any(p.is_meta for p in module.parameters()):
        # A model built on the meta device (MODEL-4): FSDP1 allocates each module's
        # storage where it runs; the values are what the load then writes.
        kwargs["param_init_fn"] = lambda m: m.to_empty(device=setup.device, recurse=False)
    with warnings.catch_warnings():  # FSDP1's deprecation notice, and its notes on CPU devices
        warnings.simplefilter("ignore")
        for name in list(module.layers):
            module.layers[name] = FSDP(module.layers[name], **kwargs)
        setup.module = FSDP(module, **kwargs)


# -- data parallelism -------------------------------------------------------


def _no_dp(setup) -> tuple[int, int]:
    return 0, 1


def _world_dp(setup) -> tuple[int, int]:
    return setup.c.rank, setup.c.world_size


def _shard_dim_dp(setup) -> tuple[int, int]:
    return setup.mesh.get_local_rank("shard"), setup.mesh["shard"].size()


def _part_dp(setup) -> tuple[int, int]:
    return setup.ranks.index(setup.c.rank), len(setup.ranks)


def _ddp(module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)


KINDS: tuple[LayoutKind, ...] = (
    LayoutKind("single", r"single", lambda: (1, (("1", ("shard",)),), 1), _no_mesh, _unsharded, _no_dp, family="plain"),
    LayoutKind(
        "ddp",
        r"ddp",
        lambda: (2, (("2", ("shard",)),), 1),
        _world_mesh,
        _unsharded,
        _world_dp,
        wrap=_ddp,
        wrapper="ddp",
        family="ddp",
    ),
    LayoutKind(
        "fsdp",
        r"fsdp(\d+)",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        _fsdp,
        _world_dp,
        wrapper="fsdp2",
        policies=True,
        family="fsdp2",
    ),
    LayoutKind(
        "hsdp",
        r"hsdp(\d+)x(\d+)",
        lambda r, s: (r * s, ((f"{r}x{s}", ("replicate", "shard")),), 1),
        _world_mesh,
        _fsdp,
        _world_dp,
        wrapper="fsdp2",
        policies=True,
        family="hsdp",
    ),
    LayoutKind(
        "pp",
        r"pp(\d+)",
        lambda p: (p, ((f"{p}", ("pp",)),), p),
        _stages,
        _unsharded,
        _no_dp,
        needs=("pipeline",),
        family="pipeline",
    ),
    LayoutKind(
        "ppfsdp",
        r"pp(\d+)xfsdp(\d+)",
        lambda p, s: (p * s, ((f"{p}x{s}", ("pp", "shard")),), p),
        _stages,
        _fsdp_on_shard_dim,
        _shard_dim_dp,
        wrapper="fsdp2",
        needs=("pipeline",),
        family="pipeline",
    ),
    LayoutKind(
        "tp",
        r"fsdp(\d+)xtp(\d+)",
        lambda d, t: (d * t, ((f"{d}x{t}", ("shard", "tp")),), 1),
        _world_mesh,
        _tp_then_fsdp,
        _shard_dim_dp,
        wrapper="fsdp2",
        needs=("tensor_parallel",),
    ),
    # A mixture of experts: dense layers sharded over the world, the experts
    # on an ``ep x dp`` mesh of their own (OPT-MESH-1).
    LayoutKind(
        "ep",
        r"fsdp(\d+)\+ep(\d+)x(\d+)",
        lambda n, e, d: (n, ((f"{n}", ("shard",)), (f"{e}x{d}", ("ep", "dp"))), 1),
        _world_mesh,
        _experts_on_ep_mesh,
        _world_dp,
        model=_experts,
        serves=(("OPT-MESH-1", ("fsdp4+ep2x2",)),),
        wrapper="fsdp2",
        needs=("several_meshes",),
    ),
    # ... with an expert-parallel degree of 1: the stacked experts FSDP-sharded on dim 0.
    LayoutKind(
        "ep1",
        r"fsdp(\d+)\+ep1",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        lambda setup: _dense_children(setup, skip=()),
        _world_dp,
        model=_experts,
        serves=(("OPT-MESH-1", ("fsdp4+ep1",)),),
        wrapper="fsdp2",
        needs=("several_meshes",),
    ),
    # ... with the router replicated on sub-meshes of ``rep`` ranks.
    LayoutKind(
        "rep",
        r"fsdp(\d+)\+rep(\d+)",
        lambda n, r: (n, ((f"{n}", ("shard",)), (f"{n // r}x{r}", ("group", "rep"))), 1),
        _world_mesh,
        _router_replicated,
        _world_dp,
        model=_experts,
        serves=(("OPT-MESH-1", ("fsdp4+rep2",)),),
        wrapper="fsdp2",
        needs=("several_meshes",),
    ),
    # FSDP1 (SPEC §2, 1.3): FullyShardedDataParallel on every block and the root.
    LayoutKind(
        "fsdp1",
        r"fsdp1-(\d+)",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        _fsdp1_units,
        _world_dp,
        wrapper="fsdp1",
        strategy="FULL_SHARD",
        needs=("fsdp1",),
        family="fsdp1",
    ),
    LayoutKind(
        "fsdp1-flat",
        r"fsdp1-(\d+)-flat",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        _fsdp1_units,
        _world_dp,
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
        _world_mesh,
        _fsdp1_units,
        _world_dp,
        wrapper="fsdp1",
        strategy="SHARD_GRAD_OP",
        needs=("fsdp1",),
        family="fsdp1",
    ),
    LayoutKind(
        "hsdp1",
        r"hsdp1-(\d+)x(\d+)",
        lambda r, s: (r * s, ((f"{r}x{s}", ("replicate", "shard")),), 1),
        _world_mesh,
        _fsdp1_units,
        _world_dp,
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
        _parts,
        _fsdp,
        _part_dp,
        model=_second_model_differs,
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


def family(layout: str) -> str:
    """The family a case's layout counts in; "other" for a name no kind knows."""
    if "_to_" in layout:
        return "reshard"
    try:
        parsed = parse_layout(layout)
    except ValueError:
        return "other"
    return "policies" if parsed.policy else parsed.kind.family


def parse_layout(name: str) -> Layout:
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
