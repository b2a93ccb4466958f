"""Resharding, the scenario two-phase cases share (OPT-RESHARD, and the moves
of OPT-STATE-1, OPT-MESH-1, OPT-PART-5 and SCALE-1): save on one layout,
load on another.

The first phase trains on the move's source, saves, trains on and writes the
uninterrupted run's full state (every rank's part, gathered) as the
reference; the second loads on its target, trains as many steps and
compares with the reference (tolerance 1e-6 relative: reductions over other
numbers of ranks round differently; the models are float64 so that only that
rounding shows).
"""

from __future__ import annotations

import glob
from dataclasses import replace

import torch
import torch.distributed as dist

from ..judging.oracle import check, diff_values, fail_if, full_snapshot
from ..modes import Mode, mode_of
from ..running.cases import Case, Phase, case_id
from ..world import saving
from ..world.groups import GroupSpec
from ..world.layouts import Layout, Move
from ..world.models import ModelConfig
from ..world.saving import Saved
from ..world.setup import Setup

BEFORE, AFTER = 1, 1
# Models here are float64. Another world size sums gradients in another
# order: the base model differs by 1e-12 or so; the tiny models exploration
# draws (one feature, one hidden unit) amplify it to a few 1e-6. A load that
# loses or misplaces state differs by far more.
RTOL = 1e-6


def only_layers(fqn: str) -> bool:
    """The parameters of the layers (an optimizer over some of the model's: OPT-PART-4, OPT-RESHARD-2)."""
    return fqn.startswith("layers.")


ROUTERS = ("shared", "group")  # OPT-PART-5: routers in groups with others, or in their own


def _setup(c, layout: Layout, opt: str, seed: int, lazy: str | None, cfg=None, groups=None) -> Setup:
    """``cfg``, ``groups``: a generated scenario's model (in float64) and groups, instead of the base ones."""
    if cfg is not None:
        cfg = replace(cfg, dtype=torch.float64)
    else:
        cfg = ModelConfig(dtype=torch.float64, router=lazy in ROUTERS, lazy_aux=lazy == "aux")
    if groups is not None:
        groups = replace(groups, scale=groups.scale * GroupSpec.for_seed(seed).scale)
    else:
        groups = GroupSpec.for_seed(seed, router_group=lazy == "group")
    return Setup(c, layout, opt, seed=seed, cfg=cfg, groups=groups)


def _without_state(fqn: str, lazy: str | None) -> bool:
    """Whether the checkpoint has no state for ``fqn`` (it never had a gradient)."""
    if lazy == "subset":
        return not only_layers(fqn)
    if lazy == "aux":
        return fqn.startswith("aux.")
    return lazy in ROUTERS and ".router." in fqn


def _checkpoint(c, src: Layout, mode: Mode) -> Saved:
    """Where the first phase's save on ``src`` in ``mode`` (dcp or bcast) left its checkpoint."""
    on = mode.on(src.pp > 1)
    return Saved(on, path=c.path("full.pt") if on.file else c.path(f"dcp-{on}"))


def save_phase(c, src, dst, opt, mode, lazy=None, cfg=None, groups=None):
    a = _setup(c, src, opt, 0, lazy, cfg, groups)
    if lazy == "subset":
        a.freeze([f for f, _ in a.named_parameters() if not only_layers(f)])
    a.train(BEFORE)
    saving.save(c, a, mode, model=None)
    saving.save_reference_model(c, a)
    a.train(AFTER)
    torch.save(full_snapshot(a), c.path(f"reference-rank{c.rank}.pt"))


def _reference(c) -> dict:
    ref = {"params": {}, "state": {}, "groups": []}
    for path in sorted(glob.glob(c.path("reference-rank*.pt"))):
        part = saving.read_full(path)
        ref["params"].update(part["params"])
        ref["state"].update(part["state"])
        ref["groups"].extend(g for g in part["groups"] if g not in ref["groups"])
    return ref


