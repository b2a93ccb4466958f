"""Rank side of the oracle tests: the suite's own runs, which every verdict
compares against, come out as a plain uninterrupted run would."""

from __future__ import annotations

from torch.distributed.tensor import DTensor


def _context(ctx):
    """A case context for conformance's Setup, driving hyperdsd."""
    from conformance.adapters import load_adapter
    from conformance.context import CaseContext

    return CaseContext(ctx, None, 0, load_adapter("hyperdsd"), "")


def _setup(ctx, layout: str, optimizer: str, seed: int = 0, scheduler: bool = False):
    from conformance.layouts import Setup

    return Setup(_context(ctx), layout, optimizer, seed=seed, scheduler=scheduler)


def run_ahead_is_the_uninterrupted_run(ctx, layout: str, optimizer: str, scheduler: bool) -> list[str]:
    """What running a source ahead gives is what a fresh run of as many
    steps gives, and the source, put back, goes on as if never run ahead."""
    from conformance.flows import _run_ahead
    from conformance.oracle import diff_snapshots, snapshot

    source = _setup(ctx, layout, optimizer, scheduler=scheduler)
    source.train(1)
    ahead = _run_ahead(source, 2)
    fresh = _setup(ctx, layout, optimizer, scheduler=scheduler)
    fresh.train(3)
    problems = [f"ahead vs fresh: {d}" for d in diff_snapshots(snapshot(fresh), ahead)]
    source.train(2)
    problems += [f"source put back, trained on, vs fresh: {d}" for d in diff_snapshots(snapshot(fresh), snapshot(source))]
    for i, (want, got) in enumerate(zip(fresh.schedulers, source.schedulers, strict=True)):
        if want.state_dict() != got.state_dict():
            problems.append(f"scheduler {i}: {got.state_dict()} vs fresh {want.state_dict()}")
    if source.steps_done != fresh.steps_done:
        problems.append(f"steps done: {source.steps_done} vs fresh {fresh.steps_done}")
    return problems


def run_ahead_refuses_a_setup_that_does_not_come_back(ctx) -> str:
    from conformance.flows import _run_ahead

    source = _setup(ctx, "single", "adamw")
    source.train(1)
    source.load_own_state = lambda state: _model_only(source, state)
    try:
        _run_ahead(source, 1)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def _model_only(setup, state) -> None:
    """A faulty put-back: the model comes back, the optimizer state does not."""
    import torch

    with torch.no_grad():
        setup.module.load_state_dict(state["model"])


def sharded_between_steps(ctx, layout: str) -> list[str]:
    """After a training step every parameter the layout shards is a DTensor
    again: the suite's sharding keeps parameters gathered only from forward
    to backward."""
    setup = _setup(ctx, layout, "adamw")
    setup.train(1)
    return [name for name, p in setup.module.named_parameters() if not isinstance(p, DTensor)]


def a_changed_source_is_not_kept(ctx) -> list[str]:
    """A source the save changed is built afresh for the next case; one it
    did not change is the same object."""
    import torch

    from conformance import flows

    c = _context(ctx)
    how = flows.recipe("single", "adamw")
    kept = flows.trained_source(c, how, 1, after=1)
    kept.save(c, "sharded")
    problems = []
    again = flows.trained_source(c, how, 1, after=1)
    if again.setup is not kept.setup:
        problems.append("an unchanged source was built again")

    def vandalise(setup):
        with torch.no_grad():
            next(iter(setup.module.parameters())).add_(1.0)

    again.save(c, "sharded", first=vandalise)
    third = flows.trained_source(c, how, 1, after=1)
    if third.setup is again.setup:
        problems.append("a changed source was kept")
    if third.expected is not again.expected:
        problems.append("the uninterrupted run was dropped with the source")
    return problems
