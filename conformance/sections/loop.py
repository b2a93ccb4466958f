"""SPEC §3 Training loops (LOOP): gets and sets where loops take them, and the FSDP2 policies."""

from __future__ import annotations

import torch

from ..kit import (
    DATA_PARALLEL,
    FSDP1_FULL_SHARD,
    FSDP1_SHARD_GRAD_OP,
    HALVED,
    HYBRID,
    MODES,
    QUARTERS,
    SHARDED_STAGES,
    Clause,
    Layout,
    diff_snapshots,
    diff_values,
    fail_if,
    grads_view,
    grid,
    loops,
    make_case,
    modes,
    nested,
    policies,
    resuming,
    saving,
    snapshot,
    tensors,
)

# Every layout runs every mode and each of its points (the point rotates with the mode).
LOOP_LAYOUTS = DATA_PARALLEL | HALVED | SHARDED_STAGES
BEFORE, AFTER = 1, 1
WARM = 2


def _sharding_changes(before: list, after: list) -> list[str]:
    if before == after:
        return []
    was = {(m, n): i for m, n, i in before}
    now = {(m, n): i for m, n, i in after}
    changed = [f"{m or '<root>'}.{n}" for (m, n) in was if now.get((m, n)) != was[(m, n)]]
    return [f"the module now holds another tensor as {name!r}" for name in changed[:6]] or ["parameters added or gone"]


def _dicts(c, setup, saved: saving.Saved) -> tuple | None:
    """The model and optimizer dicts a save holds (None for DCP, whose checkpoint only a resume reads
    back: the resume judges those)."""
    if saved.mode.through_dcp:
        return None
    if saved.mode.on_root and not setup.is_root:
        # Whatever a get gave a rank other than the root ({} or the empty
        # structure), there is nothing of the state there to compare; OPT-RT-3
        # judges what it gave. A file is the root's alone.
        return {}, {}
    if saved.path:  # bcast, file: the root's file
        data = saving.read_full(saved.path)
        return data.get("model"), data.get("optim")
    return saved.model, saved.optim


def loop_1(c, layout, mode, point, before=BEFORE, after=AFTER, how=None):
    """A get at a point of the loop returns what a get right after the step
    returns, changes nothing (parameters, gradients, optimizer, the modules'
    sharding state), and the loop goes on as if it had not happened; the
    checkpoint it gave resumes like the uninterrupted run. ``how``: the
    recipe to build (a generated scenario's), instead of the base model."""
    pt = loops.POINTS[point]
    how = how or resuming.recipe(layout, "adamw")
    expected = loops.uninterrupted(c, how, before, pt, after)
    ref = None
    if not mode.through_dcp:  # a get right after the step, to compare with; DCP's the resume judges
        at_rest = resuming.trained_source(c, how, before)
        ref = _dicts(c, at_rest.setup, at_rest.save(c, modes.mode_of(mode.get), model="iut"))

    a = how.build(c, 0)
    a.train(before)
    loops.reach(a, pt)
    was, grads, sharding = snapshot(a), grads_view(a), loops.sharding_state(a)
    saved = saving.save(c, a, mode, model="iut")
    fail_if(diff_snapshots(was, snapshot(a)), f"{mode}: a get {pt.what} changed the parameters or the optimizer")
    fail_if(diff_values(grads, grads_view(a), "grad"), f"{mode}: a get {pt.what} changed the gradients")
    fail_if(
        _sharding_changes(sharding, loops.sharding_state(a)),
        f"{mode}: a get {pt.what} changed the modules' sharding state (resharded or unsharded them)",
    )
    got = _dicts(c, a, saved)
    if ref is not None:
        fail_if(
            diff_values(ref[0], got[0], "model") + diff_values(ref[1], got[1], "optim"),
            f"{mode}: a get {pt.what} differs from a get right after the step",
        )
    loops.finish(a, pt)
    a.train(after - 1)
    fail_if(
        diff_snapshots(expected, snapshot(a)), f"{mode}: the loop after a get {pt.what} differs from the run without it"
    )

    b = how.build(c, 1)
    b.set_steps_done(before)
    saving.load(c, b, saved)
    with c.after_iut(b.model, "the step after the load"):
        pt.replay(b)
    b.train(after - 1)
    fail_if(
        diff_snapshots(*saving.comparable(mode, b, expected, snapshot(b))),
        f"{mode}: resuming from a checkpoint taken {pt.what} differs from the uninterrupted run",
    )


