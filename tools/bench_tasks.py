"""Rank-side work for ``python -m tools.bench``: build a model once per
process, time get/set in one mode for both implementations, or measure peak
memory."""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

SIZES = {  # name -> (layers, blocks of layers, width): about 4M, 17M, 67M params, and 10,000 small ones
    "4m": (4, 1, 1024),
    "17m": (4, 1, 2048),
    "67m": (4, 1, 4096),
    "10k": (50, 100, 4),
}
MODES = ("get", "set", "full_get", "bcast_set", "flat_get", "flat_set", "dcp")


def _impl(name):
    if name == "torch":
        import torch.distributed.checkpoint.state_dict as impl
    else:
        import hyperdsd as impl
    return impl


def _build(ctx, size: str, mesh: str):
    key = ("model", size, mesh)
    if key not in ctx.cache:
        from torch.distributed.fsdp import fully_shard

        ctx.cache.clear()  # one model per process at a time: memory figures stay readable
        gc.collect()
        per_block, blocks, width = SIZES[size]
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(*[nn.Linear(width, width) for _ in range(per_block)]) for _ in range(blocks)])
        m = ctx.mesh(mesh)
        for block in model:
            fully_shard(block, mesh=m)
        fully_shard(model, mesh=m)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctx.cache[key] = (model, opt)
    return ctx.cache[key]


def _options(impl, **fields):
    return impl.StateDictOptions(**fields)


def _prepare(ctx, impl_name, mode, model, opt):
    """Inputs for a set: what the same implementation's get returns (not timed)."""
    impl = _impl(impl_name)
    if mode in ("set", "flat_set"):
        opts = _options(impl, flatten_optimizer_state_dict=(mode == "flat_set"))
        return impl.get_state_dict(model, opt, options=opts)
    if mode == "bcast_set":
        msd, osd = impl.get_state_dict(model, opt, options=_options(impl, full_state_dict=True, cpu_offload=True))
        return (msd, osd) if ctx.rank == 0 else ({}, {})
    return None


def _op(ctx, impl_name, mode, model, opt, inputs):
    impl = _impl(impl_name)
    if mode == "get":
        impl.get_state_dict(model, opt)
    elif mode == "flat_get":
        impl.get_state_dict(model, opt, options=_options(impl, flatten_optimizer_state_dict=True))
    elif mode == "full_get":
        impl.get_state_dict(model, opt, options=_options(impl, full_state_dict=True, cpu_offload=True))
    elif mode in ("set", "flat_set"):
        msd, osd = inputs
        opts = _options(impl, flatten_optimizer_state_dict=(mode == "flat_set"))
        impl.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=opts)
    elif mode == "bcast_set":
        # Separate calls: torch's set_state_dict skips the model on ranks that pass
        # an empty model dict while rank 0 broadcasts it, and hangs.
        msd, osd = inputs
        opts = _options(impl, full_state_dict=True, broadcast_from_rank0=True)
        impl.set_model_state_dict(model, msd, options=opts)
        impl.set_optimizer_state_dict(model, opt, osd, options=opts)
    elif mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        box = [tempfile.mkdtemp(prefix="bench-dcp-") if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        msd, osd = impl.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=box[0])
        msd, osd = impl.get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=box[0], planner=DefaultLoadPlanner(allow_partial_load=True))
        impl.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def _local_state(model, opt) -> torch.Tensor:
    """This rank's shards of every parameter and state tensor, as one flat buffer."""
    return torch.empty(_state_bytes(model, opt), dtype=torch.uint8)


def _floor(ctx, mode: str, model, opt, buf) -> None:
    """The least work any implementation giving hyperdsd's guarantees must do.

    set, flat_set: torch's own op, then one all-reduce of two flags: the
    agreement that makes bad input on one rank raise on all (SPEC OPT-ATOM-4),
    which torch's sharded set does not perform. full_get: every rank's state
    bytes gathered into rank 0 in one gloo call. bcast_set: the same bytes
    scattered from rank 0 in one call. Other modes: one all-reduce.
    """
    flag = torch.zeros(2, dtype=torch.int32)
    if mode in ("set", "flat_set"):
        _op(ctx, "torch", mode, model, opt, ctx.cache["floor_inputs"])
        dist.all_reduce(flag)
    elif mode == "full_get":
        # On a 2-D mesh one replica's shards make the whole: rank 0's shard group.
        group = ctx.mesh(ctx.cache["mesh"]).get_group("shard") if "x" in ctx.cache["mesh"] else dist.group.WORLD
        if 0 in dist.get_process_group_ranks(group):
            n = dist.get_world_size(group)
            dist.gather(buf, [torch.empty_like(buf) for _ in range(n)] if ctx.rank == 0 else None, group=group, group_dst=0)
    elif mode == "bcast_set":
        dist.scatter(buf, [torch.empty_like(buf) for _ in range(ctx.world_size)] if ctx.rank == 0 else None, src=0)
    else:
        dist.all_reduce(flag)


def time_mode(ctx, size: str, mode: str, mesh: str, reps: int, budget_s: float = 90.0):
    """Alternate the two implementations and the floor, ``reps`` times each,
    or fewer once ``budget_s`` is spent (one each at least); slowest rank's ms."""
    model, opt = _build(ctx, size, mesh)
    ctx.cache["mesh"] = mesh
    buf = _local_state(model, opt) if mode in ("full_get", "bcast_set") else None
    began = time.perf_counter()
    times = {"torch": [], "hyperdsd": [], "floor": []}
    orders = (("torch", "hyperdsd", "floor"), ("hyperdsd", "floor", "torch"), ("floor", "torch", "hyperdsd"))
    for r in range(reps):
        spent = torch.tensor([time.perf_counter() - began])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # every rank stops at the same repetition
        if r > 0 and spent.item() > budget_s:
            break
        for name in orders[r % 3]:
            inputs = _prepare(ctx, "torch" if name == "floor" else name, mode, model, opt)
            ctx.cache["floor_inputs"] = inputs
            dist.barrier()
            start = time.perf_counter()
            if name == "floor":
                _floor(ctx, mode, model, opt, buf)
            else:
                _op(ctx, name, mode, model, opt, inputs)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item() * 1000)
            del inputs
            ctx.cache.pop("floor_inputs", None)
    return times


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _state_bytes(model, opt) -> int:
    """Bytes of this rank's own model and optimizer state (its shards)."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = sum(local(p).numel() * p.element_size() for p in model.parameters())
    for entry in opt.state.values():
        total += sum(local(v).numel() * v.element_size() for v in entry.values() if isinstance(v, torch.Tensor))
    return total


def memory(ctx, impl: str, size: str, mode: str, mesh: str):
    """Peak resident memory above the baseline while one op runs, per rank (MiB)."""
    model, opt = _build(ctx, size, mesh)
    inputs = _prepare(ctx, impl, mode, model, opt)
    _op(ctx, impl, mode, model, opt, inputs)  # warm up allocations and imports
    inputs = _prepare(ctx, impl, mode, model, opt)
    gc.collect()
    # Return what the warm-up freed to the OS, or the op would reuse it
    # unseen and the peak would read low.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current size
    base = _status_kb("VmRSS")
    _op(ctx, impl, mode, model, opt, inputs)
    peak = _status_kb("VmHWM")
    return {"rank": ctx.rank, "peak_above_base_mib": (peak - base) / 1024, "own_state_mib": _state_bytes(model, opt) / 2**20}
