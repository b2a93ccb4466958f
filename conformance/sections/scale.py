"""SPEC §3 Many keys (SCALE, 1.5): the model of thousands of parameters
(:mod:`conformance.world.many_keys`), round-tripped entry by entry in every
mode and layout, and refused at the end of its long columns.

A case compares the target right after the load with the source, every
parameter, state entry and group field (bitwise: nothing is computed in
between, also where the load went to another layout), rather than training
on: one step more would add a forward over thousands of parameters and
compare the same entries. The source of each layout is built, trained and
kept once per rank (as ``resuming.trained_source`` keeps the base model's);
every case builds its own target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kit import (
    FSDP1_FULL,
    GHOST,
    HALVED,
    ONE_RANK,
    REPLICATED,
    STAGES,
    Case,
    Clause,
    GroupSpec,
    Layout,
    Move,
    Phase,
    Setup,
    case_id,
    diff_snapshots,
    expect_error,
    expect_unchanged,
    fail_if,
    full_snapshot,
    make_case,
    many_keys,
    model_group,
    modes,
    moves,
    optimizer_view,
    packed,
    resuming,
    saving,
    snapshot,
    tensors,
    wrong_shape,
)

OPT = "adamw"
# Each (layout, mode, target) a case: every mode, every layout family, fresh
# targets and stepped ones. Not every mode on every layout: a case of thousands
# of keys costs what tens of the other clauses' cases cost (SPEC SCALE-1).
# Two ranks at most, so that each rank has a core of the machine CI runs on.
MATRIX = (
    (ONE_RANK.one(), "full_cpu", False),
    (ONE_RANK.one(), "file", True),
    (REPLICATED.one(), "bcast", False),
    (HALVED.one(), "sharded", True),
    (HALVED.one(), "sharded", False),
    (HALVED.one(), "full", False),
    (HALVED.one(), "flat", True),
    ("hsdp1x2", "bcast", True),  # named: HSDP on two ranks (the catalog's HSDP has four)
    (STAGES.one(), "flat", False),
    (FSDP1_FULL.one(), "sharded", True),
    ("fsdp1-2-flat", "full", False),  # named: FSDP1's flat parameters on two ranks (the catalog's on four)
)
# Through DCP to another layout, as a job resumes on another world.
PAIRS = moves((HALVED, ONE_RANK))
DEADLINE_S = 120


def _build(c, layout: Layout, seed: int) -> Setup:
    groups = GroupSpec.for_seed(seed, cuts=many_keys.CUTS)
    return Setup(c, layout, OPT, seed=seed, cfg=many_keys.config(pipeline=layout.pp > 1), groups=groups)


def _freeze(setup: Setup) -> None:
    """Freeze the lanes of FROZEN this rank holds (a flat parameter freezes
    whole: FSDP1 without its original parameters has none to freeze)."""
    if not setup.layout.kind.flat_params:
        mine = dict(setup.named_parameters())
        setup.freeze([f for f in many_keys.FROZEN if f in mine])


@dataclass
class Source:
    """A rank's kept many-key source and its snapshot (taken once: a copy of
    thousands of tensors costs more than the comparisons that read it)."""

    setup: Setup
    key: tuple
    snap: dict

    def save(self, c, mode: str, **kwargs) -> saving.Saved:
        """``saving.save`` from the source, dropped from the cache where the
        implementation changed it (purity is OPT-PURE's to judge, not here)."""
        saved = saving.save(c, self.setup, mode, batched=True, **kwargs)
        if diff_snapshots(self.snap, snapshot(self.setup, copy=False)):
            c.rank_ctx.cache.pop(self.key, None)
        return saved


def source(c, layout: Layout) -> Source:
    """The many-key model on ``layout``, seed 0, trained a step, then the
    lanes of FROZEN frozen (they keep their state), kept per rank."""
    key = ("many-keys-source", layout)
    (have,) = resuming.kept_everywhere(c, (key,), model_group(c, layout))
    if have:
        return resuming.keep(c, key, c.rank_ctx.cache[key])
    setup = _build(c, layout, 0)
    setup.train(1)
    _freeze(setup)
    return resuming.keep(c, key, Source(setup, key, snapshot(setup)))


def target(c, layout: Layout, warm: bool, like: Source) -> Setup:
    """Another model (seed 1: other values and hyperparameters) of the same
    structure; ``warm``: with optimizer state of its own (:func:`own_state`),
    so that the load lands in state tensors it has."""
    b = _build(c, layout, 1)
    if warm:
        own_state(b, like.snap["state"])
    _freeze(b)
    return b


def own_state(setup: Setup, state: dict) -> None:
    """State of its own for each parameter that has some in ``state`` (the
    source's, on this rank: the entries a step leaves, shaped and laid out
    as the optimizer makes them), each value half the source's and each
    ``step`` five more; none for the lanes of FROZEN, as if the target had
    frozen them from the start: the load creates their state, beside the
    others' copied in place. Made in place of training a step: a forward and
    backward over thousands of parameters, and a step over them, cost more
    than the rest of a case."""
    params = dict(setup.named_parameters())
    opt = setup.optimizers[0]
    for fqn, entry in state.items():
        if fqn in many_keys.FROZEN:
            continue
        own = {}
        for key, value in entry.items():
            value = tensors.copied(value)
            if key == "step":
                value += 5
            else:
                tensors.local(value).mul_(0.5)
            own[key] = value
        opt.state[params[fqn]] = own


def scale_1(c, layout, mode, warm):
    """get in ``mode`` (model and optimizer through the implementation), set
    into another model of the same layout: every entry equals the source's."""
    kept = source(c, layout)
    saved = kept.save(c, mode, model="iut")
    b = target(c, layout, warm, kept)
    saving.load(c, b, saved, again=False)
    fail_if(
        diff_snapshots(*saving.comparable(mode, b, kept.snap, snapshot(b, copy=False))),
        f"{mode}: after loading the state of {_count(kept.setup)} parameters into a "
        f"{'stepped' if warm else 'fresh'} target, it differs from the source",
    )


def _count(setup: Setup) -> int:
    return len(setup.named_parameters())


def save_phase(c, src, dst):
    """Through DCP on ``src``; every rank's reference is the source's full state."""
    kept = source(c, src)
    kept.save(c, "dcp", model="iut")
    reference = full_snapshot(kept.setup)
    if c.rank == 0:
        torch.save(packed.pack(reference), c.path("reference.pt"))


def load_phase(c, src, dst):
    b = _build(c, dst, 1)
    _freeze(b)
    mode = modes.DCP.on(src.pp > 1)
    saving.load(c, b, saving.Saved(mode, path=c.path(f"dcp-{mode}"), batched=True))
    reference = packed.unpack(saving.read_full(c.path("reference.pt")))
    got = full_snapshot(b)
    want = {
        "params": {k: v for k, v in reference["params"].items() if k in got["params"]},
        "state": {k: v for k, v in reference["state"].items() if k in got["params"]},
        "groups": [g for g in reference["groups"] if set(g["params"]) & set(got["params"])],
    }
    problems = diff_snapshots(want, got, parts=("params", "state"))
    problems += _group_fields(want["groups"], got["groups"])
    fail_if(problems, f"after loading {src}'s state on {dst} through DCP, it differs from the source")


def _group_fields(want: list, got: list) -> list[str]:
    """Each group's fields against those of the reference's group that holds
    its first parameter (pipeline stages group their own parameters)."""
    problems = []
    for g in got:
        match = [w for w in want if g["params"] and g["params"][0] in w["params"]]
        if not match:
            problems.append(f"the group of {g['params'][:1]}: no group of the source holds it")
            continue
        for k, v in match[0].items():
            if k != "params" and g.get(k) != v:
                problems.append(f"the group of {g['params'][:1]}: {k} {g.get(k)!r}, expected {v!r}")
    return problems


def resharded_case(moved: Move) -> Case:
    """Saved through DCP on the move's source, loaded into a fresh target on its target, as a job resumes on
    another layout."""
    params = {"src": moved.source, "dst": moved.target}
    return Case(
        id=case_id("SCALE-1", moved.name, OPT, modes.DCP.name),
        clause="SCALE-1",
        layout=moved,
        phases=(Phase(moved.source.world_size, save_phase, params), Phase(moved.target.world_size, load_phase, params)),
        deadline_s=DEADLINE_S,
        meshes=moved.mesh_specs,
        mode=modes.DCP,
    )


# -- SCALE-2: one bad entry where a long column ends, or a later group starts ------------------

KINDS = ("wrong_shape", "wrong_dtype", "unknown_fqn", "missing_fqn", "partial_entry")
PLACES = ("column_end", "group_start")
# Every kind, every place (two kinds at both); nested and flat sets, full and broadcast ones; sharded layouts, FSDP1.
REFUSALS = (
    (ONE_RANK.one(), "sharded", "wrong_shape", "column_end"),
    (ONE_RANK.one(), "flat", "unknown_fqn", "group_start"),
    (ONE_RANK.one(), "full", "partial_entry", "column_end"),
    (HALVED.one(), "sharded", "wrong_dtype", "group_start"),
    (HALVED.one(), "flat", "missing_fqn", "column_end"),
    (HALVED.one(), "bcast", "wrong_shape", "group_start"),
    (FSDP1_FULL.one(), "sharded", "missing_fqn", "group_start"),
)


def _place(b: Setup, place: str) -> str:
    """The FQN at ``place`` among this rank's trained parameters with state:
    the last of the longest group's, or the first of the group after it."""
    opt = b.optimizers[0]
    fqn_of = b.fqn_of()
    groups = [[fqn_of[p] for p in g["params"] if p.requires_grad and opt.state.get(p)] for g in opt.param_groups]
    longest = max(range(len(groups)), key=lambda i: len(groups[i]))
    if place == "column_end" or longest + 1 == len(groups):
        return groups[longest][-1]
    return groups[longest + 1][0]


def _spoil(osd: dict, kind: str, fqn: str, place: str, flat: bool) -> list[str]:
    """Damage ``osd`` at ``fqn`` in one way; returns what the error must name."""
    if kind in ("wrong_shape", "wrong_dtype"):
        key = f"state.{fqn}.exp_avg" if flat else None
        value = osd[key] if flat else osd["state"][fqn]["exp_avg"]
        value = wrong_shape(value) if kind == "wrong_shape" else tensors.to_dtype(value, torch.int64)
        if flat:
            osd[key] = value
        else:
            osd["state"][fqn]["exp_avg"] = value
        return [fqn, "exp_avg"]
    if kind == "partial_entry":
        if flat:
            del osd[f"state.{fqn}.exp_avg_sq"]
        else:
            del osd["state"][fqn]["exp_avg_sq"]
        return [fqn, "exp_avg_sq"]
    if kind == "missing_fqn":
        if flat:
            for key in [k for k in osd if k.startswith((f"state.{fqn}.", f"param_groups.{fqn}."))]:
                del osd[key]
        else:
            del osd["state"][fqn]
            for group in osd["param_groups"]:
                group["params"] = [f for f in group["params"] if f != fqn]
        return [fqn]
    if kind == "unknown_fqn":
        _add_ghost(osd, fqn, after=place == "column_end", flat=flat)
        return [GHOST]
    raise ValueError(kind)


def _add_ghost(osd: dict, fqn: str, after: bool, flat: bool) -> None:
    """A parameter the model does not have, with AdamW's state, right after
    ``fqn`` (``after``) or right before it, in the state and in its group."""
    entry = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    if flat:
        fields = {k.rpartition(".")[2]: v for k, v in osd.items() if k.startswith(f"param_groups.{fqn}.")}
        ghost = {f"state.{GHOST}.{k}": v for k, v in entry.items()}
        ghost.update({f"param_groups.{GHOST}.{k}": v for k, v in fields.items()})
        keys = list(osd)
        mine = [i for i, k in enumerate(keys) if k.startswith((f"state.{fqn}.", f"param_groups.{fqn}."))]
        at = mine[-1] + 1 if after else mine[0]
        items = list(osd.items())
        osd.clear()
        osd.update(items[:at] + list(ghost.items()) + items[at:])
        return
    state = list(osd["state"].items())
    at = [k for k, _ in state].index(fqn) + (1 if after else 0)
    osd["state"] = dict(state[:at] + [(GHOST, entry)] + state[at:])
    for group in osd["param_groups"]:
        if fqn in group["params"]:
            i = group["params"].index(fqn) + (1 if after else 0)
            group["params"] = group["params"][:i] + [GHOST] + group["params"][i:]


def scale_2(c, layout, mode, kind, place):
    """A strict set of the many-key state with one bad entry at ``place``:
    refused on every rank, naming it; the target's optimizer unchanged."""
    kept = source(c, layout)
    saved = kept.save(c, mode, model=None)
    b = target(c, layout, True, kept)
    root = not mode.broadcast or b.is_root
    osd = {}
    if saved.path:
        osd = saving.read_full(saved.path)["optim"] if root else {}
    elif root:
        osd = saved.optim
    fqn = _place(b, place)
    names = _spoil(osd, kind, fqn, place, flat=mode.flat) if root else []
    before = optimizer_view(b)
    what = f"SCALE-2: {mode} set of {_count(b)} parameters' state with {kind.replace('_', ' ')} at {fqn}"
    expect_error(lambda: _set(c, b, mode, osd), names=names, what=what)
    expect_unchanged(before, optimizer_view(b), f"{what}: the refused set changed the optimizer")


def _set(c, b: Setup, mode: str, osd: dict) -> None:
    opts = saving.set_options(c.iut, mode, strict=True)
    c.iut.set_optimizer_state_dict(b.model, saving.optimizers_arg(b), osd, options=opts)


def cases():
    for layout, mode, warm in MATRIX:
        yield make_case(
            "SCALE-1",
            layout,
            scale_1,
            opt=OPT,
            mode=mode,
            variant="into_stepped" if warm else "into_new",
            warm=warm,
            deadline_s=DEADLINE_S,
        )
    for moved in PAIRS:
        yield resharded_case(moved)
    for layout, mode, kind, place in REFUSALS:
        yield make_case(
            "SCALE-2",
            layout,
            scale_2,
            mode=mode,
            variant=f"{kind}-{place}",
            kind=kind,
            place=place,
            deadline_s=DEADLINE_S,
        )


CLAUSES = {
    "SCALE-1": Clause(),
    "SCALE-2": Clause(),
}
