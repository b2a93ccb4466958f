"""SPEC §3 Calls across changes (REPEAT, 1.5): get and set called again and
again on one model and optimizer, with a change between calls, each call's
outcome the outcome of a first call.

A case keeps one setup (``kept``) for its whole history (:data:`HISTORY`):
a change, then a call, and so on. Each call is compared with the same call
made first: on a *fresh build*, a setup built anew, given every structural
change of the history so far (groups added, parameters replaced, optimizers
made), and the kept setup's state copied into it by the suite
(:func:`copy_state`), never handed to the implementation before. A get
returns what the fresh build's first get returns; a set leaves the kept
setup as the same set leaves a fresh build; a refused set ends as it ends
there. Anything an implementation keeps from one call to the next (an index
of the model, a template of keys, a plan) that a change makes stale shows
as a difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException

from hyperdsd.testing import region_of

from ..kit import (
    FSDP1_FULL,
    GHOST,
    HALVED,
    MODES,
    ONE_RANK,
    REPLICATED,
    STAGES,
    Clause,
    ModelConfig,
    Setup,
    clone_tree,
    diff_snapshots,
    diff_values,
    fail_if,
    grid,
    raised_by_iut,
    saving,
    snapshot,
    tensors,
)

ADDED = ("aux.weight", "aux.bias")  # out of the optimizer until add_param_group adds them
CFG = ModelConfig(frozen=True)  # ``frozen``, frozen from the start, is unfrozen on the way


@dataclass
class Kept:
    """The setup a case keeps calling the implementation on, and the structural
    changes made to it so far (each a function of a setup), which a fresh build
    is given too."""

    setup: Setup
    structure: list[Callable] = field(default_factory=list)


def _build(c, layout: str, seed: int) -> Setup:
    return Setup(c, layout, "adamw", seed=seed, cfg=CFG, trainable=lambda fqn: fqn not in ADDED)


def fresh(c, kept: Kept, scale: float = 1.0) -> Setup:
    """A fresh build with the kept setup's structure and state (its floating
    values times ``scale``: another state of the same structure)."""
    f = _build(c, kept.setup.layout.name, 1)
    for change in kept.structure:
        change(f)
    copy_state(kept.setup, f, scale)
    return f


# -- the suite's own copy of a setup's state into another of the same structure ------


def copy_state(src: Setup, dst: Setup, scale: float = 1.0) -> None:
    """Parameters' values and ``requires_grad``, every optimizer's groups'
    fields and its state, from ``src`` into ``dst`` by FQN and position,
    without the implementation: what a fresh build needs to stand for ``src``."""
    mine = dict(dst.named_parameters())
    with torch.no_grad():
        for fqn, p in src.named_parameters():
            tensors.local(mine[fqn]).copy_(tensors.local(p) * scale)
            mine[fqn].requires_grad_(p.requires_grad)
    fqn_of = src.fqn_of()
    for a, b in zip(src.optimizers, dst.optimizers, strict=True):
        b.state.clear()
        for ga, gb in zip(a.param_groups, b.param_groups, strict=True):
            gb.update({k: clone_tree(v) for k, v in ga.items() if k != "params"})
            for p in ga["params"]:
                if a.state.get(p):
                    b.state[mine[fqn_of[p]]] = _scaled(a.state[p], scale)


def _scaled(entry: dict, scale: float) -> dict:
    out = clone_tree(dict(entry))
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and key != "step":
            tensors.local(value).mul_(scale)
    return out


# -- the changes ------------------------------------------------------------------


def _add_param_group(s: Setup) -> None:
    params = dict(s.named_parameters())
    added = [params[f] for f in ADDED if f in params]
    if added:  # (a pipeline stage without them adds no group: groups without parameters are OPT-EMPTY's)
        s.optimizers[0].add_param_group({"params": added, "lr": 0.05, "weight_decay": 0.0, "tag": "added"})


def _group_values(s: Setup) -> None:
    """New values of the fields every group has (a scheduler's lr, say): the same keys."""
    for group in s.optimizers[0].param_groups:
        group["lr"] *= 0.5
        group["weight_decay"] += 0.01
        group["betas"] = (0.8, 0.9)


def _custom_field(s: Setup) -> None:
    for i, group in enumerate(s.optimizers[0].param_groups):
        group["custom"] = i


def _entries(s: Setup) -> None:
    """An entry's tensor replaced by a new one; a key added to another entry."""
    opt = s.optimizers[0]
    held = [p for g in opt.param_groups for p in g["params"] if opt.state.get(p)]
    if held:
        opt.state[held[0]]["exp_avg"] = opt.state[held[0]]["exp_avg"] * 2
        opt.state[held[-1]]["seen"] = 3.5


def _unfreeze(s: Setup) -> None:
    for fqn, p in s.named_parameters():
        if fqn.startswith("frozen."):
            p.requires_grad_(True)


def _replace_parameter(s: Setup) -> None:
    """``layers.0.fc1.weight`` replaced by a new Parameter of its values; the
    optimizer holds the new one in its place, with its state."""
    module = s.module.layers["0"].fc1 if "0" in s.module.layers else None
    if module is None:
        return
    old = module.weight
    new = nn.Parameter(old.detach().clone(), requires_grad=old.requires_grad)
    module.weight = new
    for opt in s.optimizers:
        for group in opt.param_groups:
            group["params"] = [new if p is old else p for p in group["params"]]
        if old in opt.state:
            opt.state[new] = opt.state.pop(old)


def _new_optimizer(s: Setup) -> None:
    """A new optimizer of the same class and groups over the same model (a job that rebuilds it)."""
    old = s.optimizers[0]
    groups = [{**{k: v for k, v in g.items()}, "params": list(g["params"])} for g in old.param_groups]
    s.optimizers = [type(old)(groups)]


def _second_optimizer(s: Setup) -> None:
    """Another optimizer over the same parameters (SGD with momentum), the one now handed over and stepped."""
    params = [p for g in s.optimizers[0].param_groups for p in g["params"]]
    s.others = [s.optimizers[0]]
    s.optimizers = [torch.optim.SGD(params, lr=1e-2, momentum=0.9)]


def _swap_optimizers(s: Setup) -> None:
    s.optimizers, s.others = s.others, s.optimizers


def _train(s: Setup) -> None:
    s.train(1)


@dataclass(frozen=True)
class Step:
    """A change (``structural``: made to fresh builds too; ``state``: to the
    kept setup alone, whose state fresh builds copy), then the calls compared."""

    name: str
    calls: tuple[str, ...]
    structural: Callable | None = None
    state: Callable | None = None
    plain_only: bool = False  # possible where the suite holds the module's parameters itself (no wrapper)


HISTORY = (
    Step("trained", ("get",)),
    Step("trained further", ("get",), state=_train),
    Step("add_param_group", ("get",), structural=_add_param_group),
    Step("the added group stepped", ("get", "set"), state=_train),
    Step("after a set", ("get",)),
    Step("group fields changed", ("get",), state=_group_values),
    Step("a custom group field added", ("get", "set"), state=_custom_field),
    Step("state entries replaced and extended", ("set", "get"), state=_entries),
    Step("a frozen parameter unfrozen and stepped", ("get",), state=lambda s: (_unfreeze(s), s.train(1))),
    Step("after a refused set", ("refused", "get")),
    Step("a parameter object replaced", ("get", "set"), structural=_replace_parameter, plain_only=True),
    Step("a new optimizer, stepped", ("get", "set"), structural=_new_optimizer, state=_train),
    Step("a second optimizer of the model, stepped", ("get",), structural=_second_optimizer, state=_train),
    Step("back to the first optimizer", ("get", "set"), structural=_swap_optimizers),
    Step("to the second again", ("get",), structural=_swap_optimizers),
)


# -- the calls, each against a fresh build's first -------------------------------------


def _get(c, s: Setup, mode: str) -> tuple:
    opts = saving.get_options(c.iut, saving.effective(mode, s))
    msd = c.iut.get_model_state_dict(s.model, options=opts)
    osd = c.iut.get_optimizer_state_dict(s.model, saving.optimizers_arg(s), options=opts)
    return clone_tree(msd), clone_tree(osd)


def check_get(c, kept: Kept, mode: str, after: str) -> None:
    got = _get(c, kept.setup, mode)
    want = _get(c, fresh(c, kept), mode)
    fail_if(
        diff_values(want, got, "(model, optim)"),
        f"{mode}: a get after {after} returns another dict than a first get of the same model and optimizer",
    )


def check_set(c, kept: Kept, mode: str, after: str) -> None:
    """Another state of the same structure, from a fresh build's get in
    ``mode``, set into the kept setup and into a fresh build."""
    saved = saving.save(c, fresh(c, kept, scale=0.5), mode, model="iut", batched=True)
    f = fresh(c, kept)
    saving.load(c, kept.setup, saved)
    saving.load(c, f, saved)
    fail_if(
        diff_snapshots(snapshot(f, copy=False), snapshot(kept.setup, copy=False)),
        f"{mode}: a set after {after} leaves the model and optimizer otherwise than a first set",
    )


def check_refused(c, kept: Kept, mode: str, after: str) -> None:
    """A strict set of a checkpoint naming a parameter the model does not
    have (another state of the same structure, from a fresh build's get in
    ``mode``, damaged), into the kept setup and into a fresh build, through
    the mode's own load path: each raises or loads as the other does, and ends
    as the other ends (whether it must refuse is OPT-ATOM-1's)."""
    flat = saving.effective(mode, kept.setup).flat
    saved = saving.save(
        c, fresh(c, kept, scale=0.5), mode, model=None, batched=True, edit=lambda osd: _spoil(osd, flat)
    )
    f = fresh(c, kept)
    outcomes = [_outcome(c, s, saved) for s in (kept.setup, f)]
    fail_if(
        [f"the kept setup's set {outcomes[0]}, a fresh build's {outcomes[1]}"] if outcomes[0] != outcomes[1] else [],
        f"{mode}: a set of a checkpoint naming a parameter the model lacks, after {after}",
    )
    fail_if(
        diff_snapshots(snapshot(f, copy=False), snapshot(kept.setup, copy=False)),
        f"{mode}: after a set of a checkpoint naming a parameter the model lacks, after {after}, the model and "
        "optimizer differ from a fresh build's after the same set",
    )


def _spoil(osd: dict, flat: bool) -> None:
    if flat:
        osd[f"state.{GHOST}.exp_avg"] = torch.zeros(3)
        osd[f"param_groups.{GHOST}.lr"] = 0.1
    else:
        osd["state"][GHOST] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}
        osd["param_groups"][0]["params"].append(GHOST)


