"""SPEC §3 Validation and atomicity (OPT-ATOM): check everything, on every
rank, before changing anything."""

from __future__ import annotations

import torch

from ..kit import (
    BASE,
    DATA_PARALLEL,
    ENDS,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
    FSDP1_HYBRID,
    GHOST,
    HALVED,
    HYBRID,
    ONE_RANK,
    QUARTERS,
    SHARDED,
    STAGES,
    Clause,
    GroupSpec,
    Setup,
    canonical,
    check,
    clone_tree,
    expect_error,
    expect_unchanged,
    get_options,
    grid,
    make_case,
    optimizer_view,
    optimizers_arg,
    saving,
    set_options,
    snapshot,
    wrong_shape,
)

TARGET = "layers.1.fc1.weight"  # a parameter every layout's rank 0 ... (pp: stage 0) holds


def _source(c, layout, mode):
    """A trained setup's state dict, and a stepped target to load it into."""
    a = Setup(c, layout, "adamw")
    a.train(2)
    if mode.every_rank_reads:  # every rank reads the file rank 0 saved (a full_cpu get)
        osd = saving.read_full(saving.save(c, a, mode, model=None).path)["optim"]
    else:
        osd = clone_tree(c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, mode)))
    b = Setup(c, layout, "adamw", seed=1)
    b.train(1)
    return osd, b


def _owned(b) -> str:
    """A parameter this rank's optimizer holds state for (by original
    parameter: FSDP1's flat parameters hold several)."""
    if b.layout.kind.flat_params:
        return TARGET  # every flat parameter holds state for all of its parts on every rank
    names = [f for f, p in b.named_parameters() if b.optimizers[0].state.get(p)]
    return TARGET if TARGET in names else names[0]


def _corrupt(osd, kind: str, fqn: str, flat: bool):
    """Damage ``osd`` in one way; returns the names the error must mention."""
    if kind == "unknown_fqn":
        if flat:
            osd[f"state.{GHOST}.exp_avg"] = torch.zeros(3)
            osd[f"param_groups.{GHOST}.lr"] = 0.1
        else:
            osd["state"][GHOST] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3)}
            osd["param_groups"][0]["params"].append(GHOST)
        return [GHOST]
    if kind == "unknown_group":
        osd["param_groups"].append(
            {**{k: v for k, v in osd["param_groups"][0].items() if k != "params"}, "params": [GHOST]}
        )
        return [GHOST]
    if kind == "wrong_shape":
        key = f"state.{fqn}.exp_avg" if flat else None
        if flat:
            value = osd[key]
            osd[key] = wrong_shape(value)
        else:
            osd["state"][fqn]["exp_avg"] = wrong_shape(osd["state"][fqn]["exp_avg"])
        return [fqn, "exp_avg"]
    if kind == "non_tensor":
        if flat:
            osd[f"state.{fqn}.exp_avg"] = "garbage"
        else:
            osd["state"][fqn]["exp_avg"] = "garbage"
        return [fqn, "exp_avg"]
    if kind == "no_state":
        del osd["state"]
        return ["state"]
    if kind == "group_without_params":
        del osd["param_groups"][0]["params"]
        return ["params"]
    raise ValueError(kind)


def atom_bad_input(c, layout, mode, kind, which):
    osd, b = _source(c, layout, mode)
    fqn = _owned(b)
    names = _corrupt(osd, kind, fqn, flat=mode.flat)
    before = optimizer_view(b)
    expect_error(
        lambda: c.iut.set_optimizer_state_dict(
            b.model, optimizers_arg(b), osd, options=set_options(c.iut, mode, strict=True)
        ),
        names=names,
        what=f"{which}: set with {kind.replace('_', ' ')}",
    )
    expect_unchanged(before, optimizer_view(b), f"{which}: the failed set changed the optimizer")


def _fields(group: dict) -> dict:
    return {k: v for k, v in group.items() if k != "params"}


def _regroup(osd: dict, kind: str, b) -> list[str]:
    """Give a nested checkpoint one group more or fewer than the target ``b``;
    returns the names that identify the odd group (any one will do)."""
    groups = osd["param_groups"]
    if kind == "extra_empty_group":
        groups.insert(1, {**_fields(groups[0]), "params": [], "name": "ghost_group"})
        return ["param_groups[1]", "ghost_group"]
    if kind == "missing_empty_group":  # the target has an empty group at 1, the checkpoint none
        return ["param_groups[1]", b.optimizers[0].param_groups[1].get("name", "param_groups[1]")]
    if kind == "extra_group":  # one parameter of the largest group moved to a group of its own
        big = max(range(len(groups)), key=lambda j: len(groups[j]["params"]))
        moved = groups[big]["params"].pop()
        groups.append({**_fields(groups[big]), "params": [moved], "name": "split_off"})
        return [f"param_groups[{len(groups) - 1}]", "split_off"]
    if kind == "missing_group":  # the last group merged into the one before it
        last = groups.pop()
        groups[-1]["params"] = groups[-1]["params"] + last["params"]
        return [f"param_groups[{len(groups) - 1}]", f"param_groups[{len(groups)}]"]
    raise ValueError(kind)


