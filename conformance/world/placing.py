"""How each layout kind places a model a setup builds: the meshes it builds,
how it shards the model (FSDP2's ``fully_shard``, the adapter's ``shard``, on
the stack's own mesh where it builds one; tensor parallelism; weights the
suite places on meshes of their own; torch's FSDP1), its data parallelism.

A kind's functions take the :class:`~conformance.world.setup.Setup` being
built and fill it in (:mod:`conformance.world.layouts` names them in its
table of kinds).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from hyperdsd.testing import NotApplicable

from .. import _compat, tensors
from . import policies
from .models import ModelConfig


def unsharded(setup) -> None:
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


def blocks_and_root(setup, mesh) -> None:
    shard, policy = setup.c.iut.shard, setup.layout.policy
    mesh = stack_mesh(setup, mesh)
    refusal = _compat.cpu_reshard_refusal() if policies.reshards(policy) and setup.device.type == "cpu" else ""
    if refusal:
        raise NotApplicable(refusal)
    blocks = list(setup.module.layers.values())
    for i, block in enumerate(blocks):
        shard(block, mesh=mesh, **policies.arguments(policy, "last" if i == len(blocks) - 1 else "block", setup))
    shard(setup.module, mesh=mesh, **policies.arguments(policy, "root", setup))


def fsdp(setup) -> None:
    blocks_and_root(setup, setup.mesh)


def fsdp_on_shard_dim(setup) -> None:
    blocks_and_root(setup, setup.mesh["shard"])


def tp_then_fsdp(setup) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in setup.module.layers.values():
        parallelize_module(block, setup.mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fsdp_on_shard_dim(setup)


def dense_children(setup, *, skip: tuple[str, ...]) -> None:
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


def experts_on_ep_mesh(setup) -> None:
    """Experts over ``ep`` (whole experts per rank), each expert's rows over
    ``dp``: a 2-D DTensor on the ``ep x dp`` mesh; the rest as FSDP lays it."""
    from torch.distributed.tensor import Shard

    place(setup.module.moe.experts, setup.meshes[1], [Shard(0), Shard(1)])
    dense_children(setup, skip=("experts",))


def router_replicated(setup) -> None:
    """The router replicated on a sub-mesh (the ``rep`` slice of the second
    mesh), as tensor-parallel layers keep their norms; the rest as FSDP lays it."""
    from torch.distributed.tensor import Replicate

    place(setup.module.moe.router, setup.meshes[1]["rep"], [Replicate()])
    dense_children(setup, skip=("router",))


def place(module: nn.Module, mesh, placements) -> None:
    """The suite distributes ``module``'s weight itself, as the stack under test's value (``from_torch``)."""
    with torch.no_grad():
        placed = _compat.distribute_locally(module.weight.detach(), mesh, placements)
        module.weight = nn.Parameter(tensors.from_torch(placed))


def fsdp1_units(setup) -> None:
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


# -- how each kind builds its meshes ---------------------------------------


def no_mesh(setup) -> None:
    setup.mesh = None


def world_mesh(setup) -> None:
    """The layout's meshes over the whole world; the first is the model's."""
    meshes = [setup.c.mesh(spec, dims) for spec, dims in setup.layout.meshes]
    setup.mesh, setup.meshes = meshes[0], meshes


def stages(setup) -> None:
    world_mesh(setup)
    setup.stage = setup.mesh.get_coordinate()[0]


def parts(setup) -> None:
    """Disjoint parts of the world (as many as the name has numbers), each
    with its own 1-D mesh; the rank's model lives on its own part's."""
    spans = setup.layout.spans
    meshes = submeshes(setup.c, spans)
    setup.part = next(i for i, span in enumerate(spans) if setup.c.rank in span)
    setup.ranks, setup.mesh, setup.meshes = spans[setup.part], meshes[setup.part], meshes


def model_group(c, layout):
    """The process group of this rank's model on ``layout`` (None: the whole world)."""
    if not layout.kind.parts:
        return None
    spans = layout.spans
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


def experts(cfg: ModelConfig, setup) -> ModelConfig:
    return replace(cfg, experts=4)


def second_model_differs(cfg: ModelConfig, setup) -> ModelConfig:
    """Each sub-world's model is another model (as an actor and a critic are)."""
    return replace(cfg, n_layers=cfg.n_layers + setup.part)


# -- data parallelism -------------------------------------------------------


def no_dp(setup) -> tuple[int, int]:
    return 0, 1


def world_dp(setup) -> tuple[int, int]:
    return setup.c.rank, setup.c.world_size


def shard_dim_dp(setup) -> tuple[int, int]:
    return setup.mesh.get_local_rank("shard"), setup.mesh["shard"].size()


def part_dp(setup) -> tuple[int, int]:
    return setup.ranks.index(setup.c.rank), len(setup.ranks)


def ddp(module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