def loop_2(c, layout, mode, point, before=BEFORE, after=AFTER, warm=WARM, how=None):
    """A rollback at a point of the loop: a set into a target that trained on
    its own and stopped there; the loop drops the step it was in, and the
    next steps use the loaded values (no stale unsharded copy survives)."""
    pt = loops.POINTS[point]
    how = how or resuming.recipe(layout, "adamw")
    kept = resuming.trained_source(c, how, before, after=after)
    saved = kept.save(c, mode, model="iut")
    b = how.build(c, 1)
    resuming.warm_up(b, warm)
    loops.reach(b, pt)
    saving.load(c, b, saved)
    with c.after_iut(b.model, "dropping the interrupted step"):
        pt.abandon(b)
    b.set_steps_done(before)
    b.train(after)
    fail_if(
        diff_snapshots(*saving.comparable(mode, b, kept.expected, snapshot(b))),
        f"{mode}: after a set {pt.what}, the run differs from the uninterrupted one from the checkpoint",
    )


def _kinds(state, params: dict, where: str, *, local: bool) -> list[str]:
    """Where a tensor of ``state`` (by FQN) is not of its parameter's dtype
    (the sharded parameter's, not the compute dtype), or, with ``local``, not
    on its parameter's device and pinning."""
    problems = []
    for path, value in nested.leaves(state):
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        fqn = next((k for k in path if isinstance(k, str) and k in params), None)
        if fqn is None:
            continue
        p = params[fqn]
        at = f"{where}{nested.where(path)}"
        if value.dtype != p.dtype:
            problems.append(f"{at}: dtype {value.dtype}, the sharded parameter's is {p.dtype}")
        if local:
            mine, theirs = tensors.local(value), tensors.local(p)
            if mine.device != theirs.device:
                problems.append(f"{at}: on {mine.device}, the parameter on {theirs.device}")
            elif mine.device.type == "cpu" and mine.is_pinned() != theirs.is_pinned():
                problems.append(f"{at}: pinned {mine.is_pinned()}, the parameter's {theirs.is_pinned()}")
    return problems


def loop_3(c, layout, mode, before=BEFORE, how=None):
    """Under an FSDP2 policy: the state dicts hold the sharded parameters'
    own dtype and device, a load puts values where the policy keeps them,
    and the resumed run equals the uninterrupted one."""
    how = how or resuming.recipe(layout, "adamw")
    kept = resuming.trained_source(c, how, before, after=1)
    saved = kept.save(c, mode, model="iut")
    params = dict(kept.setup.named_parameters())
    got = _dicts(c, kept.setup, saved)
    if got is not None:
        local = not mode.full
        fail_if(
            _kinds(got[0], params, "model", local=local) + _kinds(got[1], params, "optim", local=local),
            f"{mode}: under {policies.VARIANTS[layout.policy]}, get's state is not the sharded parameters'",
        )
    b = how.build(c, 1)
    b.set_steps_done(before)
    saving.load(c, b, saved)
    mine = dict(b.named_parameters())
    state = {fqn: dict(o.state.get(p, {})) for o in b.optimizers for fqn, p in mine.items() if p in o.state}
    fail_if(_kinds(state, mine, "optimizer.state", local=True), f"{mode}: a load put state where the policy does not")
    b.train(1)
    fail_if(
        diff_snapshots(*saving.comparable(mode, b, kept.expected, snapshot(b))),
        f"{mode}: under the policy, the resumed run differs from the uninterrupted one",
    )


