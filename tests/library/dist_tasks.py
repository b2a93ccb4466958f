"""Rank-side functions for hyperdsd's multi-rank tests (run through the harness)."""

from __future__ import annotations

import copy
import inspect
import math
import shutil
import types

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import hyperdsd
from hyperdsd import _compat
from hyperdsd.placement import DTensorLayout
from hyperdsd.transport import collectives
from hyperdsd.transport.gather import Gatherer
from hyperdsd.transport.needs import Need, ShapeDtype
from hyperdsd.transport.scatter import scatter_from_root

SHAPES = [
    ((7, 3), torch.float32),
    ((3,), torch.float32),
    ((2, 5), torch.bfloat16),
    ((1,), torch.int64),
    ((9, 2), torch.bool),
    ((0, 4), torch.float32),
]


# even, uneven (twice: a run of large pieces, uneven among ranks, copied one by one), bf16
BIG = [
    ((2048, 512), torch.float32),
    ((1026, 600), torch.float32),
    ((1026, 600), torch.float32),
    ((4096, 256), torch.bfloat16),
]


def _tensors(mesh, placements, big=False):
    gen = torch.Generator().manual_seed(1)
    out = []
    for shape, dtype in SHAPES + (BIG if big else []):
        full = (torch.rand(shape, generator=gen) * 100).to(dtype)
        out.append((full, distribute_tensor(full, mesh, placements, src_data_rank=None)))
    return out


def gather(ctx, mesh="4", root: bool = False, bucket_bytes: int = 64, big: bool = False):
    m = ctx.mesh(mesh)
    placements = [Shard(0)] if m.ndim == 1 else [Replicate(), Shard(0)]
    pairs = _tensors(m, placements, big)
    g = Gatherer(cpu=True, bucket_bytes=bucket_bytes)
    for i, (_, dt) in enumerate(pairs):
        g.add(i, dt, root=0 if root else None)
    results = g.run()
    if root and ctx.rank != 0:
        assert results == {}, f"rank {ctx.rank} kept {list(results)}"
        return 0
    for i, (full, _) in enumerate(pairs):
        assert results[i].dtype == full.dtype and torch.equal(results[i], full), f"tensor {i} differs"
    storages = [t.untyped_storage().data_ptr() for t in results.values() if t.numel()]
    assert len(set(storages)) == len(storages), "full tensors share storage"
    return len(results)


