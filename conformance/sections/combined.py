"""SPEC §3 Combined functions (API): ``get_state_dict`` and ``set_state_dict``.

Users who call the combined functions instead of the four separate ones are
owed the same results: a get returns what the two gets return, a set loads
what the two sets load (a resume equals the uninterrupted run) and raises
where they raise. A ``broadcast_from_rank0`` load is where they part most
easily: the other ranks pass empty dicts for both, and a combined set that
decides per rank what to load leaves a rank behind in a collective. The
model goes through the implementation here: the combined functions carry it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kit import (
    FSDP1_FULL_SHARD,
    GHOST,
    HALVED,
    HYBRID,
    MODES,
    ONE_RANK,
    REPLICATED,
    SHARDED_STAGES,
    Clause,
    check,
    clone_tree,
    diff_snapshots,
    diff_values,
    expect_error,
    fail_if,
    grid,
    resuming,
    saving,
    snapshot,
)

API_LAYOUTS = ONE_RANK | REPLICATED | HALVED | HYBRID | SHARDED_STAGES
OPT = "adamw"
BEFORE, AFTER = 1, 1


def _pair(got, mode: str) -> tuple:
    """What ``get_state_dict`` returned, as (model, optim); anything else is its deviation."""
    check(
        isinstance(got, (tuple, list)) and len(got) == 2,
        f"{mode}: get_state_dict returned {type(got).__name__} ({str(got)[:200]}), "
        "expected (model_state_dict, optim_state_dict)",
    )
    return clone_tree(got[0]), clone_tree(got[1])


def _gets(c, setup, mode: str) -> tuple:
    """The two separate gets and the combined one, in ``mode``'s get options:
    ((model, optim), what get_state_dict returned)."""
    opts = saving.get_options(c.iut, mode)
    optims = saving.optimizers_arg(setup)
    model = clone_tree(c.iut.get_model_state_dict(setup.model, options=opts))
    optim = clone_tree(c.iut.get_optimizer_state_dict(setup.model, optims, options=opts))
    return (model, optim), c.iut.get_state_dict(setup.model, optims, options=opts)


def _to_load(c, setup, saved: saving.Saved) -> tuple:
    """The dicts each rank passes to ``set_state_dict``, as users of the
    combined functions load ``saved`` (``saving.load``'s modes): the DCP
    template from the target's own ``get_state_dict``, loaded through the
    implementation's DCP load path; ``{}`` for both on the ranks other than
    the root of a broadcast."""
    if saved.mode.through_dcp:
        msd, osd = _pair(
            c.iut.get_state_dict(
                setup.model, saving.optimizers_arg(setup), options=saving.get_options(c.iut, saved.mode)
            ),
            saved.mode,
        )
        loaded = saving.dcp_load(c, saved.path, {"model": msd, "optim": osd}, setup.group, saved.batched)
        return loaded["model"], loaded["optim"]
    if saved.mode.broadcast and not setup.is_root:
        return {}, {}
    if saved.path:  # bcast on the root, file on every rank
        data = saving.read_full(saved.path)
        return data["model"], data["optim"]
    return clone_tree(saved.model), clone_tree(saved.optim)


def _set(c, setup, msd, osd, mode: str) -> None:
    strict = mode.strict_on(setup.layout.pp > 1)  # a consolidated file holds every stage
    c.iut.set_state_dict(
        setup.model,
        saving.optimizers_arg(setup),
        model_state_dict=msd,
        optim_state_dict=osd,
        options=saving.set_options(c.iut, mode, strict=strict),
    )


def _every_rank_returned(c, setup) -> None:
    """A barrier of the model's ranks, under test: a rank that returned from
    ``set_state_dict`` while another still waits in a collective it issued
    waits here, and the deadline names both (a hang is ``failed``)."""
    with c.under_test("the barrier after set_state_dict, which every rank must reach"):
        setup.barrier()


def _anywhere(setup, flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the model: every rank then takes the same path."""
    if not dist.is_initialized() or setup.group_size == 1:
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=setup.group)
    return bool(t.item())


def api_1(c, layout, opt, mode):
    """get_state_dict returns what the two gets return; set_state_dict loads
    it (the other ranks of a broadcast passing empty dicts), every rank
    returns, and K more steps equal the uninterrupted run, or, where they do
    not, a resume through the two set functions (then OPT-RT-1 fails)."""
    how = resuming.recipe(layout, opt)
    kept = resuming.trained_source(c, how, BEFORE, after=AFTER)
    seen = {}
    get_mode = saving.effective(mode, kept.setup)
    saved = kept.save(c, mode, model="iut", first=lambda s: seen.update(gets=_gets(c, s, get_mode)))
    (model, optim), got = seen["gets"]
    got_model, got_optim = _pair(got, get_mode)
    fail_if(
        diff_values(model, got_model, "get_state_dict()[0]") + diff_values(optim, got_optim, "get_state_dict()[1]"),
        f"{mode}: get_state_dict differs from get_model_state_dict and get_optimizer_state_dict",
    )

    b = how.build(c, 1)
    b.set_steps_done(BEFORE)
    msd, osd = _to_load(c, b, saved)
    _set(c, b, msd, osd, saved.mode)
    _every_rank_returned(c, b)
    b.train(AFTER)
    differences = diff_snapshots(*saving.comparable(mode, b, kept.expected, snapshot(b)))
    if not _anywhere(b, bool(differences)):
        return
    # A resume through the two set functions that differs alike is OPT-RT-1's deviation, not this clause's.
    separate = how.build(c, 1)
    separate.set_steps_done(BEFORE)
    saving.load(c, separate, saved)
    separate.train(AFTER)
    fail_if(
        diff_snapshots(*saving.comparable(mode, b, snapshot(separate), snapshot(b))),
        f"{mode}: after resuming through set_state_dict, the run differs from the uninterrupted one and from "
        "a resume through set_model_state_dict and set_optimizer_state_dict",
    )


def api_1_strict(c, layout, opt, mode):
    """A strict set_state_dict of a model dict with a key the model does not
    have raises on every rank, inside the implementation, naming the key, as
    set_model_state_dict does (MODEL-2); in a broadcast the root's dict has
    it. An unexpected key, not a missing one: a full load that fills missing
    keys from the model is MODEL-2's deviation, whichever function loads."""
    how = resuming.recipe(layout, opt)
    saved = resuming.trained_source(c, how, BEFORE).save(c, mode, model="iut")
    b = how.build(c, 1)
    msd, osd = _to_load(c, b, saved)
    if not (saved.mode.broadcast and not b.is_root):
        check(isinstance(msd, dict), f"{mode}: the model dict to load is a {type(msd).__name__}: {str(msd)[:300]}")
        msd[GHOST] = torch.zeros(2)
    expect_error(
        lambda: _set(c, b, msd, osd, saved.mode),
        names=[GHOST],
        what=f"API-1: strict set_state_dict ({mode}) of a model dict with the unexpected key {GHOST!r}",
    )
    _every_rank_returned(c, b)


def cases():
    yield from grid("API-1", API_LAYOUTS | FSDP1_FULL_SHARD, api_1, opts=(OPT,), modes=MODES)
    yield from grid("API-1", HALVED, api_1_strict, opts=(OPT,), modes=MODES, variants={"strict": {}})


CLAUSES = {"API-1": Clause(combined=True)}