def _rotation(layout: Layout, applies) -> list[tuple[str, str]]:
    """(mode, point) pairs: every mode once, the layout's points in turn."""
    points = [name for name, p in loops.POINTS.items() if applies(p)(layout) is None]
    offset = sum(map(ord, layout.name))
    return [(mode, points[(offset + j) % len(points)]) for j, mode in enumerate(MODES)]


def cases():
    for clause, fn, applies in (("LOOP-1", loop_1, lambda p: p.applies), ("LOOP-2", loop_2, lambda p: p.rollback)):
        made = set()
        for layout in LOOP_LAYOUTS:
            for mode, point in _rotation(layout, applies):
                made.add((layout, mode, point))
                yield make_case(clause, layout, fn, mode=mode, variant=point, point=point)
        for layout in FSDP1_FULL_SHARD:  # FSDP1 (SPEC §2, 1.3): every mode, the points in turn
            for mode, point in _rotation(layout, applies):
                yield make_case(clause, layout, fn, mode=mode, variant=point, point=point)
        if clause == "LOOP-1":  # SHARD_GRAD_OP keeps the parameters an evaluation forward gathered: every mode
            yield from grid(clause, FSDP1_SHARD_GRAD_OP, fn, modes=MODES, variants={"eval": {"point": "eval"}})
        for layout in HALVED:
            for mode in MODES:  # parameters left unsharded by an evaluation forward, in every mode
                if (layout, mode, "eval") not in made:
                    yield make_case(clause, layout, fn, mode=mode, variant="eval", point="eval")
        # Each policy at the points where it matters (what forward leaves unsharded), modes in turn.
        for i, variant in enumerate(policies.VARIANTS):
            for j, point in enumerate(("eval", "unshard")):
                mode = MODES[(2 * i + j) % len(MODES)]
                yield make_case(clause, _sweep(variant), fn, mode=mode, variant=point, point=point)
    for i, variant in enumerate(policies.VARIANTS):
        for mode in MODES:  # each policy in every mode
            yield make_case("LOOP-3", _sweep(variant), loop_3, mode=mode)
        mode = MODES[i % len(MODES)]  # and on 4 ranks and the 2-D mesh, modes in turn
        if _sweep(variant) != f"{QUARTERS.one()}.{variant}":
            yield make_case("LOOP-3", f"{QUARTERS.one()}.{variant}", loop_3, mode=mode)
        yield make_case("LOOP-3", f"{HYBRID.one()}.{variant}", loop_3, mode=mode)


def _sweep(variant: str) -> str:
    """The layout a policy runs every mode on: the smallest where it means
    something. On 2 ranks ``reshard_after_forward=2`` is ``True``."""
    return f"{QUARTERS.one()}.{variant}" if variant == "reshard2" else f"{HALVED.one()}.{variant}"


def _loop_args(s) -> dict:
    return {"layout": s.built_on, "mode": s.kind, "how": s.recipe(), "before": s.before}


def _rolls_back(s) -> bool:
    """A warm target that LOOP-2 can set mid-loop (a loop point it can roll back to)."""
    return bool(s.warm) and loops.POINTS[s.loop_point].rollback(s.built_on) is None


CLAUSES = {
    "LOOP-1": Clause(
        contains=lambda s: bool(s.loop_point),
        check=lambda s: (loop_1, {**_loop_args(s), "point": s.loop_point, "after": s.after}),
        rank=70,
    ),
    "LOOP-2": Clause(
        contains=lambda s: bool(s.loop_point) and _rolls_back(s),
        check=lambda s: (loop_2, {**_loop_args(s), "point": s.loop_point, "after": s.after, "warm": s.warm}),
        rank=80,
    ),
    "LOOP-3": Clause(contains=lambda s: bool(s.policy and s.before), check=lambda s: (loop_3, _loop_args(s)), rank=90),
}