def scatter(ctx, bucket_bytes: int = 48, big: bool = False, runs: bool = False):
    m = ctx.mesh(str(ctx.world_size))
    fulls = [
        t.to(d)
        for t, d in (
            (torch.arange(70.0).reshape(7, 10), torch.float32),
            (torch.arange(12.0), torch.float64),
            (torch.ones(3), torch.int32),
        )
    ]
    if big:  # large and evenly split: moves on its own, straight into place
        fulls.append(torch.arange(ctx.world_size * 2**18, dtype=torch.float32).reshape(ctx.world_size * 512, 512))
    layouts = [DTensorLayout(m, (Shard(0),), f.shape, f.stride()) for f in fulls]
    needs = [
        Need.of_layout(layouts[0]),
        Need.whole(fulls[1].shape),
        Need.of_layout(layouts[2]) if ctx.rank % 2 else None,
    ]
    if big:
        needs.append(Need.of_layout(layouts[3]))
    if runs:  # runs of elements, uneven, across rows (FSDP1 flat shards): large ones go point to point
        n = ctx.world_size * 2**18 + 3
        fulls += [torch.arange(float(n)), torch.arange(50.0).reshape(5, 10), -torch.arange(float(n)).reshape(-1, 1)]
        cut = [0, 7, n // 3, n // 3, n]  # the third rank needs none of the first large one
        mine = (cut[ctx.rank], cut[ctx.rank + 1]) if ctx.rank + 1 < len(cut) else (0, 0)
        needs += [Need.run(*mine) if mine[1] > mine[0] else None, Need.run(3 * ctx.rank, 3 * ctx.rank + 13)]
        needs.append(Need.run(n // 2 * (ctx.rank % 2), n // 2 * (ctx.rank % 2) + n // 2))  # ranks alike in pairs
    metas = [ShapeDtype(tuple(f.shape), f.dtype) for f in fulls]
    pieces = scatter_from_root(metas, fulls if ctx.rank == 0 else None, needs, torch.device("cpu"), bucket_bytes)
    for i, need in enumerate(needs):
        if need is None:
            assert pieces[i] is None
        else:
            assert torch.equal(pieces[i], need.cut(fulls[i])), f"piece {i} differs on rank {ctx.rank}"
    return True


def scatter_many(ctx, bucket_bytes: int = 1 << 20):
    """Many small tensors of a few shapes and dtypes, interleaved with tensors
    packed alone (large, empty), regions that differ by rank (uneven shards:
    empty pieces), and tensors some ranks do not need: what the root packs a
    group at a time."""
    m = ctx.mesh(str(ctx.world_size))
    kinds = [
        ((4, 4), torch.float32, "shard"),
        ((5,), torch.float32, "shard"),
        ((), torch.int64, "whole"),
        ((3, 2), torch.float64, "odd"),
        ((130, 130), torch.float32, "shard"),
        ((0, 3), torch.float32, "shard"),
    ]
    fulls, needs = [], []
    for i in range(240):
        shape, dtype, how = kinds[i % 5] if i % 37 else kinds[4 + (i // 37) % 2]
        full = (torch.arange(math.prod(shape), dtype=torch.float64) + 1000 * i).reshape(shape).to(dtype)
        fulls.append(full)
        if how == "shard":
            needs.append(Need.of_layout(DTensorLayout(m, (Shard(0),), full.shape, full.stride())))
        elif how == "whole":
            needs.append(Need.whole(shape))
        else:
            needs.append(Need.whole(shape) if ctx.rank % 2 else None)
    metas = [ShapeDtype(tuple(f.shape), f.dtype) for f in fulls]
    pieces = scatter_from_root(metas, fulls if ctx.rank == 0 else None, needs, torch.device("cpu"), bucket_bytes)
    for i, need in enumerate(needs):
        if need is None:
            assert pieces[i] is None, f"rank {ctx.rank} got tensor {i}, which it does not need"
        else:
            assert pieces[i].dtype == fulls[i].dtype and torch.equal(pieces[i], need.cut(fulls[i])), (
                f"piece {i} differs on rank {ctx.rank}"
            )
    return len(fulls)


def agree(ctx, bad_rank: int = 1):
    problems = [f"bad value on rank {ctx.rank}"] if ctx.rank == bad_rank else []
    try:
        collectives.agree(problems, "test")
    except hyperdsd.StateDictError as exc:
        assert f"rank {bad_rank}" in str(exc) and "bad value" in str(exc), str(exc)
        return "raised"
    return "passed"


# -- interop with torch's implementation -------------------------------------


def _setup(ctx, layout, seed, impl, opt="adamw"):
    from conformance.adapters import load_adapter
    from conformance.running.case_context import CaseContext
    from conformance.world.models import ModelConfig
    from conformance.world.setup import Setup

    c = CaseContext(ctx, None, 0, load_adapter(impl), "")
    # Every parameter trains (no lazy, frozen or tied ones): torch's loader is correct there.
    return Setup(
        c,
        layout,
        opt,
        seed=seed,
        cfg=ModelConfig(tie=False),
        trainable=lambda f: not f.startswith(("aux", "frozen")),
    )


def _state(setup):
    from conformance.judging.oracle import snapshot

    return snapshot(setup)


def interop(ctx, layout: str, writer: str, reader: str, mode: str):
    """State written by one implementation, read by the other, resumes exactly."""
    import torch.distributed.checkpoint as dcp

    from conformance.adapters import load_adapter
    from conformance.judging.oracle import diff_snapshots

    w, r = load_adapter(writer), load_adapter(reader)
    flat = mode in ("flat", "flat_dcp")
    a = _setup(ctx, layout, 0, writer)
    a.train(1)
    opts_w = w.options(flatten_optimizer_state_dict=flat)
    osd = (
        copy.deepcopy(w.get_optimizer_state_dict(a.model, a.optimizers[0], options=opts_w))
        if "dcp" not in mode
        else None
    )
    msd = w.get_model_state_dict(a.model)
    path = None
    if "dcp" in mode:
        path = ctx.cache.setdefault("dir", None)
        box = [__import__("tempfile").mkdtemp() if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
        dcp.save(
            {"model": msd, "optim": w.get_optimizer_state_dict(a.model, a.optimizers[0], options=opts_w)},
            checkpoint_id=path,
        )
    else:
        msd = copy.deepcopy(msd)
    a.train(1)
    b = _setup(ctx, layout, 1, reader)
    b.set_steps_done(1)
    opts_r = r.options(flatten_optimizer_state_dict=flat)
    if path is not None:
        from torch.distributed.checkpoint import DefaultLoadPlanner

        tmpl_m = r.get_model_state_dict(b.model)
        dcp.load({"model": tmpl_m}, checkpoint_id=path)
        tmpl_o = r.get_optimizer_state_dict(b.model, b.optimizers[0], options=opts_r)
        dcp.load({"optim": tmpl_o}, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        msd, osd = tmpl_m, tmpl_o
    r.set_model_state_dict(b.model, msd)
    r.set_optimizer_state_dict(b.model, b.optimizers[0], osd, options=opts_r)
    b.train(1)
    diffs = diff_snapshots(_state(a), _state(b))
    assert not diffs, "\n".join(diffs[:10])
    return True


def combined_broadcast(ctx):
    """set_state_dict with broadcast_from_rank0: ranks other than 0 pass empty dicts."""
    from conformance.judging.oracle import diff_snapshots, snapshot

    a = _setup(ctx, "fsdp2", 0, "hyperdsd")
    a.train(1)
    opts = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = hyperdsd.get_state_dict(a.model, a.optimizers[0], options=opts)
    b = _setup(ctx, "fsdp2", 1, "hyperdsd")
    b.set_steps_done(1)
    hyperdsd.set_state_dict(
        b.model,
        b.optimizers[0],
        model_state_dict=msd,
        optim_state_dict=osd,
        options=hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    a.train(1)
    b.train(1)
    diffs = diff_snapshots(snapshot(a), snapshot(b))
    assert not diffs, "\n".join(diffs[:10])
    return True


def group_rule(ctx):
    """The group of a model's collectives: the world unless its meshes were built over part of it."""
    from torch.distributed.device_mesh import DeviceMesh

    from hyperdsd.transport import group

    def on(mesh):
        return [distribute_tensor(torch.ones(4), mesh, [Replicate()] * mesh.ndim, src_data_rank=None)]

    world_2d = ctx.mesh("2x2")
    halves = [DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])]
    columns = [DeviceMesh("cpu", [[0], [1]]), DeviceMesh("cpu", [[2], [3]])]  # 2-D meshes over a half: no 1-D group
    mine = ctx.rank // 2
    assert group.of_params(on(world_2d["shard"])) == group.world()  # a slice of a world mesh is the world's
    half = group.of_params(on(halves[mine]))
    assert half.ranks == (2 * mine, 2 * mine + 1) and half.root == 2 * mine and half.pg is halves[mine].get_group()
    made = group.of_params(on(columns[mine]))
    assert made.ranks == half.ranks and group.of_params(on(columns[mine])).pg is made.pg  # made once, then kept
    # Collectives stay inside the half: each half agrees and gathers on its own.
    assert collectives.exchange(ctx.rank, made) == list(half.ranks)
    assert collectives.broadcast_object(f"from {ctx.rank}", half) == f"from {half.root}"
    return collectives.send_to_root(ctx.rank, half)


class _WithExtraState(torch.nn.Linear):
    def get_extra_state(self):
        return torch.tensor([3.0])

    def set_extra_state(self, state):
        pass


def read_unsharded(ctx, extra_state: bool = False):
    """Get on an FSDP2 model left unsharded by its forward (no reshard after
    forward): get gives the sharded parameters under state_dict()'s keys and
    leaves the modules unsharded, as it found them; also where a module's
    extra state sends the read through ``model.state_dict()``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    first = _WithExtraState if extra_state else torch.nn.Linear
    model = torch.nn.Sequential(*[torch.nn.Sequential(first(4, 6), torch.nn.Linear(6, 4)) for _ in range(3)])
    mesh = ctx.mesh(str(ctx.world_size))
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model(torch.randn(2, 4))
    registered = [p for m in model.modules() for p in m._parameters.values()]
    assert not any(isinstance(p, DTensor) for p in registered), "the forward left it sharded"
    got = hyperdsd.get_model_state_dict(model)
    assert [p for m in model.modules() for p in m._parameters.values()] == registered, "get resharded the model"
    expected = model.state_dict()  # FSDP2's pre-hook reshards
    assert list(got) == list(expected)
    for key, value in got.items():
        if key.endswith("_extra_state"):
            assert torch.equal(value, expected[key]), key
            continue
        assert isinstance(value, DTensor) and value.placements == expected[key].placements, key
        assert value._local_tensor.data_ptr() == expected[key]._local_tensor.data_ptr(), key
    return len(got)


def _loop_model(ctx, seed: int, reshard_after_forward):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 4)) for _ in range(3)])
    mesh = ctx.mesh(str(ctx.world_size))
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))


def _loop_steps(model, optimizer, start: int, steps: int):
    for i in range(start, start + steps):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(100 * i + 7)) + dist.get_rank()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full_values(model, optimizer):
    out = [v.full_tensor() for v in model.state_dict().values()]
    for p in optimizer.param_groups[0]["params"]:
        out += [v.full_tensor() if isinstance(v, DTensor) else v for _, v in sorted(optimizer.state[p].items())]
    return out


def loop_resume(ctx, mode: str, reshard_after_forward=False):
    """A get after an evaluation forward that left the parameters unsharded,
    in ``mode``; a set into a fresh model; the next steps equal the run that
    was never interrupted. The get leaves the source's modules unsharded."""
    import torch.distributed.checkpoint as dcp

    from hyperdsd import StateDictOptions

    get = {
        "sharded": {},
        "full": {"full_state_dict": True},
        "full_cpu": {"full_state_dict": True, "cpu_offload": True},
        "flat": {"flatten_optimizer_state_dict": True},
        "dcp": {},
    }[mode]
    put = {"full_cpu": {"full_state_dict": True, "broadcast_from_rank0": True}}.get(mode, get)
    source, source_opt = _loop_model(ctx, 0, reshard_after_forward)
    _loop_steps(source, source_opt, 0, 2)
    source.eval()
    with torch.no_grad():
        source(torch.ones(2, 4))
    source.train()
    registered = [p for m in source.modules() for p in m._parameters.values()]
    assert not any(isinstance(p, DTensor) for p in registered), "the forward left it sharded"
    msd, osd = hyperdsd.get_state_dict(source, source_opt, options=StateDictOptions(**get))
    assert [p for m in source.modules() for p in m._parameters.values()] == registered, "get resharded the model"
    if mode == "dcp":
        box = [__import__("tempfile").mkdtemp() if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        path = box[0]
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    target, target_opt = _loop_model(ctx, 1, reshard_after_forward)
    _loop_steps(target, target_opt, 50, 1)  # a stepped target: its own state must go
    if mode == "dcp":
        msd, osd = hyperdsd.get_state_dict(target, target_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    hyperdsd.set_state_dict(
        target, target_opt, model_state_dict=msd, optim_state_dict=osd, options=StateDictOptions(**put)
    )
    _loop_steps(source, source_opt, 2, 2)
    _loop_steps(target, target_opt, 2, 2)
    for i, (a, b) in enumerate(zip(_full_values(source, source_opt), _full_values(target, target_opt), strict=True)):
        assert torch.equal(a, b), f"value {i} differs after resuming"
    return True


def compat_distribute_locally(ctx, mesh: str, native: bool, suite: bool):
    """hyperdsd's (or the suite's) distribute_locally, with torch's src_data_rank=None or, as on torch 2.6,
    without it: each rank cuts its piece from its own full tensor, which differs on every rank."""
    if suite:
        from conformance import _compat
    else:
        from hyperdsd._compat import tensors as _compat  # where distribute_locally reads the flag
    m = ctx.mesh(mesh)
    placements = [Shard(0)] if m.ndim == 1 else [Replicate(), Shard(1)]
    full = torch.arange(24.0).reshape(6, 4) + 100 * ctx.rank
    saved = _compat._HAS_SRC_DATA_RANK
    _compat._HAS_SRC_DATA_RANK = native
    try:
        got = _compat.distribute_locally(full, m, placements)
    finally:
        _compat._HAS_SRC_DATA_RANK = saved
    want = distribute_tensor(full, m, placements, src_data_rank=None)
    assert got.placements == want.placements and torch.equal(got.to_local(), want.to_local()), ctx.rank
    return got.to_local().sum().item()


def compat_post_forward_meshes(ctx):
    """Shard three small models with ``reshard_after_forward=2`` (FSDP2 builds a 2 x 2 post-forward mesh
    for each unit) and run a step of each; returns how many process groups this rank is in afterwards."""
    from torch.distributed.fsdp import fully_shard

    from conformance import _compat

    _compat.shared_post_forward_meshes()
    mesh = ctx.mesh("4")
    meshes, models = set(), []  # the models kept, so that no mesh's id is reused
    for _ in range(3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
        for unit in (model[0], model[1], model):
            fully_shard(unit, mesh=mesh, reshard_after_forward=2)
        meshes.update(id(group.post_forward_mesh_info.mesh) for group in fully_shard.state(model[0])._fsdp_param_groups)
        model(torch.ones(2, 8)).sum().backward()
        models.append(model)
    assert len(meshes) == 1, meshes
    # Every group this rank is in, equal rank sets apart (torch's registry, read only).
    return sum(ctx.rank in ranks for ranks in dist.distributed_c10d._world.pg_group_ranks.values())


def compat_fsdp2_on_cpu(ctx):
    """The suite's FSDP2-on-CPU shim for torch 2.6 and 2.7, given a stream stub like 2.6's and a factor function
    with 2.6's signature (what it replaces exists only there); everything is put back before returning."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    from conformance import _compat

    class Stub:  # torch 2.6's torch.cpu.Stream
        def wait_stream(self, stream):
            pass

    seen = []
    saved = torch.cpu.Stream, collectives._get_gradient_divide_factors
    torch.cpu.Stream = Stub
    collectives._get_gradient_divide_factors = lambda rs, ar, dtype: seen.append(str(dtype)) or (None, None)
    try:
        _compat.fsdp2_on_cpu()
        stream = torch.cpu.Stream()
        event = stream.record_event()
        event.wait()
        stream.wait_event(event)
        world = dist.group.WORLD
        collectives._get_gradient_divide_factors(world, world, torch.float32)
        collectives._get_gradient_divide_factors(world, None, torch.bfloat16)
    finally:
        torch.cpu.Stream, collectives._get_gradient_divide_factors = saved
    return seen


def compat_pipeline_schedule(ctx, torch_26: bool, shim: bool = True):
    """Two stages of a float64 model trained one GPipe step (2 microbatches) on ranks 0 and 1, the schedule
    built by the suite's shim (``shim``; else as torch 2.6's is, with the loss as it is), from ScheduleGPipe
    or (``torch_26``) a schedule like torch 2.6's (no ``scale_grads``: gradients summed over microbatches).
    Returns this rank's gradients divided by those of the whole model stepped on the whole batch."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from conformance import _compat

    class Torch26GPipe(ScheduleGPipe):
        def __init__(self, stage, n_microbatches, loss_fn=None):
            super().__init__(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)

    if "scale_grads" not in inspect.signature(ScheduleGPipe).parameters:
        Torch26GPipe = ScheduleGPipe  # noqa: N806 - this torch's is one

    torch.manual_seed(0)
    whole = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    inputs, targets = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    loss_fn = torch.nn.functional.mse_loss
    part = copy.deepcopy(whole[:2] if ctx.rank == 0 else whole[2:])
    loss_fn(whole(inputs), targets).backward()
    expected = [p.grad for p in (whole[:2] if ctx.rank == 0 else whole[2:]).parameters()]

    _compat.gloo_safe_pipeline_start()
    stage = PipelineStage(part, ctx.rank, 2, device=torch.device("cpu"), group=dist.group.WORLD)
    cls = Torch26GPipe if torch_26 else ScheduleGPipe
    schedule = _compat.pipeline_schedule(cls, stage, 2, loss_fn) if shim else cls(stage, 2, loss_fn=loss_fn)
    if ctx.rank == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=[])
    return torch.cat([(p.grad / want).flatten() for p, want in zip(part.parameters(), expected)]).tolist()


def compat_root_mesh(ctx):
    """The root of a slice of a 2-D mesh, and of the root itself."""
    from hyperdsd import _compat

    world = ctx.mesh("2x2")
    return _compat.root_mesh(world[world.mesh_dim_names[1]]) is world and _compat.root_mesh(world) is world


def _load_saved_template(ctx, opt: str, fqn: str, key: str, writer: int | None, broadcast: bool):
    """A never-stepped ``opt`` optimizer's get (full on rank 0 when ``broadcast``), copied, with ones
    written into ``state[fqn][key]`` on rank ``writer``'s part, set into a target that stepped once;
    returns the target."""
    a = _setup(ctx, "fsdp2", 0, "hyperdsd", opt)  # never stepped
    full = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    osd = copy.deepcopy(
        hyperdsd.get_optimizer_state_dict(a.model, a.optimizers[0], options=full if broadcast else None)
    )
    if writer is not None and ctx.rank == writer:
        held = osd["state"][fqn][key]
        (held._local_tensor if isinstance(held, DTensor) else held).fill_(1.0)
    b = _setup(ctx, "fsdp2", 1, "hyperdsd", opt)
    b.train(1)
    opts = hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) if broadcast else None
    hyperdsd.set_optimizer_state_dict(b.model, b.optimizers[0], osd, options=opts)
    return b


def step0_agreement(ctx, writer: int | None, broadcast: bool):
    """A saved never-stepped template loaded into a stepped target: no state
    is left, unless one rank's part of an entry holds real values (``writer``
    writes ones into its shard, or rank 0 into the full value): then every
    rank loads that entry."""
    fqn = "layers.0.fc1.weight"
    b = _load_saved_template(ctx, "adamw", fqn, "exp_avg", writer, broadcast)
    params = dict(b.model.named_parameters())
    state = b.optimizers[0].state
    kept = fqn in {f for f, p in params.items() if p in state}
    others = sorted(f for f, p in params.items() if p in state and f != fqn)
    if kept:
        local = state[params[fqn]]["exp_avg"]
        local = local._local_tensor if isinstance(local, DTensor) else local
        assert float(state[params[fqn]]["step"]) == 0.0
        assert bool((local == (1.0 if writer == ctx.rank or broadcast else 0.0)).all()), local
    return kept, others


def stepless_agreement(ctx, writer: int | None, broadcast: bool):
    """A saved never-stepped SGD template (zero momentum buffers, no step)
    loaded into a stepped target: no state is left, unless one rank's part of
    one buffer holds real values (``writer`` writes ones into its shard, or
    rank 0 into the full value): then every entry loads, on every rank (the
    optimizer's buffers are judged together). Returns the FQNs with state."""
    fqn = "layers.0.fc1.weight"
    b = _load_saved_template(ctx, "sgd", fqn, "momentum_buffer", writer, broadcast)
    params = dict(b.model.named_parameters())
    state = b.optimizers[0].state
    for f, p in params.items():
        if p in state:
            local = state[p]["momentum_buffer"]
            local = local._local_tensor if isinstance(local, DTensor) else local
            one = f == fqn and (writer == ctx.rank or broadcast)
            assert bool((local == (1.0 if one else 0.0)).all()), (f, local)
    return sorted(f for f, p in params.items() if p in state)


def other_placements(ctx, warm: bool):
    """State whose DTensors are laid out otherwise than the parameters
    (replicated, not sharded) loads, redistributed to the parameters'
    placements, into a trained optimizer (copied in place) or a fresh one."""
    from conformance.judging.oracle import diff_snapshots, snapshot

    def replicated(v):
        return v.redistribute(v.device_mesh, [Replicate()] * v.device_mesh.ndim) if isinstance(v, DTensor) else v

    a = _setup(ctx, "fsdp2", 0, "hyperdsd")
    a.train(1)
    msd, osd = hyperdsd.get_state_dict(a.model, a.optimizers[0])
    msd = {k: replicated(v) for k, v in msd.items()}
    osd = {**osd, "state": {f: {k: replicated(v) for k, v in e.items()} for f, e in osd["state"].items()}}
    assert any(isinstance(v, DTensor) for e in osd["state"].values() for v in e.values())
    b = _setup(ctx, "fsdp2", 1, "hyperdsd")
    if warm:
        b.train(1)
    else:
        b.set_steps_done(1)
    hyperdsd.set_state_dict(b.model, b.optimizers[0], model_state_dict=msd, optim_state_dict=osd)
    opt = b.optimizers[0]
    for p, entry in opt.state.items():
        for k, v in entry.items():
            if isinstance(v, DTensor):
                assert tuple(v.placements) == tuple(p.placements), (k, v.placements, p.placements)
                assert v.to_local().shape == p.to_local().shape, k
    a.train(1)
    b.train(1)
    diffs = diff_snapshots(snapshot(a), snapshot(b))
    assert not diffs, "\n".join(diffs[:10])
    return True


def post_hook_load(ctx, broadcast: bool):
    """A set into an FSDP2 model with a load post-hook of the user's on one
    module: the whole load goes through one load_state_dict, so the hook runs
    once and sees no key missing; the model ends with the values set (a get's
    own dict set back, or a broadcast from rank 0's full dict)."""
    model, _ = _loop_model(ctx, seed=0, reshard_after_forward=True)
    seen = []
    model[1][0].register_load_state_dict_post_hook(
        lambda module, keys: seen.append((list(keys.missing_keys), list(keys.unexpected_keys)))
    )
    if broadcast:
        source, _ = _loop_model(ctx, seed=1, reshard_after_forward=True)
        opts = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = hyperdsd.get_model_state_dict(source, options=opts)
        expected = [v.full_tensor() for v in source.state_dict().values()]
        opts = hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        hyperdsd.set_model_state_dict(model, full if dist.get_rank() == 0 else {}, options=opts)
    else:
        sd = hyperdsd.get_model_state_dict(model)
        sd["0.0.weight"] = sd["0.0.weight"] + 1  # (one fresh value, the rest the model's own tensors)
        expected = [v.full_tensor() for v in sd.values()]
        hyperdsd.set_model_state_dict(model, sd)
    assert seen == [([], [])], seen
    got = [v.full_tensor() for v in model.state_dict().values()]
    assert len(got) == len(expected) and all(map(torch.equal, got, expected))
    return True


def garbage_left(ctx, fsdp: int = 2):
    """What each call leaves for the cyclic collector: by call, the kinds of
    objects it finds unreachable after the call, and those of them hyperdsd
    made (none expected; where torch.save runs, a checkpoint's calls, only
    the latter: torch makes a pickler class per call). A call that leaves
    cycles holds what they reach (a broadcast root's full tensors, every
    rank's stand-ins) until the collector's next pass, and that pass walks
    every object the call made."""
    import gc
    import tempfile

    import hyperdsd.checkpoint

    def made_here(o) -> bool:
        owner = o if isinstance(o, (type, types.FunctionType)) else type(o)
        return getattr(owner, "__module__", "").startswith("hyperdsd")

    def kind(o) -> str:  # (a class by its module and name: torch's pickler classes say where they come from)
        return f"{o.__module__}.{o.__qualname__}" if type(o) is type else type(o).__qualname__

    box = [tempfile.mkdtemp(prefix="hyperdsd-garbage-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = f"{box[0]}/checkpoint"
    if fsdp == 1:
        import fsdp1_tasks

        model, optimizer = fsdp1_tasks._fsdp1(ctx, 0, uop=True)
        fsdp1_tasks._steps(model, optimizer, 0, 1)
    else:
        model, optimizer = _loop_model(ctx, seed=0, reshard_after_forward=True)
        _loop_steps(model, optimizer, 0, 1)
    full = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    broadcast = hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    flat = hyperdsd.StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = hyperdsd.get_state_dict(model, optimizer, options=full)
    if dist.get_rank() != 0:
        msd, osd = {}, {}

    def set_own():
        own_msd, own_osd = hyperdsd.get_state_dict(model, optimizer)
        hyperdsd.set_state_dict(model, optimizer, model_state_dict=own_msd, optim_state_dict=own_osd)

    calls = {
        "get": lambda: hyperdsd.get_state_dict(model, optimizer),
        "full get": lambda: hyperdsd.get_state_dict(model, optimizer, options=full),
        "flat get": lambda: hyperdsd.get_state_dict(model, optimizer, options=flat),
        "set": set_own,
        "broadcast set": lambda: hyperdsd.set_state_dict(
            model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=broadcast
        ),
        "broadcast model set": lambda: hyperdsd.set_model_state_dict(model, msd, options=broadcast),
        "broadcast optimizer set": lambda: hyperdsd.set_optimizer_state_dict(model, optimizer, osd, options=broadcast),
        "checkpoint save": lambda: hyperdsd.checkpoint.save(path, model, optimizer),
        "checkpoint load": lambda: hyperdsd.checkpoint.load(path, model, optimizer),
    }
    left = {}
    gc.collect()
    for name, call in calls.items():
        gc.disable()
        try:
            call()
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            left[name] = (sorted(set(map(kind, gc.garbage))), sorted({kind(o) for o in gc.garbage if made_here(o)}))
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.collect()  # (what was saved, unreachable again: not charged to the next call)
            gc.enable()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    return left


def wrap_as_from_local(ctx):
    """DTensorLayout.wrap makes what DTensor.from_local makes (run_check off,
    global shape and stride given), on uneven shards, replicated, of several
    dtypes, requiring grad or not: type, mesh, placements, shape, stride,
    dtype, requires_grad, the local's memory, its full tensor, and ops on it."""
    mesh = ctx.mesh(str(ctx.world_size))
    checked = 0
    for full in (
        torch.arange(15.0).view(5, 3),
        torch.arange(6, dtype=torch.int64),
        torch.ones(3, 2, dtype=torch.bfloat16),
    ):
        for placements in ((Shard(0),), (Replicate(),)):
            reference = distribute_tensor(full, mesh, placements)
            layout = DTensorLayout.of(reference)
            for grad in (False, True) if full.is_floating_point() else (False,):
                local = reference.to_local().clone().requires_grad_(grad)
                made, expected = (
                    layout.wrap(local),
                    DTensor.from_local(
                        local, mesh, placements, run_check=False, shape=layout.shape, stride=layout.stride
                    ),
                )
                assert type(made) is DTensor and made.device_mesh == expected.device_mesh
                assert made.placements == expected.placements and made.shape == expected.shape
                assert made.stride() == expected.stride() and made.dtype == expected.dtype == full.dtype
                assert made.requires_grad == expected.requires_grad == grad
                assert made.to_local().data_ptr() == local.data_ptr()
                assert torch.equal(made.full_tensor().detach(), full)
                assert torch.equal((made.detach() * 2).full_tensor(), full * 2)
                assert made._spec == expected._spec
                with torch.no_grad():  # (as every call runs: nothing made then requires grad)
                    assert not layout.wrap(local).requires_grad
                    assert not DTensor.from_local(
                        local, mesh, placements, run_check=False, shape=layout.shape, stride=layout.stride
                    ).requires_grad
                # and a parameter of it, as nn.Parameter makes one
                for wanted in (False, True) if full.is_floating_point() else (False,):
                    param, reference_param = _compat.as_parameter(made, wanted), torch.nn.Parameter(made, wanted)
                    assert isinstance(param, torch.nn.Parameter) and type(param) is type(reference_param) is DTensor
                    assert param.requires_grad == reference_param.requires_grad == wanted
                    assert param.is_leaf and param.grad_fn is None and param._spec == made._spec
                    assert param.to_local().data_ptr() == local.data_ptr()
                checked += 1
    plain = _compat.as_parameter(torch.ones(2), True)
    assert type(plain) is torch.nn.Parameter and plain.requires_grad
    return checked