def load_phase(c, src, dst, opt, mode, lazy=None, cfg=None, groups=None):
    b = _setup(c, dst, opt, 1, lazy, cfg, groups)
    b.set_steps_done(BEFORE)
    saved = _checkpoint(c, src, mode)
    saving.load_reference_model_from(c, b)
    saving.load(c, b, saved, model=False)
    if lazy:
        # Parameters the checkpoint had no state for stay fresh (OPT-PURE-1
        # for what was not loaded) on every rank, those holding an empty
        # shard included: checked on all ranks at once, before the
        # collectives of the comparison.
        stale = [
            f"rank {c.rank}: state[{f!r}]"
            for f, p in b.named_parameters()
            if _without_state(f, lazy) and b.optimizers[0].state.get(p)
        ]
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, stale)
        fail_if(
            [s for part in everyone for s in part],
            "state for parameters the checkpoint had none for (lazy state) after the load",
        )
    if lazy == "subset":
        return
    b.train(AFTER)
    ref, got = _reference(c), full_snapshot(b)
    # Another world size sums gradients in another order: values differ by
    # rounding, relative to the largest of their kind (parameters; each state
    # key), not to themselves, where a value is rounding noise (a gradient
    # that is zero but for rounding, Adam's step on it).
    params_atol = RTOL * _largest(ref["params"].values())
    state_keys = {k for e in ref["state"].values() for k in e}
    atol_of = {k: RTOL * _largest(e[k] for e in ref["state"].values() if k in e) for k in state_keys}
    problems = diff_values(
        {k: ref["params"][k] for k in got["params"] if k in ref["params"]}, got["params"], "params", RTOL, params_atol
    )
    problems += [f"params[{k!r}]: not in the reference" for k in got["params"] if k not in ref["params"]]
    problems += diff_values(
        {k: ref["state"].get(k) for k in got["state"]}, got["state"], "state", RTOL, atol_of=atol_of
    )
    problems += [
        f"state[{k!r}]: absent after resuming, present in the uninterrupted run"
        for k in ref["state"]
        if k in got["params"] and k not in got["state"]
    ]
    empty = iter([r for r in ref["groups"] if not r["params"]])
    for g in got["groups"]:
        # Stages group differently from whole models: compare the fields of
        # the group that held the same first parameter; groups without
        # parameters in their order.
        if g["params"]:
            match = [r for r in ref["groups"] if g["params"][0] in r["params"]] or [
                r for r in ref["groups"] if r["params"] == g["params"]
            ]
        else:
            match = [r for r in [next(empty, None)] if r is not None]
        check(bool(match), f"group over {g['params'][:3]} has no counterpart in the uninterrupted run")
        fields = lambda grp: {k: v for k, v in grp.items() if k != "params"}  # noqa: E731
        problems += diff_values(fields(match[0]), fields(g), f"group of {g['params'][:1]}", RTOL)
    fail_if(problems, f"after resharding {src} -> {dst}, training differs from the uninterrupted run")


def _largest(values) -> float:
    """The largest magnitude of the floating-point tensors among ``values`` (nested containers included)."""
    out = 0.0
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
            out = max(out, v.detach().abs().max().item())
        elif isinstance(v, dict):
            out = max(out, _largest(v.values()))
        elif isinstance(v, (list, tuple)):
            out = max(out, _largest(v))
    return out


def resharded_case(clause: str, move: Move, opt: str, mode: Mode | str, lazy: str | None = None) -> Case:
    """Save on the move's source, load on its target; ``lazy``: None, "subset", "aux" or one of ROUTERS."""
    mode = mode_of(mode)
    params = {"src": move.source, "dst": move.target, "opt": opt, "mode": mode, "lazy": lazy}
    return two_phases(case_id(clause, move.name, opt, mode.name, lazy), clause, move, params)


def two_phases(cid: str, clause: str, move: Move, params: dict, source: str | None = None) -> Case:
    """The case that saves on ``move.source`` and loads on ``move.target`` (``params``: both phases')."""
    return Case(
        id=cid,
        clause=clause,
        layout=move,
        phases=(Phase(move.source.world_size, save_phase, params), Phase(move.target.world_size, load_phase, params)),
        deadline_s=90,
        rtol=RTOL,
        meshes=move.mesh_specs,
        mode=params["mode"],
        source=source,
    )


def one_group_if_flat(case: Case) -> Case:
    """FSDP1's flat parameters: the optimizer holds one per unit, so its
    groups cannot go by role: both sides put every parameter in one group."""
    if not any(end.kind.flat_params for end in case.layout.ends):
        return case
    one = GroupSpec(split=False)
    return replace(case, phases=tuple(replace(p, params={**p.params, "groups": one}) for p in case.phases))