def _outcome(c, s: Setup, saved: saving.Saved) -> str:
    try:
        saving.load(c, s, saved, model=False, strict=True)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - whether it raises is compared, not judged
        if not raised_by_iut(exc) and not region_of(exc):
            raise
        return f"raised {type(exc).__name__}"
    return "loaded"


CHECKS = {"get": check_get, "set": check_set, "refused": check_refused}


def repeat_1(c, layout, mode):
    """The history of :data:`HISTORY` on one setup, each call against a fresh build's first."""
    s = _build(c, layout, 0)
    s.train(1)
    kept = Kept(s)
    plain = layout.wrapper == "none"
    for step in HISTORY:
        if step.plain_only and not plain:
            continue
        if step.structural is not None:
            step.structural(s)
            kept.structure.append(step.structural)
        if step.state is not None:
            step.state(s)
        for call in step.calls:
            CHECKS[call](c, kept, mode, step.name)


# Every mode on the plain layout and on FSDP2; two of the other families' in
# turn (a case calls the implementation some forty times: SPEC REPEAT-1).
LAYOUT_MODES = (
    (ONE_RANK | HALVED, MODES),
    (REPLICATED, ("full", "bcast")),
    # HSDP on two ranks, each a replica of its own: named, the catalog's HSDP has four.
    (("hsdp2x1",), ("sharded", "file")),
    (STAGES, ("flat", "full_cpu")),
    (FSDP1_FULL, ("sharded", "dcp")),
)


def cases():
    for layouts, layout_modes in LAYOUT_MODES:
        yield from grid("REPEAT-1", layouts, repeat_1, opts=("adamw",), modes=layout_modes, deadline_s=120)


CLAUSES = {"REPEAT-1": Clause()}
