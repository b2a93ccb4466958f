"""SPEC §3 Resharding (OPT-RESHARD): save on one layout, load on another.

Each case has two phases on two worlds. The first trains on layout A,
saves, trains on and writes the uninterrupted run's full state (every
rank's part, gathered) as the reference; the second loads on layout B,
trains as many steps and compares with the reference (tolerance 1e-6
relative: reductions over other numbers of ranks round differently; the
models are float64 so that only that rounding shows).

Parameters the checkpoint has no state for (``lazy``) must stay without
state in the never-stepped target (OPT-RESHARD-2, and OPT-PART-5's
resharded cases). The target's optimizer is built as a resuming job builds
it, with the same param groups as the source's: through DCP, nothing
relaxed, a template group the checkpoint lacks cannot load. So
OPT-RESHARD-2's source covers every parameter in its optimizer and freezes
those outside the layers (they never get state), rather than leaving them
out of its optimizer (which would leave a group out).
"""

from __future__ import annotations

import glob
from dataclasses import replace

import torch
import torch.distributed as dist

from ..judging.oracle import check, diff_values, fail_if, full_snapshot
from ..running.cases import Case, Phase, case_id
from ..running.clauses import Clause
from ..world import modes
from ..world.catalog import (
    FSDP1_FLAT_PARAMS,
    FSDP1_FULL,
    FSDP1_HYBRID,
    HALVED,
    HYBRID,
    ONE_RANK,
    QUARTERS,
    SHARDED_STAGES,
    STAGES,
    THIRDS,
    moves,
)
from ..world.layouts import parse_layout
from ..world.models import GroupSpec, ModelConfig
from ..world.modes import Saved
from ..world.setup import Setup

BEFORE, AFTER = 1, 1
# Models here are float64. Another world size sums gradients in another
# order: the base model differs by 1e-12 or so; the tiny models exploration
# draws (one feature, one hidden unit) amplify it to a few 1e-6. A load that
# loses or misplaces state differs by far more.
RTOL = 1e-6
only_layers = lambda fqn: fqn.startswith("layers.")  # noqa: E731


ROUTERS = ("shared", "group")  # OPT-PART-5: routers in groups with others, or in their own


def _setup(c, layout: str, opt: str, seed: int, lazy: str | None, cfg=None, groups=None) -> Setup:
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


def _mode_on(layout: str, kind: str) -> str:
    if kind == "bcast":
        return "bcast"
    return "flat_dcp" if parse_layout(layout).pp > 1 else "dcp"


def save_phase(c, src, dst, opt, kind, lazy=None, cfg=None, groups=None):
    a = _setup(c, src, opt, 0, lazy, cfg, groups)
    if lazy == "subset":
        a.freeze([f for f, _ in a.named_parameters() if not only_layers(f)])
    a.train(BEFORE)
    modes.save(c, a, _mode_on(src, kind), model=None)
    modes.save_reference_model(c, a)
    a.train(AFTER)
    torch.save(full_snapshot(a), c.path(f"reference-rank{c.rank}.pt"))


def _reference(c) -> dict:
    ref = {"params": {}, "state": {}, "groups": []}
    for path in sorted(glob.glob(c.path("reference-rank*.pt"))):
        part = modes.read_full(path)
        ref["params"].update(part["params"])
        ref["state"].update(part["state"])
        ref["groups"].extend(g for g in part["groups"] if g not in ref["groups"])
    return ref


def load_phase(c, src, dst, opt, kind, lazy=None, cfg=None, groups=None):
    b = _setup(c, dst, opt, 1, lazy, cfg, groups)
    b.set_steps_done(BEFORE)
    saved = Saved(
        _mode_on(src, kind), path=c.path("full.pt") if kind == "bcast" else c.path(f"dcp-{_mode_on(src, kind)}")
    )
    modes.load_reference_model_from(c, b)
    modes.load(c, b, saved, model=False)
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


def resharded_case(clause, src, dst, opt, kind, lazy=None) -> Case:
    """Save on ``src``, load on ``dst``; ``lazy``: None, "subset", "aux" or one of ROUTERS."""
    params = {"src": src, "dst": dst, "opt": opt, "kind": kind, "lazy": lazy}
    return _two_phases(case_id(clause, f"{src}_to_{dst}", opt, kind, lazy), clause, params)


