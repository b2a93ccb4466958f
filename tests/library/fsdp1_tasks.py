"""Rank-side functions for hyperdsd on FSDP1 models (tests/library/test_fsdp1.py)."""

from __future__ import annotations

import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import hyperdsd
from hyperdsd import StateDictError, StateDictOptions

CPU = torch.device("cpu")

GET = {
    "sharded": {},
    "full": {"full_state_dict": True},
    "full_cpu": {"full_state_dict": True, "cpu_offload": True},
    "flat": {"flatten_optimizer_state_dict": True},
    "dcp": {},
}
PUT = {"full_cpu": {"full_state_dict": True, "broadcast_from_rank0": True}}


def _build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(3, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 2))
    )


def _deep(seed: int) -> nn.Module:
    """Like :func:`_build`, with many small layers: no one tensor is a large part of a rank's share."""
    torch.manual_seed(seed)
    inner = [m for _ in range(6) for m in (nn.Linear(12, 12), nn.ReLU())]
    return nn.Sequential(nn.Linear(3, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Sequential(*inner, nn.Linear(12, 2)))


def _fsdp1(ctx, seed: int, uop: bool, strategy: str = "FULL_SHARD", mesh: str | None = None, build=_build):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    kwargs = {"device_id": CPU, "use_orig_params": uop, "sharding_strategy": ShardingStrategy[strategy]}
    if mesh is not None:
        kwargs["device_mesh"] = ctx.mesh(mesh)
    model = build(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model[3] = FSDP(model[3], **kwargs)
        model = FSDP(model, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1), weight_decay=0.1)


def _fsdp2(ctx, seed: int, build=_build):
    from torch.distributed.fsdp import fully_shard

    model = build(seed)
    mesh = ctx.mesh(str(ctx.world_size))
    fully_shard(model[3], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1), weight_decay=0.1)


def _steps(model, optimizer, start: int, steps: int) -> None:
    for i in range(start, start + steps):  # the same batch on every rank: the mean gradient is one rank's
        x = torch.randn(6, 3, generator=torch.Generator().manual_seed(100 * i + 7))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model, optimizer) -> tuple[dict, dict]:
    return hyperdsd.get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def _assert_same(a: tuple[dict, dict], b: tuple[dict, dict], exact: bool = True, ordered: bool = True) -> None:
    (ma, oa), (mb, ob) = a, b
    order = list if ordered else sorted
    assert order(ma) == order(mb), (list(ma), list(mb))
    assert list(oa["state"]) == list(ob["state"]), (list(oa["state"]), list(ob["state"]))
    pairs = [(k, ma[k], mb[k]) for k in ma]
    pairs += [(f"{f}/{k}", v, ob["state"][f][k]) for f, e in oa["state"].items() for k, v in e.items()]
    for name, x, y in pairs:
        if exact:
            assert torch.equal(x, y), f"{name} differs"
        else:
            assert torch.allclose(x.float(), y.float(), atol=1e-5, rtol=1e-5), f"{name} differs"
    assert [g["params"] for g in oa["param_groups"]] == [g["params"] for g in ob["param_groups"]]


