"""The private torch APIs the suite needs, each with its reason (the suite's own fence).

The suite keeps these apart from hyperdsd's: it must not share code with an
implementation it judges.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

# pyproject.toml's floor. Checked here, the first of the suite's modules that
# the CLI, the registry and the ranks import (the package itself stays light
# for the pytest plugin), so that an older torch gets this one error.
MIN_TORCH = (2, 6)
_TORCH = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", str(torch.__version__)).groups())
if _TORCH < MIN_TORCH:
    raise ImportError(
        f"the conformance suite needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later, found torch {torch.__version__}: "
        "its FSDP2 layouts shard with torch.distributed.fsdp.fully_shard, public from 2.6 on"
    )


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    # Activation checkpointing's wrapper module, whose child name
    # (_checkpoint_wrapped_module) state dicts must hide; torch keeps it in a
    # private module path. The suite wraps models with it.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module)


def fsdp2_on_cpu() -> None:
    """Let FSDP2 train on CPU ranks (gloo), as the suite's layouts do, on torch 2.6 and 2.7; 2.8 and later
    need nothing.

    - ``torch.cpu.Stream`` (a stub for device-agnostic code) lacks ``record_event``
      and ``wait_event`` on 2.6, which FSDP2's collectives call, and 2.7's returns
      no event, which HSDP asserts it gets; on the CPU every op is already
      ordered, so the events are the stub's own no-op ``torch.cpu.Event``.
    - 2.6 and 2.7: HSDP averages gradients across replicas with
      ``all_reduce(ReduceOp.AVG)``, which gloo refuses; with a gloo replica group
      the gradients are divided before and after summing instead, FSDP2's own
      path for fp16 (2.8 added ``force_sum_reduction_for_comms`` for this).
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    factors = collectives._get_gradient_divide_factors
    if "force_sum_reduction_for_comms" in inspect.signature(factors).parameters or hasattr(factors, "_gloo_safe"):
        return
    stream = torch.cpu.Stream
    if not hasattr(stream, "record_event") or stream().record_event() is None:
        stream.record_event = lambda self, event=None: event or torch.cpu.Event()
        stream.wait_event = lambda self, event: None

    def gloo_safe_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, *args, **kwargs):
        if all_reduce_group is not None and torch.distributed.get_backend(all_reduce_group) == "gloo":
            reduce_dtype = torch.float16
        return factors(reduce_scatter_group, all_reduce_group, reduce_dtype, *args, **kwargs)

    gloo_safe_factors._gloo_safe = True
    collectives._get_gradient_divide_factors = gloo_safe_factors


def cpu_reshard_refusal() -> str:
    """Why FSDP2 on CPU ranks cannot reshard after forward on this torch ('' where it can).

    torch 2.6 (which trains FSDP2 on the CPU only with :func:`fsdp2_on_cpu`)
    fails the backward of a unit it resharded after forward: autograd's
    version check finds the parameter gathered again for backward "modified
    by an inplace operation". 2.13 and 2.14 train it; the suite's base
    layouts keep parameters gathered after forward and are unaffected.
    """
    if _TORCH < (2, 7):
        return (
            f"torch {torch.__version__}'s FSDP2 cannot reshard after forward on CPU ranks (its backward fails "
            "autograd's version check on the parameters it gathers again)"
        )
    return ""


def shared_post_forward_meshes() -> None:
    """Make ``fully_shard(reshard_after_forward=<int>)`` reuse one post-forward mesh per rank layout and world.

    FSDP2 builds that mesh with ``DeviceMesh(...)`` on every call, which
    creates new process groups each time (two per rank on a 2 x 2 mesh), and
    torch's group registry keeps every group alive until the world is torn
    down. A program shards once; the suite's rank processes shard a model per
    case for as long as they live, so the groups (each with gloo's threads)
    piled up run over run (``fsdp4.reshard2``). Equal layouts share the mesh
    instead, as the units of one model share their main mesh; a new world
    (a new default group) starts afresh. The helper is private, imported by
    name into two modules, and no public API takes the post-forward mesh.
    """
    import weakref

    import torch.distributed as dist

    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard
    except ImportError:  # another layout of FSDP2's modules: left as torch has it
        return
    make = getattr(_fsdp_init, "_get_post_forward_mesh_info", None)
    if make is None or hasattr(make, "_shared"):
        return
    made: dict = {}
    under: list = [None]

    def shared(reshard_after_forward, mesh_info):
        size = getattr(mesh_info, "shard_mesh_size", 0)
        if isinstance(reshard_after_forward, bool) or not (
            isinstance(reshard_after_forward, int) and 1 < reshard_after_forward < size
        ):
            return make(reshard_after_forward, mesh_info)  # no new mesh, or torch's own error
        world = dist.group.WORLD
        if under[0] is None or under[0]() is not world:
            made.clear()
            under[0] = weakref.ref(world)
        ranks = mesh_info.mesh.mesh
        key = (mesh_info.mesh.device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()), reshard_after_forward)
        if key not in made:
            made[key] = make(reshard_after_forward, mesh_info)
        return made[key]

    shared._shared = True
    for module in (_fsdp_init, _fully_shard):
        if getattr(module, "_get_post_forward_mesh_info", None) is make:
            module._get_post_forward_mesh_info = shared


