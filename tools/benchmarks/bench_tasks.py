"""Rank-side work for ``python -m tools.benchmarks.bench``: build a model once per
process, time get/set in one mode for both implementations, or measure peak
memory."""

from __future__ import annotations

import ctypes
import gc
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

SIZES = {  # name -> (layers, blocks of layers, width): about 4M, 17M, 67M, 268M params; 2,000 to 50,000 small ones
    "4m": (4, 1, 1024),
    "17m": (4, 1, 2048),
    "67m": (4, 1, 4096),
    "268m": (4, 1, 8192),
    "2k": (20, 50, 8),  # 50 FSDP units of 20 Linear(8, 8): 2,000 parameters (issue 48's comparison with torch)
    "10k": (50, 100, 4),  # 100 FSDP units of 50 Linear(4, 4): 10,000 parameters
    "50k": (50, 500, 4),  # 500 units of 50: 50,000 parameters
}
# Models of many small parameters: their rows add the per-tensor floor (see clone_floor).
MANY_KEYS = ("2k", "10k", "50k")
# Built on the meta device and materialised after sharding: a rank never holds the whole model.
ON_META = ("268m",)
# FSDP1 layouts (``--fsdp1-sizes``), by the name they take in place of a mesh: use_orig_params.
FSDP1_MESHES = {"fsdp1": True, "fsdp1-flat": False}


def keys_of(size: str) -> int:
    """Parameters (model keys; each also has three AdamW state values) of a size."""
    per_block, blocks, _ = SIZES[size]
    return per_block * blocks * 2


# bcast_both: hyperdsd loads model and optimizer in one set_state_dict (one
# manifest, one exchange); torch in two calls as in bcast_set (its
# set_state_dict hangs in this mode when other ranks pass an empty model dict).
# resume: hyperdsd.checkpoint.save then load, against torch's get_state_dict,
# plain dcp.save, get_state_dict, dcp.load and set_state_dict.
MODES = ("get", "set", "full_get", "bcast_set", "bcast_both", "flat_get", "flat_set", "dcp", "resume")


def _impl(name):
    if name == "torch":
        import torch.distributed.checkpoint.state_dict as impl
    else:
        import hyperdsd as impl
    return impl


def _build(ctx, size: str, mesh: str):
    """The model of ``size`` with AdamW state after one step, cached per process.

    ``mesh`` is a device mesh ("4", "2x2": ``fully_shard`` on each block of
    layers, then on the root) or an FSDP1 layout: "fsdp1"
    (``use_orig_params=True``) or "fsdp1-flat" (``False``), each block and
    then the root wrapped explicitly in ``FullyShardedDataParallel`` (FULL_SHARD
    on the whole world, ``device_id=cpu``), the same units as FSDP2's. FSDP1
    models are built on the CPU, whatever the size (no meta-device init).
    """
    key = ("model", size, mesh)
    if key not in ctx.cache:
        from torch.distributed.fsdp import fully_shard

        ctx.cache.clear()  # one model per process at a time: memory figures stay readable
        gc.collect()
        per_block, blocks, width = SIZES[size]
        fsdp1 = mesh in FSDP1_MESHES
        torch.manual_seed(0)
        with torch.device("meta" if size in ON_META and not fsdp1 else "cpu"):
            model = nn.Sequential(
                *[nn.Sequential(*[nn.Linear(width, width) for _ in range(per_block)]) for _ in range(blocks)]
            )
        if fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            wrap = {"device_id": torch.device("cpu"), "use_orig_params": FSDP1_MESHES[mesh]}
            model = FSDP(nn.Sequential(*[FSDP(block, **wrap) for block in model]), **wrap)
        else:
            m = ctx.mesh(mesh)
            for block in model:
                fully_shard(block, mesh=m)
            fully_shard(model, mesh=m)
        if size in ON_META and not fsdp1:
            model.to_empty(device="cpu")
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0, 0.01)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ctx.cache[key] = (model, opt)
    return ctx.cache[key]


