"""Rank-side functions for tests that change the model or optimizer between
calls (run through the harness): what one call worked out must not leak into
the next, whatever changed in between."""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hyperdsd
import hyperdsd.blocks
import hyperdsd.tree

WIDTH = 4
FULL = hyperdsd.StateDictOptions(full_state_dict=True)
FULL_CPU = hyperdsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
BROADCAST = hyperdsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
FLAT = hyperdsd.StateDictOptions(flatten_optimizer_state_dict=True)


def _trained(ctx, seed: int, blocks: int = 3, sharded: bool = True, lr: float = 1e-2):
    """Blocks of two Linear layers (FSDP2 per block and at the root, or plain), AdamW stepped once."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)) for _ in range(blocks)])
    if sharded:
        mesh = ctx.mesh(str(ctx.world_size))
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    _step(model, opt, seed)
    return model, opt


def _step(model, opt, seed: int) -> None:
    torch.manual_seed(100 + seed)
    model(torch.randn(3, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full(model, opt) -> dict:
    """Every value of the model and optimizer, full, by FQN, on every rank."""
    msd, osd = hyperdsd.get_state_dict(model, opt, options=FULL)
    out = {f"model.{k}": v for k, v in msd.items()}
    for fqn, entry in osd["state"].items():
        out.update({f"state.{fqn}.{k}": v for k, v in entry.items()})
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert a[k].dtype == b[k].dtype, f"{what}: {k} dtype {a[k].dtype} != {b[k].dtype}"
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def _shifted(value, by: float):
    return value + by if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _plus(msd: dict, osd: dict, by: float) -> tuple[dict, dict]:
    """The same state dicts (nested or flat) with every floating-point state
    tensor shifted: new tensors, which a load copies."""
    if "state" in osd:
        osd = {**osd, "state": {f: {k: _shifted(v, by) for k, v in e.items()} for f, e in osd["state"].items()}}
    else:
        osd = {k: _shifted(v, by) if k.startswith("state.") else v for k, v in osd.items()}
    return {k: _shifted(v, by) for k, v in msd.items()}, osd


def sets_after_changes(ctx, mode: str) -> bool:
    """Loads between which the model or optimizer changes: a set of new values
    (copied), of the state itself (nothing to copy), into a model sharded
    again (other layouts), into state of another dtype, into an optimizer
    whose groups changed; each leaves exactly what was loaded, or raises on
    every rank."""
    model, opt = _trained(ctx, 0)
    opts = FLAT if mode == "flat" else None
    expected = {k: _shifted(v, 1.0) for k, v in _full(model, opt).items()}
    msd, osd = hyperdsd.get_state_dict(model, opt, options=opts)
    hyperdsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=opts)  # in place
    new_msd, new_osd = _plus(msd, osd, 1.0)
    hyperdsd.set_state_dict(model, opt, model_state_dict=new_msd, optim_state_dict=new_osd, options=opts)
    _same(_full(model, opt), expected, "copied into the same model")
    # msd and osd's tensors are the model's and optimizer's own: set again, nothing changes
    hyperdsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=opts)
    _same(_full(model, opt), expected, "its own state set again")

    # Sharded again: another model of the same structure, its own layouts, loads the first's state.
    other, other_opt = _trained(ctx, 1)
    hyperdsd.set_state_dict(other, other_opt, model_state_dict=msd, optim_state_dict=osd, options=opts)
    _same(_full(other, other_opt), expected, "into a model sharded again")

    # State of another dtype: a loaded value keeps its own dtype, the values are the checkpoint's.
    for entry in other_opt.state.values():
        entry["exp_avg"] = entry["exp_avg"].to(torch.float64)
    hyperdsd.set_state_dict(other, other_opt, model_state_dict=msd, optim_state_dict=osd, options=opts)
    _same(_full(other, other_opt), expected, "into state of another dtype")

    # Another param group: the checkpoint's one group no longer pairs up with the optimizer's two.
    params = list(other.parameters())
    regrouped = torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 0.5}], lr=1e-2)
    _step(other, regrouped, 2)
    if mode != "flat":  # (a flat dict has no list of groups to pair: its groups follow the parameters)
        try:
            hyperdsd.set_state_dict(other, regrouped, model_state_dict=msd, optim_state_dict=osd)
        except hyperdsd.StateDictError as exc:
            assert "param groups" in str(exc), str(exc)
        else:
            raise AssertionError("a checkpoint of one group loaded into an optimizer of two")
    # ... and loads where it is told what goes where (non-strict): the state, by parameter.
    lax = hyperdsd.StateDictOptions(strict=False, flatten_optimizer_state_dict=mode == "flat")
    hyperdsd.set_state_dict(other, regrouped, model_state_dict=msd, optim_state_dict=osd, options=lax)
    _same(_full(other, regrouped), expected, "into an optimizer regrouped")
    return True


def _flat_by_rule(osd: dict) -> dict:
    """A nested optimizer state dict (of plain entries) in the flat layout, key by key."""
    out = {f"state.{fqn}.{k}": v for fqn, entry in osd["state"].items() for k, v in entry.items()}
    for group in osd["param_groups"]:
        out.update({f"param_groups.{f}.{k}": v for f in group["params"] for k, v in group.items() if k != "params"})
    return out


def _same_flat(got: dict, expected: dict, what: str) -> None:
    assert list(got) == list(expected), f"{what}: keys differ: {sorted(set(got) ^ set(expected), key=str)[:5]}"
    for k, v in expected.items():
        same = torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v
        assert same, f"{what}: {k} is {got[k]!r}, expected {v!r}"


def flat_gets_after_changes(ctx) -> bool:
    """Flat gets between which the optimizer changes (a scheduler's new lr, a
    step, a state key added, parameters regrouped, the model sharded again):
    each gives exactly what the nested get of the same moment gives, laid
    out flat key by key, whatever the get before it kept."""
    model, opt = _trained(ctx, 0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def check(model, opt, what: str) -> None:
        _, nested = hyperdsd.get_state_dict(model, opt)
        _, flat = hyperdsd.get_state_dict(model, opt, options=FLAT)
        _same_flat(flat, _flat_by_rule(nested), what)

    check(model, opt, "a first flat get")
    check(model, opt, "the same again")
    scheduler.step()
    check(model, opt, "after a scheduler's step (a new lr)")
    _step(model, opt, 1)
    check(model, opt, "after a step")
    params = list(model.parameters())
    regrouped = torch.optim.AdamW([{"params": params[:4]}, {"params": params[4:], "lr": 0.5}], lr=1e-2)
    _step(model, regrouped, 2)
    check(model, regrouped, "parameters regrouped")
    for entry in regrouped.state.values():
        entry["extra"] = torch.ones(1)
    check(model, regrouped, "with a state key added")
    other, other_opt = _trained(ctx, 1)
    check(other, other_opt, "a model sharded again")
    check(model, regrouped, "the first model again")
    return True


def broadcasts_after_changes(ctx) -> bool:
    """A broadcast load of full state into the model it came from, into one
    sharded again, into state of another dtype, after a full get: each
    leaves exactly the root's values."""
    model, opt = _trained(ctx, 0)
    full_msd, full_osd = hyperdsd.get_state_dict(model, opt, options=FULL_CPU)
    expected = _full(model, opt)
    root = ctx.rank == 0
    args = (full_msd, full_osd) if root else ({}, {})
    hyperdsd.set_model_state_dict(model, args[0], options=BROADCAST)
    hyperdsd.set_optimizer_state_dict(model, opt, args[1], options=BROADCAST)
    _same(_full(model, opt), expected, "broadcast into the same model")
    other, other_opt = _trained(ctx, 1)
    for entry in other_opt.state.values():
        entry["exp_avg_sq"] = entry["exp_avg_sq"].to(torch.float64)
    hyperdsd.set_state_dict(other, other_opt, model_state_dict=args[0], optim_state_dict=args[1], options=BROADCAST)
    _same(_full(other, other_opt), expected, "broadcast into a model sharded again, state of another dtype")
    again_msd, again_osd = hyperdsd.get_state_dict(other, other_opt, options=FULL_CPU)
    if root:
        _same({**again_msd}, {**full_msd}, "a full get after the broadcast")
    return True