def _regroup_flat(osd: dict, kind: str, b) -> list[str]:
    """The flat layout has no list of groups: its groups follow the parameters.
    One group more: a parameter whose group fields differ from the rest of
    its group; one fewer: no key at all for the parameters of the last group."""
    fqn_of = b.fqn_of()
    groups = [[fqn_of[p] for p in g["params"]] for g in b.optimizers[0].param_groups]
    if kind == "extra_group":
        odd = max(groups, key=len)[-1]
        osd[f"param_groups.{odd}.lr"] = osd[f"param_groups.{odd}.lr"] * 2
        return [odd]
    if kind == "missing_group":
        gone = [g for g in groups if g][-1]
        for key in [k for k in osd if any(k.startswith((f"state.{f}.", f"param_groups.{f}.")) for f in gone)]:
            del osd[key]
        return gone
    raise ValueError(kind)


def atom_1_groups(c, layout, mode, kind):
    """A checkpoint with more or fewer param groups than the target, empty groups
    counted: strict set raises naming the group; nothing changes."""
    a = Setup(c, layout, "adamw")
    a.train(2)
    osd = clone_tree(c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, mode)))
    target_groups = GroupSpec.for_seed(1, empty_at=(1,)) if kind == "missing_empty_group" else None
    b = Setup(c, layout, "adamw", seed=1, groups=target_groups)
    b.train(1)
    names = (_regroup_flat if mode.flat else _regroup)(osd, kind, b)
    before = optimizer_view(b)
    exc = expect_error(
        lambda: c.iut.set_optimizer_state_dict(
            b.model, optimizers_arg(b), osd, options=set_options(c.iut, mode, strict=True)
        ),
        what=f"OPT-ATOM-1: set with {kind.replace('_', ' ')} (strict=True)",
    )
    check(any(n in str(exc) for n in names), f"OPT-ATOM-1: the error names none of {names}: {str(exc)[:600]}")
    expect_unchanged(before, optimizer_view(b), "OPT-ATOM-1: the failed set changed the optimizer")


GROUP_KINDS = {
    "sharded": ("extra_empty_group", "missing_empty_group", "extra_group", "missing_group"),
    "flat": ("extra_group", "missing_group"),  # empty groups do not travel in the flat layout (OPT-EMPTY-2)
}


def atom_1_dcp_groups(c, layout, kind):
    """Through DCP (the target's get as the template, the documented load
    planner, strict set): a checkpoint with an empty group more than the
    target, or one fewer. The template has no key for the extra group and the
    checkpoint none for the missing one, so only a load path that compares
    the two can tell; nothing changes."""
    last = (99,)  # after every other group
    a = Setup(c, layout, "adamw", groups=GroupSpec.for_seed(0, empty_at=last) if kind == "extra_empty_group" else None)
    a.train(2)
    saved = saving.save(c, a, "dcp", model=None)
    b = Setup(
        c,
        layout,
        "adamw",
        seed=1,
        groups=GroupSpec.for_seed(1, empty_at=last) if kind == "missing_empty_group" else None,
    )
    b.train(1)
    odd = max(len(a.optimizers[0].param_groups), len(b.optimizers[0].param_groups)) - 1
    before = optimizer_view(b)
    expect_error(
        lambda: saving.load(c, b, saved, model=False),
        names=[f"param_groups.{odd}"],
        what=f"OPT-ATOM-1: DCP load with {kind.replace('_', ' ')} (strict=True)",
    )
    expect_unchanged(before, optimizer_view(b), "OPT-ATOM-1: the failed load changed the optimizer")


def atom_3(c, layout, target):
    """broadcast_from_rank0 without full_state_dict: ValueError, before any collective."""
    b = Setup(c, layout, "adamw")
    b.train(1)
    before = optimizer_view(b)
    opts = c.iut.options(broadcast_from_rank0=True, full_state_dict=False)
    # The input is the suite's own (FQN-keyed, as SPEC §1 shapes it), so the
    # check is reached whatever modes the implementation supports.
    snap = snapshot(b)
    if target == "optim":
        osd = {"state": snap["state"], "param_groups": snap["groups"]}
        call = lambda: c.iut.set_optimizer_state_dict(b.model, optimizers_arg(b), osd, options=opts)  # noqa: E731
    else:
        msd = {canonical(k): v for k, v in clone_tree(b.module.state_dict()).items()}
        call = lambda: c.iut.set_model_state_dict(b.model, msd, options=opts)  # noqa: E731
    seq = c.rank_ctx.collectives_issued()
    exc = expect_error(call, what="OPT-ATOM-3: contradictory options")
    check(isinstance(exc, ValueError), f"OPT-ATOM-3: raised {type(exc).__name__}, expected ValueError: {exc}")
    issued = c.rank_ctx.collectives_issued() - seq
    check(issued == 0, f"OPT-ATOM-3: {issued} collective(s) were issued before the error")
    expect_unchanged(before, optimizer_view(b), "OPT-ATOM-3: the failed set changed the optimizer")