def _two_phases(cid: str, clause: str, params: dict, source: str | None = None) -> Case:
    """The case that saves on ``params["src"]`` and loads on ``params["dst"]``."""
    a, b = parse_layout(params["src"]), parse_layout(params["dst"])
    return Case(
        id=cid,
        clause=clause,
        layout=f"{params['src']}_to_{params['dst']}",
        phases=(Phase(a.world_size, save_phase, params), Phase(b.world_size, load_phase, params)),
        deadline_s=90,
        rtol=RTOL,
        meshes=tuple(dict.fromkeys(a.mesh_specs + b.mesh_specs)),
        mode=params["kind"],
        source=source,
    )


PAIRS = moves(
    (QUARTERS, HALVED),  # to fewer ranks
    (HALVED, QUARTERS),  # to more, one of them with an empty piece
    (QUARTERS, THIRDS),  # to uneven pieces
    (HYBRID, HALVED),  # from a 2-D mesh to a 1-D one
    (QUARTERS, HYBRID),  # and back
    (HALVED, ONE_RANK),  # to one rank
    (ONE_RANK, QUARTERS),  # from one rank
    (SHARDED_STAGES, STAGES),  # pipeline stages, sharded to whole
)
# FSDP1 and FSDP2 through DCP, both ways (SPEC §2, 1.3).
FSDP1_PAIRS = moves(
    (FSDP1_FLAT_PARAMS, QUARTERS),
    (QUARTERS, FSDP1_FLAT_PARAMS),
    (QUARTERS, FSDP1_FULL),
    (FSDP1_FULL, HALVED),
    (HALVED, FSDP1_FULL),
)
# Parameters outside the optimizer's subset (lazy): to fewer ranks and more, to a 2-D mesh, to FSDP1.
LAZY_PAIRS = moves((QUARTERS, HALVED), (HALVED, QUARTERS), (ONE_RANK, HYBRID), (QUARTERS, FSDP1_FULL))
# A broadcast set of what another layout saved.
BCAST_PAIRS = moves(
    (QUARTERS, HALVED),
    (HALVED, HYBRID),
    (ONE_RANK, THIRDS),
    (QUARTERS, SHARDED_STAGES),
    (SHARDED_STAGES, QUARTERS),
    (HYBRID, ONE_RANK),
    (HALVED, FSDP1_FLAT_PARAMS),
    (FSDP1_FULL, FSDP1_HYBRID),
)


def cases():
    for src, dst in PAIRS:
        for opt in ("adamw", "sgd"):
            yield resharded_case("OPT-RESHARD-1", src, dst, opt, "dcp")
    for src, dst in FSDP1_PAIRS:
        for opt in ("adamw", "sgd"):
            yield one_group_if_flat(resharded_case("OPT-RESHARD-1", src, dst, opt, "dcp"))
    for src, dst in LAZY_PAIRS:
        yield resharded_case("OPT-RESHARD-2", src, dst, "adamw", "dcp", lazy="subset")
    # A parameter the checkpoint lists without state (lazy), loaded where a
    # rank holds an empty piece of it (four ranks: aux has 3 rows). SGD keeps no
    # step, so that rank's template entry has nothing it could tell written
    # from unwritten by: it must go by the other ranks.
    yield resharded_case("OPT-RESHARD-2", HALVED.one(), QUARTERS.one(), "sgd", "dcp", lazy="aux")
    for src, dst in BCAST_PAIRS:
        yield one_group_if_flat(resharded_case("OPT-RESHARD-3", src, dst, "adamw", "bcast"))


def one_group_if_flat(case: Case) -> Case:
    """FSDP1's flat parameters: the optimizer holds one per unit, so its
    groups cannot go by role: both sides put every parameter in one group."""
    params = case.phases[0].params
    if not any(parse_layout(params[end]).kind.flat_params for end in ("src", "dst")):
        return case
    one = GroupSpec(split=False)
    return replace(case, phases=tuple(replace(p, params={**p.params, "groups": one}) for p in case.phases))


def _explored(s, clause: str, cid: str, source: str) -> Case:
    """Save on the scenario's layout, load on ``reshard_to``: this section's two phases."""
    params = {"src": s.where, "dst": s.reshard_to, "opt": s.optimizer, "kind": s.mode}
    return _two_phases(cid, clause, params | {"cfg": s.cfg(), "groups": s.groups()}, source)


CLAUSES = {
    "OPT-RESHARD-1": Clause(
        contains=lambda s: bool(s.reshard_to) and s.mode == "dcp",
        build=lambda s, case_id, source: _explored(s, "OPT-RESHARD-1", case_id, source),
        rank=170,
    ),
    "OPT-RESHARD-2": Clause(),
    "OPT-RESHARD-3": Clause(
        contains=lambda s: bool(s.reshard_to) and s.mode == "bcast",
        build=lambda s, case_id, source: _explored(s, "OPT-RESHARD-3", case_id, source),
        rank=180,
    ),
}