def distribute_locally(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """``distribute_tensor(full, mesh, placements, src_data_rank=None)``: every rank holds ``full`` and cuts its
    own piece, with no communication (the suite's own copy: it shares no code with hyperdsd)."""
    from torch.distributed.tensor import distribute_tensor

    if _HAS_SRC_DATA_RANK:
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    # torch 2.6 has no src_data_rank: its distribute_tensor always scatters
    # (or broadcasts) rank 0's tensor, which would be every rank's own piece
    # anyway. The collectives it calls are swapped for local copies meanwhile.
    from torch.distributed.tensor import placement_types

    def scatter(output, scatter_list, mesh, mesh_dim=0, **_):
        output.copy_(scatter_list[mesh.get_local_rank(mesh_dim)])

    saved = placement_types.mesh_scatter, placement_types.mesh_broadcast
    placement_types.mesh_scatter, placement_types.mesh_broadcast = scatter, lambda *a, **k: None
    try:
        return distribute_tensor(full, mesh, placements)
    finally:
        placement_types.mesh_scatter, placement_types.mesh_broadcast = saved


def _has_src_data_rank() -> bool:
    from torch.distributed.tensor import distribute_tensor

    return "src_data_rank" in inspect.signature(distribute_tensor).parameters


_HAS_SRC_DATA_RANK = _has_src_data_rank()


def gloo_safe_pipeline_start() -> None:
    """Make a pipeline schedule's first exchange agree on its dtype, as torch 2.12 does; earlier releases are
    left as they are where they already agree.

    Before its first step, a schedule sends each neighbour stage a one-element tensor: torch 2.9 sends
    the stage index as int64 (8 bytes) into a float32 (4 bytes) receive buffer, which gloo refuses by
    aborting the receiving process. The suite's pipeline layouts train on gloo; the index is sent as float32.
    """
    from torch.distributed.pipelining import stage

    base = stage._PipelineStageBase
    ops_of = getattr(base, "_get_init_p2p_neighbors_ops", None)
    if ops_of is None or getattr(ops_of, "_float32_sends", False):
        return

    def float32_sends(self):
        ops = ops_of(self)
        for op in ops:
            if op.op is torch.distributed.isend and op.tensor.dtype != torch.float32:
                op.tensor = op.tensor.to(torch.float32)
        return ops

    float32_sends._float32_sends = True
    float32_sends.__wrapped__ = ops_of
    base._get_init_p2p_neighbors_ops = float32_sends


def pipeline_schedule(schedule_class, stage, n_microbatches: int, loss_fn):
    """``schedule_class(stage, n_microbatches, loss_fn=loss_fn)`` whose gradients are the mean over the
    microbatches, as a whole-model step on the same batch gives with a mean loss, on every torch.

    Schedules that take ``scale_grads`` (default True) divide the summed gradients by the number of
    microbatches; torch 2.6's take no such argument and leave them summed, so a pipeline layout would train
    on ``n_microbatches`` times the gradients of the others. There the loss of each microbatch is divided
    instead (by a power of two in the suite: the same gradients to the bit).
    """
    if "scale_grads" in inspect.signature(schedule_class).parameters:
        return schedule_class(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)

    def microbatch_share(output, target):
        return loss_fn(output, target) / n_microbatches

    return schedule_class(stage, n_microbatches=n_microbatches, loss_fn=microbatch_share)


def dcp_on_subgroups() -> None:
    """Let torch 2.6's and 2.7's DCP save and load on a process group that lacks global rank 0, as 2.8 does.

    DCP coordinates through its first group rank, but torch 2.6 passes that group rank to the object
    collectives as a global rank (2.7 still does in ``broadcast_object``), so ``dcp.save(...,
    process_group=half)`` on the half of the world without rank 0 raises "Global rank 0 is not part of
    group". The suite runs DCP on such halves (OPT-MESH-2); this fixes DCP itself, not the
    implementation under test, so users of 2.6 and 2.7 meet it.
    """
    from torch.distributed.checkpoint import utils

    wrapper = utils._DistWrapper
    # 2.8 and later broadcast from their global_coordinator_rank too.
    broadcast = getattr(wrapper, "broadcast_object", None)
    if hasattr(wrapper.__init__, "_global") or (
        broadcast is not None and "global_coordinator_rank" in broadcast.__code__.co_names
    ):
        return
    init = wrapper.__init__

    def init_with_global_coordinator(self, group, use_dist, coordinator_rank):
        init(self, group, use_dist, coordinator_rank)
        if use_dist and group is not None:
            self.coordinator_rank = torch.distributed.get_global_rank(group, coordinator_rank)

    init_with_global_coordinator._global = True
    wrapper.__init__ = init_with_global_coordinator


def stepped_parameters(module: torch.nn.Module) -> dict[tuple[int, str], torch.nn.Parameter]:
    """Where FSDP2 has ``module``'s parameters unsharded (after a forward that
    did not reshard, an ``unshard()``), the module attributes hold the
    unsharded tensors while the optimizer steps the sharded ones: for each
    such (id of the owning module, attribute name), the sharded parameter.
    FSDP2 tells where its sharded parameters are only through its private
    parameter groups."""
    from torch.distributed.fsdp import FSDPModule

    found: dict[tuple[int, str], torch.nn.Parameter] = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # one group per state before the list
            groups = [g for g in (getattr(state, "_fsdp_param_group", None),) if g is not None]
        for group in groups:
            for fp in group.fsdp_params:
                info = fp._module_info
                owners = [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]
                for owner, name in owners:
                    found[(id(owner), name)] = fp.sharded_param
    return found


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    """What ``module`` holds under each parameter name, itself only: where FSDP2
    has it unsharded, the unsharded tensors, which ``named_parameters`` would
    hide behind nothing else to tell them from the sharded ones."""
    return module._parameters


def flat_param_fqns(param) -> list[str] | None:
    """The names of the original parameters an FSDP1 flat parameter holds,
    relative to the module it is registered on (its private ``_fqns``); None
    for any other parameter."""
    # FlatParameter's instances are nn.Parameter objects its metaclass tells
    # apart (type(p) is Parameter): isinstance is the test.
    from torch.distributed.fsdp._flat_param import FlatParameter

    return list(param._fqns) if isinstance(param, FlatParameter) else None


@dataclass(frozen=True)
class FSDP1Unit:
    """One FSDP1 unit as only its flat parameter's private fields tell it:
    which part of which original parameter this rank's shard holds."""

    name: str  # the unit's module name under the root
    group: object  # the process group it is sharded over (the shard group under HYBRID_SHARD)
    flat_param: torch.nn.Parameter
    fqns: tuple[str, ...]  # its original parameters, relative to the unit
    shapes: tuple[torch.Size, ...]
    numels: tuple[int, ...]
    originals: tuple | None  # with use_orig_params, the original parameters
    # (index of the original parameter, offset in the shard, elements in it, first and last index
    # within the original parameter), for those this rank's shard holds.
    pieces: tuple[tuple[int, int, int, int, int], ...]

    @property
    def local_shard(self) -> torch.Tensor:
        """This rank's flat shard (FSDP1 sets it at its lazy init, the first forward)."""
        return self.flat_param._local_shard


def fsdp1_units(root: torch.nn.Module) -> list[FSDP1Unit]:
    """Every FSDP1 unit under ``root`` that holds parameters: FSDP1 tells which
    part of which original parameter a rank's chunk holds only through the flat
    parameter's private fields (``_fqns``, ``_shapes``, ``_numels``,
    ``_shard_param_infos``, ``_local_shard``, and ``_params`` with
    ``use_orig_params``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = []
    for name, unit in root.named_modules():
        if not isinstance(unit, FSDP) or unit._handle is None:
            continue
        flat_param = unit._handle.flat_param
        originals = getattr(flat_param, "_params", None)
        pieces = tuple(
            (i, info.offset_in_shard, info.numel_in_shard, info.intra_param_start_idx, info.intra_param_end_idx)
            for i, info in enumerate(flat_param._shard_param_infos)
            if info.in_shard
        )
        out.append(
            FSDP1Unit(
                name,
                unit.process_group,
                flat_param,
                tuple(flat_param._fqns),
                tuple(flat_param._shapes),
                tuple(flat_param._numels),
                tuple(originals) if originals is not None else None,
                pieces,
            )
        )
    return out


def sharded_tensor_pieces(value) -> list | None:
    """``[(offsets, local tensor), ...]`` of a ``ShardedTensor`` (what torch's own FSDP1 state dicts hold
    in the sharded mode), or None for anything else. ShardedTensor lives in a private module path and
    supports few tensor functions (not ``numel``): the oracle compares its global size and local shards."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if not isinstance(value, ShardedTensor):
        return None
    return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor as it holds it (``to_local()`` is an autograd function: a cost per tensor)."""
    return t._local_tensor


def dtensor_like(value, local_tensor: torch.Tensor):
    """A DTensor laid out as the DTensor ``value`` around ``local_tensor``. DTensor's public constructor
    (``from_local``) costs a dispatch and checks, tens of microseconds, seconds for a many-key model's
    snapshot (SPEC SCALE); the private one makes the same DTensor, its spec shared."""
    return type(value).__new__(type(value), local_tensor, value._spec, requires_grad=False)
