"""SPEC §3 Round trip (OPT-RT)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import flows
from ..flows import get_options, optimizers_arg, set_options
from ..layouts import Setup
from ..oracle import check, clone_tree, diff_snapshots, diff_values, fail_if, snapshot
from ..registry import make_case

LAYOUTS = ("single", "ddp", "fsdp2", "fsdp3", "fsdp4", "hsdp2x2", "pp2", "pp2xfsdp2")
OPTS = ("adamw", "adam_amsgrad", "sgd", "sgd_plain", "adagrad")
BEFORE, AFTER = 1, 1


def rt_1(c, layout, opt, mode):
    """Resume in a fresh setup; K more steps must match the uninterrupted run bitwise."""
    a, b = flows.resume(c, lambda seed: Setup(c, layout, opt, seed=seed, lazy=True), mode, before=BEFORE, after=AFTER)
    fail_if(diff_snapshots(snapshot(a), snapshot(b)), f"{mode}: after resuming, the run differs from the uninterrupted one")


def rt_2(c, layout, opt, mode):
    """get, set into a fresh setup, get: the same dict, value for value."""
    a = Setup(c, layout, opt)
    a.train(2)
    get_opts = get_options(c.iut, mode)
    first = clone_tree(c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_opts))
    first_model = clone_tree(c.iut.get_model_state_dict(a.model, options=get_opts))
    b = Setup(c, layout, opt, seed=1)
    full_cpu = mode == "full_cpu"
    set_opts = set_options(c.iut, mode)
    c.iut.set_model_state_dict(b.model, clone_tree(first_model), options=set_opts)
    c.iut.set_optimizer_state_dict(b.model, optimizers_arg(b), clone_tree(first), options=set_opts)
    second = c.iut.get_optimizer_state_dict(b.model, optimizers_arg(b), options=get_opts)
    second_model = c.iut.get_model_state_dict(b.model, options=get_opts)
    if full_cpu and c.rank != 0:
        check(not first and not second, "full_cpu: ranks other than 0 must get an empty dict")
        return
    fail_if(diff_values(first, second, "optim") + diff_values(first_model, second_model, "model"), f"{mode}: get after set returns a different dict")


def rt_3(c, layout, opt):
    """full_cpu: rank 0 holds full CPU tensors equal to the gathered shards; others get nothing."""
    a = Setup(c, layout, opt)
    a.train(2)
    opts = get_options(c.iut, "full_cpu")
    osd = c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=opts)
    msd = c.iut.get_model_state_dict(a.model, options=opts)
    sharded_osd = c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, "sharded"))
    sharded_msd = c.iut.get_model_state_dict(a.model, options=get_options(c.iut, "sharded"))
    # The oracle: this suite gathers every rank's sharded dict itself.
    gathered_osd = {k: {kk: _full(vv) for kk, vv in e.items()} for k, e in sharded_osd.get("state", {}).items()}
    gathered_msd = {k: _full(v) for k, v in sharded_msd.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (_cpu(gathered_osd), _cpu(gathered_msd)))
    if c.rank != 0:
        empty = (not osd or osd == {"state": {}, "param_groups": []}) and not msd
        check(empty, f"full_cpu on rank {c.rank}: expected an empty dict, got {len(osd.get('state', {}))} state entries and {len(msd)} model keys")
        return
    want_osd, want_msd = {}, {}
    for part_osd, part_msd in everyone:  # pipeline stages: rank 0 must hold every stage
        want_osd.update(part_osd)
        want_msd.update(part_msd)
    problems = []
    for where, tree in (("optim", osd.get("state", {})), ("model", msd)):
        for path, value in _tensors(tree):
            if isinstance(value, DTensor):
                problems.append(f"{where}{path}: a DTensor, expected a full tensor")
            elif value.device.type != "cpu":
                problems.append(f"{where}{path}: on {value.device}, expected cpu")
    problems += diff_values(want_osd, osd.get("state", {}), "optim['state']")
    problems += diff_values(want_msd, msd, "model")
    fail_if(problems, "full_cpu on rank 0 does not hold the full state")


def _full(v):
    return v.full_tensor() if isinstance(v, DTensor) else v


def _cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone()
    if isinstance(tree, dict):
        return {k: _cpu(v) for k, v in tree.items()}
    return tree


def _tensors(tree, path=""):
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from _tensors(v, f"{path}[{k!r}]")


def cases():
    for layout in LAYOUTS:
        for opt in OPTS:
            for mode in flows.MODES:
                yield make_case("OPT-RT-1", layout, rt_1, opt=opt, mode=mode)
    for mode in flows.MODES:  # optional: FSDP over tensor parallelism (strided shards)
        yield make_case("OPT-RT-1", "fsdp2xtp2", rt_1, opt="adamw", mode=mode, profile="tp")
    for layout in LAYOUTS:
        for mode in ("sharded", "full", "full_cpu", "flat"):
            yield make_case("OPT-RT-2", layout, rt_2, opt="adamw", mode=mode)
    for layout in LAYOUTS:
        for opt in ("adamw", "sgd"):
            yield make_case("OPT-RT-3", layout, rt_3, opt=opt, mode="full_cpu")