def plain_model_changes(ctx) -> bool:
    """One process, no FSDP: a parameter replaced between a get and a set (in
    the model and the optimizer), a model cast to another dtype, and an
    optimizer still holding a parameter the model replaced."""
    model, opt = _trained(ctx, 0, sharded=False)
    msd, osd = hyperdsd.get_state_dict(model, opt)
    saved = {k: v.clone() for k, v in _full(model, opt).items()}
    old = model[0][0].weight
    new = nn.Parameter(torch.zeros_like(old))
    model[0][0].weight = new
    group = opt.param_groups[0]
    group["params"][group["params"].index(old)] = new
    opt.state[new] = {k: torch.zeros_like(v) if v.dim() else v.clone() for k, v in opt.state.pop(old).items()}
    hyperdsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    _same(_full(model, opt), saved, "a replaced parameter")
    assert model[0][0].weight is new and torch.equal(new.detach(), saved["model.0.0.weight"])

    model.double()  # parameters of another dtype keep theirs; the values are the checkpoint's
    msd32 = {k: v.clone() for k, v in msd.items()}
    hyperdsd.set_model_state_dict(model, msd32)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float64 and torch.equal(v, saved[f"model.{k}"].double()), k

    stranger = nn.Parameter(torch.zeros(WIDTH))
    opt.param_groups[0]["params"].append(stranger)  # a parameter the model does not hold
    try:
        hyperdsd.set_optimizer_state_dict(model, opt, osd)
    except hyperdsd.StateDictError:
        pass
    else:
        raise AssertionError("loaded into an optimizer holding a parameter the model does not")
    return True


