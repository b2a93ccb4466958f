"""Modes: how a state dict leaves a setup and comes back (SPEC §2), carried
out. The modes themselves (``sharded``, ``full``, ``full_cpu``, ``bcast``,
``file``, ``flat``, ``dcp``), what each does and the get each declares, are
defined once, in ``conformance.adapters`` (``MODES``, ``GET_OF``): cases and
declarations name them there. On pipeline layouts (MPMD) ``dcp`` puts the
optimizer in the flat layout: nested ``param_groups.N`` keys of different
stages would collide in one checkpoint, which is why the flat layout exists.

A setup whose model spans part of the world (OPT-MESH-2) keeps everything
to its own ranks: its first rank is the root of ``full_cpu``, ``bcast`` and
``file``, DCP runs in its process group, its files are its own.

Where a clause is about optimizer state, the model goes the *reference* way
(the model's own ``state_dict``, copied by the suite), so that a deviation of
the implementation's model functions fails the MODEL clauses only; MODEL
cases send the model through the implementation (``model="iut"``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from .. import _compat
from ..adapters import MODES, iut_call
from ..judging.oracle import clone_tree, diff_snapshots, snapshot, without_empty_groups
from .dcp_storage import BatchedReader, BatchedWriter

# The suite saves and loads through DCP on subgroups; torch 2.6 needs this for it.
_compat.dcp_on_subgroups()

__all__ = [
    "MODES",
    "Recipe",
    "Resumed",
    "Saved",
    "get_options",
    "load",
    "recipe",
    "resume",
    "save",
    "set_options",
    "warm_up",
]

_GET = {
    "sharded": {},
    "full": {"full_state_dict": True},
    "full_cpu": {"full_state_dict": True, "cpu_offload": True},
    "bcast": {"full_state_dict": True, "cpu_offload": True},
    "file": {"full_state_dict": True, "cpu_offload": True},
    "flat": {"flatten_optimizer_state_dict": True},
    "dcp": {},
    "flat_dcp": {"flatten_optimizer_state_dict": True},
}
_SET = dict(_GET)
_SET["full_cpu"] = _SET["bcast"] = {"full_state_dict": True, "broadcast_from_rank0": True}
_SET["file"] = {"full_state_dict": True}
_FILES = ("bcast", "file")  # modes that go through a torch.save file on rank 0


def get_options(iut, mode: str, **extra):
    return iut.options(**_GET[mode], **extra)


def set_options(iut, mode: str, **extra):
    return iut.options(**_SET[mode], **extra)


def read_full(path: str):
    """Read a full-state file written with torch.save; never runs pickled code."""
    return torch.load(path, weights_only=True)


def optimizers_arg(setup):
    """One optimizer is passed as itself, several as a list: both are the API."""
    return setup.optimizers[0] if len(setup.optimizers) == 1 else list(setup.optimizers)


@dataclass
class Saved:
    mode: str
    model: Any = None  # the implementation's model dict (model="iut")
    optim: Any = None
    path: str = ""
    model_ref: Any = None  # the model's own state_dict, copied (model="reference")
    batched: bool = False  # through DCP in one file a rank (conformance.world.dcp_storage), not DCP's file storage


def _path(c, setup, name: str) -> str:
    """A checkpoint path of the setup's own (models on parts of the world save apart)."""
    return c.path(name if setup.group_size == c.world_size else f"{name}-ranks{setup.ranks[0]}-{setup.ranks[-1]}")


def carries_empty_groups(mode: str, setup) -> bool:
    """Whether ``mode`` can carry a group without parameters: the flat layout
    has no FQN for it (OPT-EMPTY-2), and pipelines go through DCP flat."""
    return effective(mode, setup) not in ("flat", "flat_dcp")


def comparable(mode: str, setup, want: dict, got: dict) -> tuple[dict, dict]:
    """Snapshots ``want`` and ``got`` without the fields of groups that have
    no parameters, where ``mode`` cannot carry them (OPT-EMPTY-2 judges those)."""
    if carries_empty_groups(mode, setup):
        return want, got
    return without_empty_groups(want), without_empty_groups(got)


def effective(mode: str, setup) -> str:
    """``mode`` as it runs on ``setup``: ``dcp`` on pipeline stages goes flat (``flat_dcp``)."""
    return "flat_dcp" if mode == "dcp" and setup.layout.pp > 1 else mode