def _snapshot(model, optimizer) -> list:
    """Everything a get must leave as it was: parameters, gradients, optimizer state and groups."""
    out = [p.detach().clone() for p in model.parameters()]
    out += [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for p, entry in optimizer.state.items():
        out += [v.clone() if isinstance(v, torch.Tensor) else v for v in entry.values()]
    out += [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return out


def _equal(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _shared_path(ctx) -> str:
    box = [tempfile.mkdtemp() if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sharded_get(ctx, uop: bool):
    """FQN keys as the single-process model has them, DTensor values sharded by
    rows, optimizer state per original parameter equal to the reference's."""
    ref, ref_opt = _build(0), None
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    model, optimizer = _fsdp1(ctx, 0, uop)
    _steps(ref, ref_opt, 0, 2)
    _steps(model, optimizer, 0, 2)
    msd, osd = hyperdsd.get_state_dict(model, optimizer)
    rmsd, rosd = hyperdsd.get_state_dict(ref, ref_opt)
    assert list(msd) == list(rmsd), (list(msd), list(rmsd))
    assert list(osd["state"]) == list(rosd["state"]), list(osd["state"])
    assert [g["params"] for g in osd["param_groups"]] == [g["params"] for g in rosd["param_groups"]]
    for fqn, value in msd.items():
        if isinstance(rmsd[fqn], nn.Parameter) or fqn.endswith(("weight", "bias")):
            assert isinstance(value, DTensor) and value.placements[0].is_shard(0), (fqn, type(value))
            rows = value.to_local().shape[0]
            assert rows == -(-value.shape[0] // 2) or ctx.rank == 1, (fqn, rows)
        full = value.full_tensor() if isinstance(value, DTensor) else value
        assert torch.allclose(full, rmsd[fqn], atol=1e-6), fqn
    for fqn, entry in rosd["state"].items():
        assert list(osd["state"][fqn]) == list(entry), (fqn, list(osd["state"][fqn]))
        for key, value in entry.items():
            got = osd["state"][fqn][key]
            if key != "step":
                assert isinstance(got, DTensor) and got.shape == value.shape, (fqn, key)
                got = got.full_tensor()
            assert torch.allclose(got, value, atol=1e-6), (fqn, key)
    full = _full(model, optimizer)
    _assert_same(full, (rmsd, rosd), exact=False)
    return sorted(msd)


def bad_input(ctx, uop: bool, what: str):
    """An unknown FQN raises StateDictError on every rank and changes nothing."""
    source, source_opt = _fsdp1(ctx, 0, uop)
    _steps(source, source_opt, 0, 1)
    msd, osd = hyperdsd.get_state_dict(source, source_opt)
    target, target_opt = _fsdp1(ctx, 1, uop)
    _steps(target, target_opt, 50, 1)
    if what == "model":
        msd["3.9.weight"] = msd["0.weight"]
    elif what == "optim":
        osd["state"]["3.9.weight"] = osd["state"]["0.weight"]
    else:  # a shape another model has
        osd["state"]["0.weight"] = {**osd["state"]["0.weight"], "exp_avg": torch.zeros(2, 2)}
    before = _snapshot(target, target_opt)
    try:
        hyperdsd.set_state_dict(target, target_opt, model_state_dict=msd, optim_state_dict=osd)
    except StateDictError as exc:
        message = str(exc)
    else:
        return "loaded"
    assert _equal(before, _snapshot(target, target_opt)), "a refused set changed the target"
    return "3.9.weight" in message if what != "shape" else "0.weight" in message


def never_stepped(ctx, uop: bool):
    """A never-stepped FSDP1 optimizer gives placeholder state keyed by FQN,
    which a DCP load fills; set into it resumes exactly, and a fresh source
    loads as fresh (no state)."""
    fresh, fresh_opt = _fsdp1(ctx, 0, uop)
    _, osd = hyperdsd.get_state_dict(fresh, fresh_opt)
    assert sorted(osd["state"]) == sorted(k for k in KEYS_PARAMS), sorted(osd["state"])
    assert not fresh_opt.state, "the get stepped the optimizer"
    source, source_opt = _fsdp1(ctx, 2, uop)
    _steps(source, source_opt, 0, 2)
    path = _shared_path(ctx)
    msd, osd = hyperdsd.get_state_dict(source, source_opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    msd, osd = hyperdsd.get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    hyperdsd.set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    _steps(source, source_opt, 2, 2)
    _steps(fresh, fresh_opt, 2, 2)
    _assert_same(_full(source, source_opt), _full(fresh, fresh_opt))
    # a checkpoint taken before the first step loads as no state
    blank, blank_opt = _fsdp1(ctx, 3, uop)
    msd, osd = hyperdsd.get_state_dict(blank, blank_opt)
    hyperdsd.set_optimizer_state_dict(source, source_opt, osd)
    return len(source_opt.state)


KEYS_PARAMS = ["0.weight", "0.bias", "1.weight", "1.bias", "3.0.weight", "3.0.bias", "3.2.weight", "3.2.bias"]


def loop_point(ctx, uop: bool):
    """After an evaluation forward (SHARD_GRAD_OP keeps the unsharded copy it
    gathered, and its next forward reuses it), a get returns what a get right
    after the step does, and a set there resumes exactly: it frees the copy."""
    source, source_opt = _fsdp1(ctx, 0, uop, "SHARD_GRAD_OP")
    _steps(source, source_opt, 0, 2)
    after_step = _full(source, source_opt)
    target, target_opt = _fsdp1(ctx, 1, uop, "SHARD_GRAD_OP")
    _steps(target, target_opt, 50, 1)
    for model in (source, target):
        model.eval()
        with torch.no_grad():
            model(torch.ones(2, 3))
        model.train()
    _assert_same(after_step, _full(source, source_opt))
    msd, osd = hyperdsd.get_state_dict(source, source_opt)
    hyperdsd.set_state_dict(target, target_opt, model_state_dict=msd, optim_state_dict=osd)
    _steps(source, source_opt, 2, 2)
    _steps(target, target_opt, 2, 2)
    _assert_same(_full(source, source_opt), _full(target, target_opt))
    return True


def torch_interop(ctx, writer: str, uop: bool):
    """A DCP checkpoint of an FSDP1 model written by torch's own functions
    (ShardedTensor values) loads through hyperdsd, and the other way round;
    either way training goes on as the writer's uninterrupted run."""
    from torch.distributed.checkpoint import state_dict as torch_sd

    impl = {"torch": torch_sd, "hyperdsd": hyperdsd}
    reader = "hyperdsd" if writer == "torch" else "torch"
    source, source_opt = _fsdp1(ctx, 0, uop)
    _steps(source, source_opt, 0, 2)
    path = _shared_path(ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = impl[writer].get_state_dict(source, source_opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        target, target_opt = _fsdp1(ctx, 1, uop)
        _steps(target, target_opt, 50, 1)
        msd, osd = impl[reader].get_state_dict(target, target_opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        impl[reader].set_state_dict(target, target_opt, model_state_dict=msd, optim_state_dict=osd)
    _steps(source, source_opt, 2, 2)
    _steps(target, target_opt, 2, 2)
    _assert_same(_full(source, source_opt), _full(target, target_opt))
    return True


def _tied(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 3))
    model[2].weight = model[0].weight
    return model


def tied(ctx, uop: bool):
    """Tied parameters in one FSDP1 unit: the model state lists both names and
    the optimizer state the first, as the single-process model's; a set
    resumes exactly."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def make(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FSDP(_tied(seed), device_id=CPU, use_orig_params=uop)
        return model, torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))

    def steps(model, optimizer, start, n):
        for i in range(start, start + n):
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    ref = _tied(0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    source, source_opt = make(0)
    steps(ref, ref_opt, 0, 2)
    steps(source, source_opt, 0, 2)
    want = hyperdsd.get_state_dict(ref, ref_opt)
    # (a tied name comes after its module's other parameters: FSDP1 keeps no record of their order)
    _assert_same(_full(source, source_opt), want, exact=False, ordered=False)
    msd, osd = hyperdsd.get_state_dict(source, source_opt)
    target, target_opt = make(1)
    steps(target, target_opt, 50, 1)
    hyperdsd.set_state_dict(target, target_opt, model_state_dict=msd, optim_state_dict=osd)
    steps(source, source_opt, 2, 2)
    steps(target, target_opt, 2, 2)
    _assert_same(_full(source, source_opt), _full(target, target_opt))
    return sorted(msd), sorted(osd["state"])


def adagrad_resume(ctx, uop: bool, mode: str):
    """Adagrad makes state for every parameter in its constructor: a rank that
    holds none of a parameter's elements (use_orig_params=True) never steps
    that entry, and a flat shard's padding keeps its initial sum. A get takes
    scalars such as ``step`` from the ranks that hold elements, and a set
    leaves the rest as it is: the resumed run's state, rank by rank, equals
    the uninterrupted run's bitwise."""

    def make(seed):
        model, _ = _fsdp1(ctx, seed, uop)
        return model, torch.optim.Adagrad(model.parameters(), lr=0.01 * (seed + 1), initial_accumulator_value=0.1)

    def local(model, optimizer) -> list:
        out = []
        for p in model.parameters():
            entry = optimizer.state.get(p) or {}
            out += [p.detach().clone(), sorted(entry)] + [entry[k].clone() for k in sorted(entry)]
        return out

    source, source_opt = make(0)
    _steps(source, source_opt, 0, 2)
    msd, osd = hyperdsd.get_state_dict(source, source_opt, options=StateDictOptions(**GET[mode]))
    target, target_opt = make(1)
    hyperdsd.set_state_dict(
        target,
        target_opt,
        model_state_dict=msd,
        optim_state_dict=osd,
        options=StateDictOptions(**PUT.get(mode, GET[mode])),
    )
    _steps(source, source_opt, 2, 1)
    _steps(target, target_opt, 2, 1)
    return _equal(local(source, source_opt), local(target, target_opt))


def partial_load(ctx, uop: bool, broadcast: bool):
    """A load of some keys (strict=False), other keys on each rank, into an
    FSDP1 model ends as it did when the twin read everything first: what a
    rank loads replaces its rows, the rest stays, in the model and in its
    optimizer (a load's twin reads its flat state only where some rank
    leaves some of it)."""
    import hyperdsd.fsdp1.twin

    class Eager(hyperdsd.fsdp1.twin.FSDP1Twin):
        def __init__(self, model, index, optimizers, modifiers_attr, to_load=False, stream=False):
            super().__init__(model, index, optimizers, modifiers_attr)

    source, source_opt = _fsdp1(ctx, 0, uop)
    _steps(source, source_opt, 0, 2)
    msd, osd = _full(source, source_opt)
    mine = ["0.weight", "3.0.bias"] if ctx.rank == 0 or broadcast else ["0.weight", "3.2.weight", "1.bias"]
    part_msd = {k: v for k, v in msd.items() if k in mine}
    groups = [{**g, "params": [f for f in g["params"] if f in mine]} for g in osd["param_groups"]]
    part_osd = {"state": {k: v for k, v in osd["state"].items() if k in mine}, "param_groups": groups}
    if broadcast and ctx.rank != 0:
        part_msd, part_osd = {}, {}
    options = StateDictOptions(strict=False, full_state_dict=True, broadcast_from_rank0=broadcast)
    ends = []
    for twin in (hyperdsd.fsdp1.twin.FSDP1Twin, Eager):
        model, opt = _fsdp1(ctx, 1, uop)
        _steps(model, opt, 50, 1)
        lazy, hyperdsd.fsdp1.twin.FSDP1Twin = hyperdsd.fsdp1.twin.FSDP1Twin, twin
        try:
            hyperdsd.set_model_state_dict(model, part_msd, options=options)
            hyperdsd.set_optimizer_state_dict(model, opt, part_osd, options=options)
        finally:
            hyperdsd.fsdp1.twin.FSDP1Twin = lazy
        ends.append(_full(model, opt))
    _assert_same(*ends)
    return True


def streamed_full_get(
    ctx, uop: bool, mode: str, tied: bool = False, strategy: str = "FULL_SHARD", mesh=None, hooked: bool = False
):
    """A full get gathers from the flat shards run by run: the same keys,
    values, dtypes and order as through a twin that reads all its rows first,
    for the model and the optimizers apart and together, from a model with
    frozen, tied and unstepped parameters; and the model is left as it was."""
    import hyperdsd.fsdp1.streaming
    import hyperdsd.fsdp1.twin
    from hyperdsd.transport.collectives import BUCKET_BYTES

    class Eager(hyperdsd.fsdp1.twin.FSDP1Twin):
        def __init__(self, model, index, optimizers, modifiers_attr, to_load=False, stream=False):
            super().__init__(model, index, optimizers, modifiers_attr, to_load=to_load)

    if tied:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = FSDP(_tied(0), device_id=CPU, use_orig_params=uop)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(5, 4, generator=torch.Generator().manual_seed(3))).square().mean().backward()
        optimizer.step()
    else:
        model, optimizer = _fsdp1(ctx, 0, uop, strategy, mesh)
        if uop:
            model.module[0].bias.requires_grad_(False)  # frozen: no gradient, no state
        _steps(model, optimizer, 0, 2)
    if hooked:  # state_dict() then runs a hook: the optimizer's rows are read for it, the model's are not
        optimizer.register_state_dict_post_hook(lambda opt, sd: sd)
    options = StateDictOptions(**GET[mode])
    frozen = StateDictOptions(**GET[mode], ignore_frozen_params=True)
    before = _snapshot(model, optimizer)
    ends = []
    # Rows read first; gathered from the flat shards in runs of a unit each, of about 48 bytes a rank each
    for twin, bucket in ((Eager, None), (hyperdsd.fsdp1.twin.FSDP1Twin, None), (hyperdsd.fsdp1.twin.FSDP1Twin, 96)):
        streamed, hyperdsd.fsdp1.twin.FSDP1Twin = hyperdsd.fsdp1.twin.FSDP1Twin, twin
        default, hyperdsd.fsdp1.streaming.BUCKET_BYTES = hyperdsd.fsdp1.streaming.BUCKET_BYTES, bucket or BUCKET_BYTES
        try:
            both = hyperdsd.get_state_dict(model, optimizer, options=options)
            apart = (
                hyperdsd.get_model_state_dict(model, options=frozen),
                hyperdsd.get_optimizer_state_dict(model, optimizer, options=options),
            )
        finally:
            hyperdsd.fsdp1.twin.FSDP1Twin, hyperdsd.fsdp1.streaming.BUCKET_BYTES = streamed, default
        ends.append((both, apart))
    assert _equal(before, _snapshot(model, optimizer)), "the get changed the model"
    (eager_both, eager_apart), *streamed_ends = ends
    for both, apart in streamed_ends:
        if mode == "full_cpu" and ctx.rank != 0:
            assert both == ({}, {}) and apart == ({}, {}), "a rank other than the root holds a full copy"
            continue
        for got, want in ((both, eager_both), (apart, eager_apart)):
            _assert_same(got, want)
            for x, y in zip(_leaves(got), _leaves(want)):
                assert type(x) is type(y) and (not isinstance(x, torch.Tensor) or x.dtype == y.dtype), (x, y)
                assert not isinstance(x, torch.Tensor) or x.device == y.device, (x.device, y.device)
            assert got[1]["param_groups"] == want[1]["param_groups"]
    return True


def _leaves(value):
    if isinstance(value, dict):
        return [(k, leaf) for k, v in value.items() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def never_stepped_full(ctx, uop: bool, cpu: bool):
    """A full get of a never-stepped FSDP1 optimizer: placeholders with one
    element or none on a rank gather like any state (they failed to), and
    nothing changes."""
    model, optimizer = _fsdp1(ctx, 0, uop)
    before = _snapshot(model, optimizer)
    osd = hyperdsd.get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu)
    )
    assert _equal(before, _snapshot(model, optimizer)), "the get changed the model or the optimizer"
    if cpu and ctx.rank != 0:
        return sorted(osd.get("state", {}))
    return sorted(osd["state"])


class _Nested(torch.optim.SGD):
    """SGD that also keeps a nested, per-element trace of each gradient, and
    a nested step count (as custom optimizers keep state)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    entry = self.state[p].setdefault("trace", {"last": [torch.zeros_like(p)], "seen": 0})
                    entry["last"][0].mul_(0.5).add_(p.grad)
                    entry["seen"] += 1
                    p.add_(entry["last"][0], alpha=-0.01)
        return super().step(closure)


class _Scaled(torch.optim.Optimizer):
    """Sign descent with a per-element scale that starts at 0.5, not zero: its
    never-stepped template (the state one zero-gradient step leaves) is not zeros."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["scale"] = torch.full_like(p, 0.5)
                    state["step"] += 1
                    state["scale"].mul_(0.9).add_(p.grad.abs())
                    p.add_(state["scale"] * p.grad.sign(), alpha=-group["lr"])


class _OddShaped(torch.optim.SGD):
    """SGD that keeps a nested tensor of its own shape, not the parameter's."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p].setdefault("trace", {"last": [torch.zeros(3)]})
        return super().step(closure)


def nested_state_refused(ctx, uop: bool):
    """Optimizer state nested in containers holding tensors that are not
    per-element (not shaped like the flat shard): a get refuses it on every
    rank, naming the key, rather than return them as they are."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _build(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(model, device_id=CPU, use_orig_params=uop)
    optimizer = _OddShaped(model.parameters(), lr=0.1)
    _steps(model, optimizer, 0, 1)
    try:
        hyperdsd.get_optimizer_state_dict(model, optimizer)
    except StateDictError as exc:
        assert "'trace'" in str(exc) and "nested" in str(exc), str(exc)
        return True
    return False


def _elements_held(model) -> int:
    """Elements of the original parameters this rank holds: in its FSDP1 flat
    shards (not their padding), or its FSDP2 shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = [u._handle.flat_param for u in model.modules() if isinstance(u, FSDP) and u._handle is not None]
    if not units:
        return sum(p.to_local().numel() for p in model.parameters())
    return sum(i.numel_in_shard for flat in units for i in flat._shard_param_infos if i.in_shard)


def optimizer_broadcast_traffic(ctx, fsdp: int, uop: bool = True, strategy: str = "FULL_SHARD", mesh=None):
    """A broadcast load of optimizer state sends a non-root rank its share:
    the per-element state of the parameters' elements it holds (FSDP1's flat
    shards, FSDP2's shards), every parameter's scalars, plus one tensor in
    flight. Returns (bytes received, that bound); the load must also resume
    exactly."""
    from conformance.judging.meter import ReceiveMeter

    def make(seed):
        if fsdp == 2:
            return _fsdp2(ctx, seed, build=_deep)
        return _fsdp1(ctx, seed, uop, strategy, mesh, build=_deep)

    source, source_opt = make(0)
    _steps(source, source_opt, 0, 2)
    msd, osd = hyperdsd.get_state_dict(source, source_opt, options=StateDictOptions(**GET["full_cpu"]))
    tensors = [v for e in osd.get("state", {}).values() for v in e.values() if isinstance(v, torch.Tensor)]
    box = [
        (
            max((t.nbytes for t in tensors), default=0),
            sum(t.nbytes for t in tensors if t.dim() == 0),
            {t.dtype for t in tensors if t.dim() > 0},
            sum(1 for e in osd.get("state", {}).values() for v in e.values() if isinstance(v, torch.Tensor) and v.dim())
            // max(1, len(osd.get("state", {}))),
        )
    ]
    dist.broadcast_object_list(box, src=0)
    largest, scalars, dtypes, per_element_keys = box[0]
    (dtype,) = dtypes
    target, target_opt = make(1)
    _steps(target, target_opt, 50, 1)
    hyperdsd.set_model_state_dict(target, msd, options=StateDictOptions(**PUT["full_cpu"]))
    share = _elements_held(target) * per_element_keys * dtype.itemsize + scalars
    with ReceiveMeter() as meter:
        hyperdsd.set_optimizer_state_dict(target, target_opt, osd, options=StateDictOptions(**PUT["full_cpu"]))
    _assert_same(_full(source, source_opt), _full(target, target_opt))
    return meter.payload, share + largest


def broadcast_equals_full_load(ctx, uop: bool, fresh_target: bool, unlanded: bool = False):
    """A broadcast load lands state straight in the flat layout (into the
    optimizer's own state where it fits): it ends as a full load of the same
    dicts does, here with one parameter's entry a never-stepped template (it
    ends fresh: landed, then dropped) and the others real state. The
    optimizer's template is not zeros, so what lands for the dropped entry
    shows if it stays. ``unlanded``: the state lands nowhere straight (as if
    it could not), so it is received through the twin, whose state stood in
    hollow (shared) until the load gave each value rows of its own."""
    if unlanded:  # (patched for this task alone: the rank's process runs others after it)
        from unittest import mock

        from hyperdsd.fsdp1 import landing

        with mock.patch.object(landing.BroadcastLanding, "_land_state", lambda self, k, path, leaves_of: None):
            return broadcast_equals_full_load(ctx, uop, fresh_target)

    def make(seed):
        model, _ = _fsdp1(ctx, seed, uop)
        return model, _Scaled(model.parameters())

    source, source_opt = make(0)
    _steps(source, source_opt, 0, 2)
    msd, osd = _full(source, source_opt)
    blank, blank_opt = make(0)
    _, template = _full(blank, blank_opt)  # never stepped: placeholder state, step 0
    # as saved and read back: copies, no longer the placeholders a get handed out
    osd["state"]["3.0.weight"] = {k: v.clone() for k, v in template["state"]["3.0.weight"].items()}
    ends = []
    for broadcast in (False, True):
        target, target_opt = make(1)
        if not fresh_target:
            _steps(target, target_opt, 50, 1)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
        mine = (msd, osd) if ctx.rank == 0 or not broadcast else ({}, {})
        hyperdsd.set_state_dict(target, target_opt, model_state_dict=mine[0], optim_state_dict=mine[1], options=options)
        ends.append((target, target_opt))
    (a, a_opt), (b, b_opt) = ends
    assert _equal(_snapshot(a, a_opt), _snapshot(b, b_opt)), "a broadcast load ends otherwise than a full load"
    assert bool(a_opt.state) == bool(b_opt.state)
    for model, opt in ends:
        _steps(model, opt, 2, 1)
    assert _equal(_snapshot(a, a_opt), _snapshot(b, b_opt)), "training after a broadcast load differs"
    return True


def hooked_broadcast_equals_full_load(ctx, uop: bool):
    """An optimizer's load post-hook sees the loaded state and may change it
    (here: doubles every ``exp_avg``): a broadcast load ends as a full load
    of the same dicts, the hook's change kept."""

    def double(opt):
        for entry in opt.state.values():
            if "exp_avg" in entry:
                entry["exp_avg"].mul_(2)

    source, source_opt = _fsdp1(ctx, 0, uop)
    _steps(source, source_opt, 0, 2)
    msd, osd = _full(source, source_opt)
    ends = []
    for broadcast in (False, True):
        target, target_opt = _fsdp1(ctx, 1, uop)
        _steps(target, target_opt, 50, 1)
        target_opt.register_load_state_dict_post_hook(double)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
        mine = (msd, osd) if ctx.rank == 0 or not broadcast else ({}, {})
        hyperdsd.set_state_dict(target, target_opt, model_state_dict=mine[0], optim_state_dict=mine[1], options=options)
        ends.append(_full(target, target_opt))
    _assert_same(*ends)
    doubled = ends[0][1]["state"]["3.0.weight"]["exp_avg"]
    assert torch.equal(doubled, 2 * osd["state"]["3.0.weight"]["exp_avg"]), "the hook's change was lost"
    return True


def indexed_moves_equal_piecewise(ctx, uop: bool, strategy: str = "FULL_SHARD", mesh=None):
    """Units of many small parameters move between flat shards and rows by
    index tensors (and to full tensors as one span a rank), larger ones
    piece by piece: both give the same sharded, flat and full gets, and sets
    through either end the same; so do exchanges that run a unit at a time
    (a bucket of 64 bytes)."""
    import hyperdsd.fsdp1.unit_geometry as geometry
    import hyperdsd.fsdp1.unit_moves as moves

    def through(indexed: bool, fn, bucket: int | None = None):
        default, default_bucket = geometry._INDEXED_MAX_SHARD, moves.BUCKET_BYTES
        geometry._INDEXED_MAX_SHARD = default if indexed else -1
        moves.BUCKET_BYTES = bucket or default_bucket  # (a small one: an exchange runs unit by unit)
        geometry.geometry.cache_clear()  # (the choice is kept with a unit's geometry)
        try:
            return fn()
        finally:
            geometry._INDEXED_MAX_SHARD, moves.BUCKET_BYTES = default, default_bucket
            geometry.geometry.cache_clear()

    def local(sd):
        return [v.to_local() if isinstance(v, DTensor) else v for _, v in hyperdsd.tree.leaves(sd)]

    source, source_opt = _fsdp1(ctx, 1, uop, strategy, mesh, build=_deep)
    _steps(source, source_opt, 0, 2)
    every = (
        StateDictOptions(),
        StateDictOptions(flatten_optimizer_state_dict=True),
        StateDictOptions(full_state_dict=True),  # (gathered from the flat shards: a span a rank, or piece by piece)
    )
    for options in every:
        got = [
            through(indexed, lambda: hyperdsd.get_state_dict(source, source_opt, options=options))
            for indexed in (True, False)
        ]
        assert _equal(local(got[0]), local(got[1])), "the indexed and piecewise gets differ"
        assert local(got[0]), "the gets returned nothing to compare"
        small = through(True, lambda: hyperdsd.get_state_dict(source, source_opt, options=options), bucket=64)
        assert _equal(local(got[0]), local(small)), "a get whose exchanges run unit by unit differs"
        ends = []
        for indexed, bucket in ((True, None), (False, None), (True, 64)):
            target, target_opt = _fsdp1(ctx, 0, uop, strategy, mesh, build=_deep)
            _steps(target, target_opt, 0, 1)
            msd, osd = got[0]
            through(
                indexed,
                lambda: hyperdsd.set_state_dict(
                    target, target_opt, model_state_dict=msd, optim_state_dict=osd, options=options
                ),
                bucket,
            )
            ends.append(_snapshot(target, target_opt))
        assert _equal(ends[0], ends[1]), "sets through the indexed and piecewise moves end differently"
        assert _equal(ends[0], ends[2]), "a set whose exchanges run unit by unit ends differently"
        assert _equal(ends[0], _snapshot(source, source_opt)), "a set of a get does not end as the source"
    return True


def _fresh_get(model, optimizer, **options):
    """A get on a twin built anew (the kept one forgotten first)."""
    import hyperdsd.fsdp1.kept as kept

    kept._KEPT.pop(id(model), None)
    return hyperdsd.get_state_dict(model, optimizer, options=StateDictOptions(**options))


def _local_values(sd: tuple[dict, dict]) -> tuple[dict, dict]:
    """Each value's local tensor cloned (what a get gave, kept apart from what later calls do)."""

    def local(v):
        return v.to_local().clone() if isinstance(v, DTensor) else v.clone() if isinstance(v, torch.Tensor) else v

    msd, osd = sd
    state = {f: {k: local(v) for k, v in e.items()} for f, e in osd["state"].items()}
    return {k: local(v) for k, v in msd.items()}, {"state": state, "param_groups": osd["param_groups"]}


def kept_twin_gets_equal_fresh_ones(ctx, uop: bool):
    """A get on the kept twin gives what a get on a new twin gives, after each
    change between calls (training, a frozen parameter, a replaced buffer, a
    set, a full get, a flat get, a unit renamed); it takes the last tree where nothing
    structural changed; the tree holds no rows between calls; what one get
    returned is not changed by the next; the store lets the model go."""
    import gc
    import weakref

    import hyperdsd.fsdp1.kept as kept

    model, optimizer = _fsdp1(ctx, 0, uop, build=_deep)
    _steps(model, optimizer, 0, 1)
    first = hyperdsd.get_state_dict(model, optimizer)
    tree = kept._KEPT[id(model)][3]
    rows = [k for k, v in first[0].items() if isinstance(v, DTensor)]  # (buffers are the model's own, live)
    first_values = _local_values(first)
    second = hyperdsd.get_state_dict(model, optimizer)
    assert kept._KEPT[id(model)][3] is tree, "an unchanged model's get did not take the kept tree"
    _assert_same(_local_values(second), first_values)
    assert all(_compat_local(p).numel() == 0 for p in tree.parameters() if isinstance(p, DTensor)), "rows kept"

    changes = _changes(model, optimizer, first, uop)
    for name, change, options in changes:
        before = kept._KEPT[id(model)][3]
        change()
        got = hyperdsd.get_state_dict(model, optimizer, options=StateDictOptions(**options))
        if name in ("set", "flat", "again"):  # (nothing structural changed: the set and the get take the tree)
            assert kept._KEPT[id(model)][3] is before, f"{name}: the kept tree was not taken"
        want = _fresh_get(model, optimizer, **options)
        if options.get("flatten_optimizer_state_dict"):
            assert list(got[1]) == list(want[1]), name
            assert all(
                torch.equal(_compat_local(got[1][k]), _compat_local(v))
                for k, v in want[1].items()
                if isinstance(v, torch.Tensor)
            ), name
            got, want = (got[0], {"state": {}, "param_groups": []}), (want[0], {"state": {}, "param_groups": []})
        _assert_same(_local_values(got), _local_values(want))
        if name == "frozen":
            assert "0.weight" not in got[0], "a frozen parameter's value in an ignore_frozen_params get"
        if name == "renamed":
            assert "tail.0.weight" in got[0] and "3.0.weight" not in got[0], sorted(got[0])[:8]
    later = _local_values(first)
    assert rows and all(torch.equal(later[0][k], first_values[0][k]) for k in rows), "a later call changed a get's rows"
    _assert_same(({}, later[1]), ({}, first_values[1]))
    assert kept.kept_models() >= 1
    ref = weakref.ref(model)
    del model, optimizer, first, second, got, want, tree, changes, change, before
    gc.collect()
    assert ref() is None and id(ref) not in kept._KEPT, "the store kept the model alive"
    return True


def _changes(model, optimizer, first, uop: bool) -> list:
    """(name, change, get options): what kept_twin_gets_equal_fresh_ones does between calls."""
    changes = [
        ("trained", lambda: _steps(model, optimizer, 1, 1), {}),
        ("frozen", lambda: model.module[0].weight.requires_grad_(False), {"ignore_frozen_params": True}),
        ("buffer", lambda: setattr(model.module[1], "running_mean", torch.full((12,), 0.5)), {}),
        ("full", lambda: None, {"full_state_dict": True}),
        (
            "set",
            lambda: hyperdsd.set_state_dict(
                model, optimizer, model_state_dict=_halved(first[0]), optim_state_dict=first[1]
            ),
            {},
        ),
        ("flat", lambda: None, {"flatten_optimizer_state_dict": True}),
        ("again", lambda: None, {}),
        ("tree tampered", lambda: _replace_a_twin_parameter(model), {}),
        # (last: every name below the unit changes, and with them its kept canonical names)
        ("renamed", lambda: _rename_child(model.module, "3", "tail"), {}),
    ]
    if not uop:
        changes.pop(1)  # (a flat parameter freezes whole)
    return changes


def _rename_child(parent: nn.Module, old: str, new: str) -> None:
    """Register ``parent``'s child ``old`` as ``new``, in its place: every FQN below it changes."""
    parent._modules = {new if name == old else name: child for name, child in parent._modules.items()}


def _replace_a_twin_parameter(model) -> None:
    """What a load that replaced one of the kept tree's parameters would leave."""
    import hyperdsd.fsdp1.kept as kept

    tree = kept._KEPT[id(model)][3]
    owner, name = tree.get_submodule("3.2"), "weight"
    old = getattr(owner, name)
    owner.register_parameter(name, nn.Parameter(torch.zeros_like(old)))


def _compat_local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _halved(msd: dict) -> dict:
    return {k: v / 2 if v.is_floating_point() else v for k, v in msd.items()}


def stacked_moves_equal_unit_by_unit(ctx, uop: bool, strategy: str = "FULL_SHARD", mesh=None):
    """Alike units' rows moved as stacks (:mod:`hyperdsd.fsdp1.stacks`) equal
    each unit's moved alone, whole or cut into stacks of two, beside a unit
    moved piece by piece in the same batch; every piece has its own storage.
    So do flat shards made back from those rows, new or written into given
    ones (whose padding stays), and they are the shards the rows came from."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    import hyperdsd.api  # noqa: F401  (registers the FSDP1 layout the index reads)
    import hyperdsd.fsdp1.unit_moves as moves
    from hyperdsd.fsdp1.stacks import RowsBatch, ShardsBatch
    from hyperdsd.fsdp1.twin import FSDP1Twin
    from hyperdsd.state.keys.fqn import ModelIndex

    kwargs = {"device_id": CPU, "use_orig_params": uop, "sharding_strategy": ShardingStrategy[strategy]}
    if mesh is not None:
        kwargs["device_mesh"] = ctx.mesh(mesh)
    torch.manual_seed(3)
    blocks = [nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False), nn.Linear(3, 5)) for _ in range(5)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = FSDP(nn.Sequential(*[FSDP(b, **kwargs) for b in blocks], nn.Linear(5, 300)), **kwargs)
    model(torch.randn(2, 5)).sum().backward()  # (FSDP1 sets its units up at the first forward)
    index = ModelIndex.of(model, "_fqn_modifiers")
    units = FSDP1Twin(model, index, (), "_fqn_modifiers").units
    indexed = [u for u in units if u.index_plan() is not None]
    assert (len(indexed), len(units)) == (5, 6), f"five units by index, one by pieces? {len(indexed)}, {len(units)}"

    def shards(u):
        local = u.unit.local.detach()
        return [local, local * 2 + 1, local.to(torch.float64) - 3]

    alone = [moves.to_rows_many(u, shards(u)) for u in units]
    per_unit = sum(s.numel() * s.element_size() for s in shards(indexed[0]))
    two_units = 2 * len(indexed[0].fqns)  # (pieces of two units: a block that holds two)
    for limit, block, stacked in ((None, None, [5]), (2 * per_unit, None, [2, 2, 1]), (None, two_units, [2, 2, 1])):
        batch, made = RowsBatch(limit), []
        moved = batch._stacked  # (watched: how many units each stack holds)
        batch._stacked = lambda members, *rest, moved=moved, made=made: (
            made.append(len(members)),
            moved(members, *rest),
        )
        tickets = [batch.add(u, shards(u)) for u in units]
        default_block = hyperdsd.blocks.BLOCK
        hyperdsd.blocks.BLOCK = block or default_block
        try:
            batch.run()
        finally:
            hyperdsd.blocks.BLOCK = default_block
        assert made == stacked, f"stacks of {made} units, not {stacked}"
        got = [batch.rows(t) for t in tickets]
        for u, mine, theirs in zip(units, got, alone):
            for rows, expected in zip(mine, theirs):
                assert len(rows) == len(expected) == len(u.fqns)
                for a, b in zip(rows, expected):
                    assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b), (u.fqns, limit)
        pieces = [p for rows_of in got for rows in rows_of for p in rows if p.numel()]
        storages = {p.untyped_storage().data_ptr() for p in pieces}
        assert len(storages) == len(pieces), "pieces share a storage"
        assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in pieces)
        # And back: flat shards from these rows, new (zero-padded) or written into given ones (padding kept).
        for into in (False, True):
            expected = []
            for u, rows_of in zip(units, got):
                intos = [torch.full_like(s, 7.0) for s in shards(u)] if into else [None] * 3
                expected.append(moves.to_shard_many(u, rows_of, intos))
            batch, written = ShardsBatch(limit), {}
            intos_of = [[torch.full_like(s, 7.0) for s in shards(u)] if into else [None] * 3 for u in units]
            for n, (u, rows_of) in enumerate(zip(units, got)):
                batch.add(u, rows_of, intos_of[n], then=lambda out, n=n: written.__setitem__(n, out))
            batch.run()
            assert sorted(written) == list(range(len(units))), "a unit's write-back was not called once"
            for n, (u, theirs) in enumerate(zip(units, expected)):
                for j, (a, b) in enumerate(zip(written[n], theirs)):
                    assert a.dtype == b.dtype and torch.equal(a, b), (u.fqns, limit, into)
                    assert not into or a is intos_of[n][j], "not written into the given shard"
                held = torch.zeros(u.shard, dtype=torch.bool)  # this rank's positions of some parameter
                for _, a, b in u.held(u.index, range(len(u.fqns))):
                    held[a - u.index * u.shard : b - u.index * u.shard] = True
                for a, s in zip(written[n], shards(u)):
                    assert torch.equal(a[held], s[held].to(a.dtype)), "rows and back are not the shards"
    return True


def full_get_hands_out_copies(ctx, uop: bool, cpu: bool):
    """A full get gathers per-element state from the flat shards; the rest (steps) is
    copied where a rank hands it out: no value is the optimizer's own tensor, nor
    shares its storage with another key's (a flat parameter's step serves many)."""
    model, optimizer = _fsdp1(ctx, 0, uop)
    _steps(model, optimizer, 0, 2)
    _, osd = hyperdsd.get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu))
    own = {v.data_ptr() for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)}
    seen: set[int] = set()
    state = osd.get("state", {})  # (rank 0 alone holds it with cpu_offload)
    for fqn, entry in state.items():
        for key, value in entry.items():
            assert value.data_ptr() not in own, f"{fqn}'s {key} is the optimizer's own tensor"
            assert value.data_ptr() not in seen, f"{fqn}'s {key} shares its storage with another key's"
            seen.add(value.data_ptr())
    return len(state)