def blocks_of(size: int):
    """Every column worked in blocks of ``size`` (hyperdsd.blocks.BLOCK) meanwhile."""
    return mock.patch.object(hyperdsd.blocks, "BLOCK", size)


def in_blocks_of(ctx, size: int, task, **kwargs) -> bool:
    """``task`` (a function of this module) run in blocks of ``size``: each of
    its checks holds there as in one block."""
    with blocks_of(size):
        return task(ctx, **kwargs)


def sets_across_blocks(ctx) -> bool:
    """Loads of an optimizer group that spans four blocks (of 3 of its 12
    parameters), the blocks taking different paths: one entry of another
    dtype and one parameter without state (their blocks planned value by
    value, the others in place) load exactly the checkpoint's values; a value
    of the wrong shape in the last block is refused on every rank, naming
    its FQN, and changes nothing."""
    model, opt = _trained(ctx, 0)
    msd, osd = _plus(*hyperdsd.get_state_dict(model, opt), 1.0)
    expected = {k: _shifted(v, 1.0) for k, v in _full(model, opt).items()}
    fqns = list(osd["state"])
    other, other_opt = _trained(ctx, 1)
    params = other_opt.param_groups[0]["params"]
    assert len(params) == len(fqns) == 12, fqns
    other_opt.state[params[4]]["exp_avg"] = other_opt.state[params[4]]["exp_avg"].to(torch.float64)
    del other_opt.state[params[7]]
    with blocks_of(3):
        assert len(hyperdsd.blocks.blocks(len(params))) == 4
        hyperdsd.set_state_dict(other, other_opt, model_state_dict=msd, optim_state_dict=osd)
    _same(_full(other, other_opt), expected, "blocks planned in place and value by value")

    before = {k: v.clone() for k, v in _full(other, other_opt).items()}
    last = fqns[10]
    wrong = {**osd, "state": {**osd["state"], last: {**osd["state"][last], "exp_avg": torch.zeros(WIDTH + 1)}}}
    try:
        with blocks_of(3):
            hyperdsd.set_optimizer_state_dict(other, other_opt, wrong)
    except hyperdsd.StateDictError as exc:
        assert last in str(exc), str(exc)
    else:
        raise AssertionError(f"a value of the wrong shape for {last!r} loaded")
    _same(_full(other, other_opt), before, "a refused load")
    return True


def _leaves(*dicts) -> dict:
    """Every leaf of ``dicts`` by its path; a DTensor as its local tensor."""
    out = {}
    for i, d in enumerate(dicts):
        for path, leaf in hyperdsd.tree.leaves(d):
            out[(i, *path)] = leaf.to_local() if isinstance(leaf, DTensor) else leaf
    return out


def gets_across_blocks(ctx) -> bool:
    """Gets (sharded, flat, full) with every column in blocks of 3 give what
    they give in one block, every parameter's state entry included."""
    model, opt = _trained(ctx, 0)
    for opts in (None, FLAT, FULL):
        whole = _leaves(*hyperdsd.get_state_dict(model, opt, options=opts))
        with blocks_of(3):
            parts = _leaves(*hyperdsd.get_state_dict(model, opt, options=opts))
        _same_flat(parts, whole, f"in blocks of 3, {opts}")
    _, osd = hyperdsd.get_state_dict(model, opt)
    assert len(osd["state"]) == len(opt.state) == 12, list(osd["state"])
    return True