def save(
    c,
    setup,
    mode: str,
    *,
    model: str | None = "reference",
    optim: bool = True,
    options: dict | None = None,
    batched: bool = False,
    edit=None,
) -> Saved:
    """Take ``setup``'s state in ``mode``. ``model``: "reference", "iut" or None.
    ``batched``: DCP writes each rank's tensors in one file (many keys, SPEC SCALE).
    ``edit(osd)``: changes a copy of the optimizer dict get returned (where it is
    not empty) before it is kept, written or saved: a damaged checkpoint."""
    iut = c.iut
    mode = effective(mode, setup)
    opts = get_options(iut, mode, **(options or {}))
    msd = iut.get_model_state_dict(setup.model, options=opts) if model == "iut" else None
    osd = iut.get_optimizer_state_dict(setup.model, optimizers_arg(setup), options=opts) if optim else None
    if edit is not None and osd:
        osd = clone_tree(osd)
        edit(osd)
    saved = Saved(mode, model_ref=clone_tree(setup.module.state_dict()) if model == "reference" else None)
    if mode in ("dcp", "flat_dcp"):
        saved.path = _path(c, setup, f"dcp-{mode}")
        state = {k: v for k, v in (("model", msd), ("optim", osd)) if v is not None}
        if iut.save_checkpoint is not None:  # the stack's own checkpoint (SPEC 1.6)
            iut.save_checkpoint(state, checkpoint_id=saved.path, process_group=setup.group)
            return saved
        saved.batched = batched
        with c.under_test("dcp.save of the state dicts get returned"):
            dcp.save(
                state,
                checkpoint_id=saved.path,
                storage_writer=BatchedWriter(saved.path) if batched else None,
                process_group=setup.group,
            )
    elif mode in _FILES:
        saved.path = _path(c, setup, "full.pt")
        if setup.is_root:
            with c.under_test("torch.save of the full state dicts get returned"):
                torch.save({"model": msd, "optim": osd}, saved.path)
        setup.barrier()  # the file is complete before any rank reads it
    else:
        saved.model, saved.optim = clone_tree(msd), clone_tree(osd)
    return saved


def load_reference_model(setup, state: dict, strict: bool = True) -> None:
    """Load the model's own state dict the model's own way (no implementation involved)."""
    with torch.no_grad(), setup.stepping():
        setup.module.load_state_dict(clone_tree(state), strict=strict)


def save_reference_model(c, setup, name: str = "model-ref") -> None:
    """The model's own state dict through DCP (or the stack's own checkpoint), for a load on another layout."""
    state, path = {"model": setup.module.state_dict()}, _path(c, setup, name)
    if c.iut.save_checkpoint is not None:
        c.iut.save_checkpoint(state, checkpoint_id=path, process_group=setup.group)
    else:
        dcp.save(state, checkpoint_id=path, process_group=setup.group)


def load_reference_model_from(c, setup, name: str = "model-ref") -> None:
    state, path = {"model": setup.module.state_dict()}, _path(c, setup, name)
    if c.iut.load_checkpoint is not None:
        state = c.iut.load_checkpoint(state, checkpoint_id=path, process_group=setup.group) or state
    else:
        dcp.load(state, checkpoint_id=path, process_group=setup.group)
    with torch.no_grad(), setup.stepping():
        setup.module.load_state_dict(state["model"])


def dcp_planner(iut):
    """The implementation's documented DCP load planner (SPEC §2), or DCP's default."""
    factory = iut.dcp_load_planner
    return factory() if factory is not None else DefaultLoadPlanner()


def load(
    c,
    setup,
    saved: Saved,
    *,
    strict: bool = True,
    model: bool = True,
    optim: bool = True,
    options: dict | None = None,
    again: bool = True,
):
    """Load ``saved`` into ``setup``; returns the model's (missing, unexpected) keys or None.
    ``again``: ``saved`` may be loaded again, so the implementation gets a copy of its dicts."""
    iut = c.iut
    if saved.mode == "file" and setup.layout.pp > 1:
        strict = False  # a consolidated dict holds every stage; each takes its own
    opts = set_options(iut, saved.mode, strict=strict, **(options or {}))
    optims = optimizers_arg(setup)
    keys = None
    if model and saved.model_ref is not None:
        load_reference_model(setup, saved.model_ref, strict=strict)
    iut_model = model and saved.model_ref is None
    if saved.mode in ("dcp", "flat_dcp"):
        tmpl_opts = get_options(iut, saved.mode)
        if iut_model:
            msd = iut.get_model_state_dict(setup.model, options=tmpl_opts)
            msd = dcp_load(c, saved.path, {"model": msd}, setup.group, saved.batched)["model"]
            keys = iut.set_model_state_dict(setup.model, msd, options=opts)
        if optim:
            osd = iut.get_optimizer_state_dict(setup.model, optims, options=tmpl_opts)
            osd = dcp_load(c, saved.path, {"optim": osd}, setup.group, saved.batched)["optim"]
            iut.set_optimizer_state_dict(setup.model, optims, osd, options=opts)
        return keys
    if saved.mode == "bcast":
        data = read_full(saved.path) if setup.is_root else {"model": {}, "optim": {}}
        msd, osd = data["model"], data["optim"]
    elif saved.mode == "file":
        data = read_full(saved.path)
        msd, osd = data["model"], data["optim"]
    elif saved.mode == "full_cpu":
        copy = clone_tree if again else (lambda tree: tree)
        msd, osd = (copy(saved.model), copy(saved.optim)) if setup.is_root else ({}, {})
    elif again:
        # A copy, so that an implementation that consumes its input cannot
        # change what a later load of the same checkpoint sees.
        msd, osd = clone_tree(saved.model), clone_tree(saved.optim)
    else:
        msd, osd = saved.model, saved.optim
    if iut_model:
        keys = iut.set_model_state_dict(setup.model, msd, options=opts)
    if optim:
        iut.set_optimizer_state_dict(setup.model, optims, osd, options=opts)
    return keys