def _options(impl, **fields):
    return impl.StateDictOptions(**fields)


def _prepare(ctx, impl_name, mode, model, opt):
    """Inputs for a set (not timed): what the same implementation's get
    returns; for a broadcast load, hyperdsd's full get for both (the same
    dicts of full CPU tensors; torch's full get takes minutes on the models
    with many parameters)."""
    impl = _impl(impl_name)
    if mode in ("set", "flat_set"):
        opts = _options(impl, flatten_optimizer_state_dict=(mode == "flat_set"))
        return impl.get_state_dict(model, opt, options=opts)
    if mode in ("bcast_set", "bcast_both"):
        impl = _impl("hyperdsd")
        msd, osd = impl.get_state_dict(model, opt, options=_options(impl, full_state_dict=True, cpu_offload=True))
        return (msd, osd) if ctx.rank == 0 else ({}, {})
    return None


def _op(ctx, impl_name, mode, model, opt, inputs):
    """One call of ``mode``; a get returns what it got (the caller times the
    call, then releases it)."""
    impl = _impl(impl_name)
    if mode == "get":
        return impl.get_state_dict(model, opt)
    if mode == "flat_get":
        return impl.get_state_dict(model, opt, options=_options(impl, flatten_optimizer_state_dict=True))
    if mode == "full_get":
        return impl.get_state_dict(model, opt, options=_options(impl, full_state_dict=True, cpu_offload=True))
    if mode in ("set", "flat_set"):
        msd, osd = inputs
        opts = _options(impl, flatten_optimizer_state_dict=(mode == "flat_set"))
        impl.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=opts)
    elif mode == "bcast_both" and impl_name == "hyperdsd":
        msd, osd = inputs
        opts = _options(impl, full_state_dict=True, broadcast_from_rank0=True)
        impl.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=opts)
    elif mode in ("bcast_set", "bcast_both"):
        # Separate calls: torch's set_state_dict skips the model on ranks that pass
        # an empty model dict while rank 0 broadcasts it, and hangs.
        msd, osd = inputs
        opts = _options(impl, full_state_dict=True, broadcast_from_rank0=True)
        impl.set_model_state_dict(model, msd, options=opts)
        impl.set_optimizer_state_dict(model, opt, osd, options=opts)
    elif mode == "resume":
        _resume(ctx, impl_name, model, opt)
    elif mode == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner

        box = [tempfile.mkdtemp(prefix="bench-dcp-") if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        msd, osd = impl.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=box[0])
        msd, osd = impl.get_state_dict(model, opt)
        # What each implementation's users pass: hyperdsd's planner (required
        # keys as DCP's default, lazy optimizer state allowed); DCP's default
        # planner for torch, whose flow needs nothing more here.
        planner = DefaultLoadPlanner() if impl_name == "torch" else impl.checkpoint.LoadPlanner()
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=box[0], planner=planner)
        impl.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def _resume(ctx, impl_name, model, opt, timer=None) -> None:
    """Save the model and optimizer as a DCP checkpoint and load it back: through
    hyperdsd.checkpoint, or torch's state-dict functions with plain DCP."""
    import torch.distributed.checkpoint as dcp

    timer = timer or (lambda name: None)
    box = [tempfile.mkdtemp(prefix="bench-resume-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = f"{box[0]}/ckpt"
    timer("start")
    if impl_name == "hyperdsd":
        import hyperdsd.checkpoint

        hyperdsd.checkpoint.save(path, model, opt)
        timer("save")
        hyperdsd.checkpoint.load(path, model, opt)
        timer("load")
    else:
        impl = _impl("torch")
        msd, osd = impl.get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        timer("save")
        msd, osd = impl.get_state_dict(model, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        impl.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        timer("load")
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)


def _clone_all(model, opt) -> None:
    """The per-tensor floor: one ``clone()`` of every local tensor (each
    parameter's shard and its optimizer state values) in a Python loop.

    The local tensor is the one a DTensor wraps, taken as it is: reaching it
    through ``to_local()`` (an autograd function) costs twice its clone and
    would make the floor three times as high."""
    from hyperdsd._compat import local_tensor

    for p in model.parameters():
        local_tensor(p).clone()
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                local_tensor(v).clone()


def profile_resume(
    ctx, size: str, impl: str = "hyperdsd", mesh: str = "4", top: int = 40, dump: str = "", timed: bool = True
):
    """Per-phase wall times (and the GC's, by generation) on every rank of one resume after a warm-up, then
    cProfile's top functions of another on rank 0, by cumulative and by own time (written to ``dump`` too).
    Without ``timed``: one resume, profiled, and its phases."""
    import cProfile
    import io
    import pstats

    model, opt = _build(ctx, size, mesh)
    if timed:
        _resume(ctx, impl, model, opt)  # warm up
    marks: list[tuple[str, float]] = []
    gc_s = [0.0, 0.0, 0.0]
    began = [0.0]

    def timer(name):
        marks.append((name, time.perf_counter()))

    def on_gc(phase, info):
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            gc_s[info["generation"]] += time.perf_counter() - began[0]

    prof = cProfile.Profile()
    dist.barrier()
    gc.callbacks.append(on_gc)
    try:
        if timed:
            _resume(ctx, impl, model, opt, timer)
            gc.callbacks.remove(on_gc)
            dist.barrier()
        if ctx.rank == 0:
            prof.enable()
        _resume(ctx, impl, model, opt, None if timed else timer)
        if ctx.rank == 0:
            prof.disable()
    finally:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
    phases = {b[0]: b[1] - a[1] for a, b in zip(marks, marks[1:])}
    phases.update({f"gc{g}": s for g, s in enumerate(gc_s)})
    out = {"rank": ctx.rank, "phases": phases}
    if ctx.rank == 0:
        if dump:
            prof.dump_stats(dump)
        for order in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(top)
            out[order] = buf.getvalue()
    return out


def _local_state(model, opt) -> torch.Tensor:
    """This rank's shards of every parameter and state tensor, as one flat buffer."""
    return torch.empty(_state_bytes(model, opt), dtype=torch.uint8)


def _floor(ctx, mode: str, model, opt, buf) -> None:
    """The least work any implementation giving hyperdsd's guarantees must do.

    set, flat_set: torch's own op, then one all-reduce of two flags: the
    agreement that makes bad input on one rank raise on all (SPEC OPT-ATOM-4),
    which torch's sharded set does not perform. full_get: every rank's state
    bytes gathered into rank 0 in one gloo call. bcast_set: the same bytes
    scattered from rank 0 in one call. resume: DCP's own save and load of
    the same state dicts (:func:`_dcp_floor`). Other modes: one all-reduce.
    """
    flag = torch.zeros(2, dtype=torch.int32)
    if mode in ("set", "flat_set"):
        _op(ctx, "torch", mode, model, opt, ctx.cache["floor_inputs"])
        dist.all_reduce(flag)
    elif mode == "full_get":
        # On a 2-D mesh one replica's shards make the whole: rank 0's shard group.
        mesh = ctx.cache["mesh"]
        group = dist.group.WORLD if "x" not in mesh or mesh in FSDP1_MESHES else ctx.mesh(mesh).get_group("shard")
        if 0 in dist.get_process_group_ranks(group):
            n = dist.get_world_size(group)
            dist.gather(
                buf, [torch.empty_like(buf) for _ in range(n)] if ctx.rank == 0 else None, group=group, group_dst=0
            )
    elif mode in ("bcast_set", "bcast_both"):
        dist.scatter(buf, [torch.empty_like(buf) for _ in range(ctx.world_size)] if ctx.rank == 0 else None, src=0)
    elif mode == "resume":
        _dcp_floor(ctx, ctx.cache["floor_inputs"])
    else:
        dist.all_reduce(flag)


def _dcp_floor(ctx, state: dict) -> None:
    """DCP's own floor under a resume: plain ``dcp.save`` and ``dcp.load`` (DCP's
    default planners, reader and writer) of the state dicts
    ``hyperdsd.checkpoint`` saves, read beforehand: no state-dict conversion,
    no validation, no commit."""
    import torch.distributed.checkpoint as dcp

    box = [tempfile.mkdtemp(prefix="bench-dcp-floor-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    dcp.save(state, checkpoint_id=box[0])
    dcp.load(state, checkpoint_id=box[0])
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)


def time_mode(ctx, size: str, mode: str, mesh: str, reps: int, budget_s: float = 90.0, torch_too: bool = True):
    """Alternate the two implementations and the floor (on the models of many
    keys, the per-tensor floor too: ``clone``), ``reps`` times each, in a
    rotating order, or fewer once ``budget_s`` is spent (one each at least);
    slowest rank's ms. Without ``torch_too`` torch's op is not run (the floor
    still is, where it is not torch's op)."""
    model, opt = _build(ctx, size, mesh)
    ctx.cache["mesh"] = mesh
    buf = _local_state(model, opt) if mode in ("full_get", "bcast_set", "bcast_both") else None
    contenders = ["torch", "hyperdsd", "floor"] + (["clone"] if size in MANY_KEYS and mesh == "4" else [])
    if not torch_too:
        contenders.remove("torch")
        if mode in ("set", "flat_set"):
            contenders.remove("floor")  # torch's own op
    began = time.perf_counter()
    times: dict[str, list[float]] = {name: [] for name in ("torch", "hyperdsd", "floor", "clone")}
    for r in range(reps):
        spent = torch.tensor([time.perf_counter() - began])
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)  # every rank stops at the same repetition
        if r > 0 and spent.item() > budget_s:
            break
        for name in contenders[r % len(contenders) :] + contenders[: r % len(contenders)]:
            inputs = _floor_inputs(ctx, mode, model, opt) if name == "floor" else _prepare(ctx, name, mode, model, opt)
            ctx.cache["floor_inputs"] = inputs
            dist.barrier()
            with ctx.under_test(name):  # a rank that dies here names who killed it (bench.py reruns without torch)
                start = time.perf_counter()
                got = None
                if name == "floor":
                    _floor(ctx, mode, model, opt, buf)
                elif name == "clone":
                    _clone_all(model, opt)
                else:
                    got = _op(ctx, name, mode, model, opt, inputs)
                elapsed = torch.tensor([time.perf_counter() - start])
                del got  # released untimed: what a get returned is its caller's to drop, later
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item() * 1000)
            del inputs
            ctx.cache.pop("floor_inputs", None)
    return times


def _floor_inputs(ctx, mode: str, model, opt):
    """What the floor takes (not timed): a set's, torch's inputs (its floor is
    torch's op); a resume's, the state dicts ``hyperdsd.checkpoint.save`` saves."""
    if mode == "resume":
        msd, osd = _impl("hyperdsd").get_state_dict(model, opt)
        return {"model": msd, "optim": osd}
    return _prepare(ctx, "torch", mode, model, opt)


def torch_once(ctx, size: str, mode: str, mesh: str) -> bool:
    """One call of torch's op, alone in its task: where it kills a rank
    (torch's full optimizer state dict on FSDP1 can die of SIGSEGV), the
    caller times hyperdsd and the floor without it instead of losing them."""
    model, opt = _build(ctx, size, mesh)
    inputs = _prepare(ctx, "torch", mode, model, opt)
    dist.barrier()
    with ctx.under_test("torch"):
        _op(ctx, "torch", mode, model, opt, inputs)
    return True


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _state_bytes(model, opt) -> int:
    """Bytes of this rank's own model and optimizer state (its shards): on
    FSDP1 the local flat shard (padding included) or, with use_orig_params,
    the views of it that the original parameters are between steps."""
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
    return {
        "rank": ctx.rank,
        "peak_above_base_mib": (peak - base) / 1024,
        "own_state_mib": _state_bytes(model, opt) / 2**20,
    }