def atom_4(c, layout, mode):
    """Bad input on one rank only: every rank raises, none is left waiting, nothing changes."""
    osd, b = _source(c, layout, mode)
    bad_rank = 0 if mode.broadcast else c.world_size - 1
    if mode.broadcast and c.rank != 0:
        osd = {}
    if c.rank == bad_rank:
        fqn = _owned(b)
        if mode.broadcast:
            # A bad tensor in the middle of rank 0's dict.
            keys = list(osd["state"])
            fqn = keys[len(keys) // 2]
            osd["state"][fqn]["exp_avg"] = wrong_shape(osd["state"][fqn]["exp_avg"])
        else:
            _corrupt(osd, "wrong_shape", fqn, flat=mode.flat)
    before = optimizer_view(b)
    expect_error(
        lambda: c.iut.set_optimizer_state_dict(b.model, optimizers_arg(b), osd, options=set_options(c.iut, mode)),
        what=f"OPT-ATOM-4: rank {bad_rank} had a bad value; rank {c.rank}",
    )
    expect_unchanged(
        before, optimizer_view(b), f"OPT-ATOM-4: rank {c.rank} changed its optimizer although the load failed"
    )


def _bad(clause: str, layout, mode: str, kind: str):
    """A case of ``clause`` setting a dict with one bad input of ``kind``."""
    return make_case(clause, layout, atom_bad_input, mode=mode, variant=kind, kind=kind, which=clause)


def cases():
    # The consolidated file (SPEC §2 ``file``): what a full-state-only library loads.
    for layout in ENDS:
        yield _bad("OPT-ATOM-1", layout, "file", "unknown_fqn")
        for kind in ("wrong_shape", "non_tensor"):
            yield _bad("OPT-ATOM-2", layout, "file", kind)
    yield from grid("OPT-ATOM-4", HALVED | QUARTERS, atom_4, modes=("file",), deadline_s=30)
    for layout in ENDS | HYBRID | STAGES:
        for mode in ("sharded", "flat"):
            yield _bad("OPT-ATOM-1", layout, mode, "unknown_fqn")
        yield _bad("OPT-ATOM-1", layout, "sharded", "unknown_group")
    for layout in ENDS | STAGES:
        for mode, kinds in GROUP_KINDS.items():
            for kind in kinds:
                yield make_case("OPT-ATOM-1", layout, atom_1_groups, mode=mode, variant=kind, kind=kind)
    # Nested through DCP (pipelines go flat, without empty groups).
    dcp_kinds = {kind: {"kind": kind} for kind in ("extra_empty_group", "missing_empty_group")}
    yield from grid("OPT-ATOM-1", ENDS, atom_1_dcp_groups, modes=("dcp",), variants=dcp_kinds)
    for layout in ONE_RANK | SHARDED - HALVED:
        for mode in ("sharded", "flat", "full"):
            yield _bad("OPT-ATOM-2", layout, mode, "wrong_shape")
            yield _bad("OPT-ATOM-2", layout, mode, "non_tensor")
        for kind in ("no_state", "group_without_params"):
            yield _bad("OPT-ATOM-2", layout, "sharded", kind)
    for layout in FSDP1_FULL_SHARD | FSDP1_HYBRID:  # FSDP1 (SPEC §2, 1.3)
        for mode in ("sharded", "full"):
            yield _bad("OPT-ATOM-1", layout, mode, "unknown_fqn")
            # (OPT-ATOM-2's bad value goes under the FQN of one of the optimizer's parameters: a flat one has none)
            for kind in ("wrong_shape", "non_tensor") if not layout.kind.flat_params else ():
                yield _bad("OPT-ATOM-2", layout, mode, kind)
    targets = {target: {"target": target} for target in ("optim", "model")}
    yield from grid("OPT-ATOM-3", DATA_PARALLEL | HALVED | STAGES | FSDP1_FULL, atom_3, variants=targets, deadline_s=30)
    yield from grid(
        "OPT-ATOM-4",
        BASE - ONE_RANK | FSDP1_FULL_SHARD,
        atom_4,
        modes=("sharded", "full", "flat", "bcast"),
        deadline_s=30,
    )


CLAUSES = {
    "OPT-ATOM-1": Clause(),
    "OPT-ATOM-2": Clause(),
    "OPT-ATOM-3": Clause(side="load", options=("options_type",)),
    "OPT-ATOM-4": Clause(),
}