def dcp_load(c, path: str, template: dict, group, batched: bool = False) -> dict:
    """``dcp.load`` of the checkpoint at ``path`` into ``template`` (a get's), with the implementation's
    load planner, or the stack's own ``load_checkpoint`` (SPEC 1.6); what was loaded."""
    if c.iut.load_checkpoint is not None:
        loaded = c.iut.load_checkpoint(template, checkpoint_id=path, process_group=group)
        return loaded if isinstance(loaded, dict) else template
    reader = BatchedReader(path) if batched else None
    with c.under_test("dcp.load into the template get returned"), iut_call():
        dcp.load(template, checkpoint_id=path, storage_reader=reader, planner=dcp_planner(c.iut), process_group=group)
    return template


@dataclass(frozen=True)
class Recipe:
    """How to build a setup, as data: what runs of it are cached under on a rank.

    ``options`` are Setup's keyword arguments as (name, value) pairs; values
    are hashable (configs are frozen dataclasses, functions compare by
    identity). A recipe built with another seed differs in values and in
    hyperparameters (groups scaled by seed), so that they can only come from
    a checkpoint; with ``target_reverse`` its groups are in another order too.
    """

    layout: str
    optimizer: str = "adamw"
    options: tuple = ()

    def build(self, c, seed: int):
        from .models import GroupSpec
        from .setup import Setup

        kwargs = dict(self.options)
        groups = kwargs.pop("groups", None)
        if groups is not None:
            scale = groups.scale * GroupSpec.for_seed(seed).scale
            groups = replace(groups, scale=scale, reverse=groups.reverse != (groups.target_reverse and seed != 0))
        return Setup(c, self.layout, self.optimizer, seed=seed, groups=groups, **kwargs)


def recipe(layout: str, optimizer: str = "adamw", **options) -> Recipe:
    return Recipe(layout, optimizer, tuple(sorted(options.items())))


@dataclass
class Resumed:
    source: Any  # the setup that was saved, as it was at the save
    expected: dict  # snapshot of the uninterrupted run, ``before + after`` steps
    resumed: Any  # the setup loaded from the checkpoint and trained ``after`` steps


_CACHED_SOURCES = 48  # setups kept per rank; the least recently used goes first


def kept_everywhere(c, keys, group=None) -> list[bool]:
    """For each of ``keys``, whether every rank of the model (``group``;
    None: the world) keeps it: one all-reduce for all of them. Building runs
    collectives, so every rank builds or none does, even where a rank's key
    differs from another's (pipeline stages) or a rank dropped its copy."""
    import torch.distributed as dist

    cache = c.rank_ctx.cache
    flags = [key in cache for key in keys]
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flags
    t = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(f) for f in t.tolist()]


def keep(c, key, value):
    """Keep ``value`` under ``key``, most recently used last; drop the oldest sources."""
    cache = c.rank_ctx.cache
    cache.pop(key, None)
    cache[key] = value
    sources = [k for k in cache if isinstance(k, tuple) and k[:1] == ("resume-source",)]
    for old in sources[:-_CACHED_SOURCES]:
        del cache[old]
    return value


def _run_ahead(setup, steps: int) -> dict:
    """The snapshot of ``setup`` after ``steps`` more steps; ``setup`` is then
    put back as it was, through its own state dicts, so that one build
    serves both as the source and as the uninterrupted run. A setup that
    does not come back exactly is the suite's error, never a verdict."""
    before, schedulers = snapshot(setup), [clone_tree(s.state_dict()) for s in setup.schedulers]
    kept = setup.own_state()
    setup.train(steps)
    ahead = snapshot(setup)
    setup.load_own_state(kept)
    differences = diff_snapshots(before, snapshot(setup))
    differences += [f"scheduler {i}" for i, s in enumerate(setup.schedulers) if s.state_dict() != schedulers[i]]
    if differences:
        raise RuntimeError("the suite could not put a trained setup back as it was:\n  " + "\n  ".join(differences[:5]))
    return ahead


