"""Trained runs and resumes: the recipes setups are built from, the runs a
rank keeps across cases (sources no implementation touched, and the
uninterrupted runs they are compared with), warm targets, and the scenario
most clauses share (train, save, load into a fresh setup, train on, compare).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..judging.oracle import clone_tree, diff_snapshots, snapshot
from ..modes import Mode
from . import saving
from .layouts import Layout
from .placing import model_group


@dataclass(frozen=True)
class Recipe:
    """How to build a setup, as data: what runs of it are cached under on a rank.

    ``options`` are Setup's keyword arguments as (name, value) pairs; values
    are hashable (configs are frozen dataclasses, functions compare by
    identity). A recipe built with another seed differs in values and in
    hyperparameters (groups scaled by seed), so that they can only come from
    a checkpoint; with ``target_reverse`` its groups are in another order too.
    """

    layout: Layout
    optimizer: str = "adamw"
    options: tuple = ()

    def build(self, c, seed: int):
        from .groups import GroupSpec
        from .setup import Setup

        kwargs = dict(self.options)
        groups = kwargs.pop("groups", None)
        if groups is not None:
            scale = groups.scale * GroupSpec.for_seed(seed).scale
            groups = replace(groups, scale=scale, reverse=groups.reverse != (groups.target_reverse and seed != 0))
        return Setup(c, self.layout, self.optimizer, seed=seed, groups=groups, **kwargs)


def recipe(layout: Layout, optimizer: str = "adamw", **options) -> Recipe:
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
        raise RuntimeError(
            "the suite could not put a trained setup back as it was, through the model's own load_state_dict and "
            "the optimizers' state (a stack whose model does not load its own state_dict exactly cannot be judged "
            "here):\n  " + "\n  ".join(differences[:5])
        )
    return ahead


@dataclass
class Kept:
    """A trained source a rank keeps across cases, and how it was kept."""

    setup: Any
    key: tuple
    expected: dict | None  # the uninterrupted run, when asked for

    def save(self, c, mode: Mode | str, *, first=None, **kwargs) -> saving.Saved:
        """``save`` from the kept setup (``first(setup)`` before it, when
        given); a setup that the implementation changed is dropped from the
        cache (purity is judged by OPT-PURE, not here)."""
        before = snapshot(self.setup)
        if first is not None:
            first(self.setup)
        saved = saving.save(c, self.setup, mode, **kwargs)
        if diff_snapshots(before, snapshot(self.setup)):
            c.rank_ctx.cache.pop(self.key, None)
        return saved


def kept_run(c, how: Recipe, steps: int, *, prepare=None) -> dict:
    """The snapshot of ``how`` built with seed 0 and trained ``steps`` steps
    (``prepare(setup)`` first, when given: what a case did to its own setup
    before training it), kept per rank like ``trained_source``'s runs; a
    plain run is the very run ``trained_source`` keeps as uninterrupted."""
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
    mode: Mode | str,
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
    saving.load(c, b, saved, strict=strict)
    if on_loaded is not None:
        on_loaded(b)
    b.train(after)
    return Resumed(kept.setup, kept.expected, b)