@dataclass
class Kept:
    """A trained source a rank keeps across cases, and how it was kept."""

    setup: Any
    key: tuple
    expected: dict | None  # the uninterrupted run, when asked for

    def save(self, c, mode: str, *, first=None, **kwargs) -> Saved:
        """``save`` from the kept setup (``first(setup)`` before it, when
        given); a setup that the implementation changed is dropped from the
        cache (purity is judged by OPT-PURE, not here)."""
        before = snapshot(self.setup)
        if first is not None:
            first(self.setup)
        saved = save(c, self.setup, mode, **kwargs)
        if diff_snapshots(before, snapshot(self.setup)):
            c.rank_ctx.cache.pop(self.key, None)
        return saved


def kept_run(c, how: Recipe, steps: int, *, prepare=None) -> dict:
    """The snapshot of ``how`` built with seed 0 and trained ``steps`` steps
    (``prepare(setup)`` first, when given: what a case did to its own setup
    before training it), kept per rank like ``trained_source``'s runs; a
    plain run is the very run ``trained_source`` keeps as uninterrupted."""
    from .layouts import model_group

    key = ("resume-expected", how, steps) if prepare is None else ("prepared-run", how, steps, prepare)
    (have,) = kept_everywhere(c, (key,), model_group(c, how.layout))
    return keep(c, key, c.rank_ctx.cache[key] if have else snapshot(_trained(c, how, steps, prepare)))


def _trained(c, how: Recipe, steps: int, prepare=None):
    """``how`` built with seed 0 (``prepare``d, when given) and trained ``steps`` steps."""
    setup = how.build(c, 0)
    if prepare is not None:
        prepare(setup)
    setup.train(steps)
    return setup


def trained_source(c, how: Recipe, before: int, *, after: int | None = None) -> Kept:
    """``how`` built with seed 0 and trained ``before`` steps, and with
    ``after``, the snapshot of that run ``after`` steps further: the same for
    every mode, so a rank builds them once and keeps them (they are runs no
    implementation touched, as SPEC §2's oracle says). One build serves both:
    trained ``before`` steps, run ``after`` steps ahead, and put back (see
    ``_run_ahead``). A case may only save from the source (``Kept.save``)
    and look at it: anything else would change what later cases get.
    """
    from .layouts import model_group

    source_key = ("resume-source", how, before)
    expected_key = ("resume-expected", how, before + after) if after is not None else None
    flags = kept_everywhere(
        c, (source_key, expected_key) if expected_key else (source_key,), model_group(c, how.layout)
    )
    have_source, have_expected = flags[0], expected_key is None or flags[1]
    if have_source:
        source = keep(c, source_key, c.rank_ctx.cache[source_key])
    else:
        source = _trained(c, how, before)
        # A source that never stepped has FSDP and the optimizers not yet set
        # up: running it ahead would change what get sees, so it is not.
        if not have_expected and before > 0:
            keep(c, expected_key, _run_ahead(source, after))
            have_expected = True
        keep(c, source_key, source)
    expected = None
    if expected_key:
        expected = keep(
            c,
            expected_key,
            c.rank_ctx.cache[expected_key] if have_expected else snapshot(_trained(c, how, before + after)),
        )
    return Kept(source, source_key, expected)


# Where a warm target's own data starts: batches that no run of a source trains on.
WARM_DATA = 1000


def warm_up(setup, steps: int) -> None:
    """Train ``setup`` ``steps`` steps on other data than any source's: a
    target that already has optimizer state, step counts and lazily built
    structures of its own (FSDP's, the optimizer's), as the job that rolls
    back after a loss spike has (SPEC OPT-RT-5). Its data position is then
    free for the caller to line up (``set_steps_done``)."""
    setup.set_steps_done(WARM_DATA)
    setup.train(steps)


def resume(
    c,
    how: Recipe,
    mode: str,
    *,
    before: int = 1,
    after: int = 1,
    strict: bool = True,
    on_saving=None,
    on_loaded=None,
    warm: int = 0,
) -> Resumed:
    """The scenario most clauses share: train, save in ``mode``; load into a
    fresh setup and train on; compare with the run that was not interrupted
    (both kept per rank: ``trained_source``).

    ``on_saving(source)`` and ``on_loaded(resumed)``, when given, look at
    the setups just before the save and just after the load (what a clause
    checks beyond the resumed run). ``warm``: the target trains that many
    steps of its own first (``warm_up``), so the load goes into a stepped optimizer.
    """
    kept = trained_source(c, how, before, after=after)
    saved = kept.save(c, mode, first=on_saving)
    b = how.build(c, 1)
    if warm:
        warm_up(b, warm)
    b.set_steps_done(before)
    load(c, b, saved, strict=strict)
    if on_loaded is not None:
        on_loaded(b)
    b.train(after)
    return Resumed(kept.setup, kept.expected, b)
