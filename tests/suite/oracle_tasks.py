"""Rank side of the oracle tests: the suite's own runs, which every verdict
compares against, come out as a plain uninterrupted run would."""

from __future__ import annotations

from torch.distributed.tensor import DTensor


def _context(ctx):
    """A case context for conformance's Setup, driving hyperdsd."""
    from conformance.adapters import load_adapter
    from conformance.running.case_context import CaseContext

    return CaseContext(ctx, None, 0, load_adapter("hyperdsd"), "")


def _setup(ctx, layout: str, optimizer: str, seed: int = 0, scheduler: bool = False):
    from conformance.world.setup import Setup

    return Setup(_context(ctx), layout, optimizer, seed=seed, scheduler=scheduler)


def run_ahead_is_the_uninterrupted_run(ctx, layout: str, optimizer: str, scheduler: bool) -> list[str]:
    """What running a source ahead gives is what a fresh run of as many
    steps gives, and the source, put back, goes on as if never run ahead."""
    from conformance.judging.oracle import diff_snapshots, snapshot
    from conformance.world.resuming import _run_ahead

    source = _setup(ctx, layout, optimizer, scheduler=scheduler)
    source.train(1)
    ahead = _run_ahead(source, 2)
    fresh = _setup(ctx, layout, optimizer, scheduler=scheduler)
    fresh.train(3)
    problems = [f"ahead vs fresh: {d}" for d in diff_snapshots(snapshot(fresh), ahead)]
    source.train(2)
    problems += [
        f"source put back, trained on, vs fresh: {d}" for d in diff_snapshots(snapshot(fresh), snapshot(source))
    ]
    for i, (want, got) in enumerate(zip(fresh.schedulers, source.schedulers, strict=True)):
        if want.state_dict() != got.state_dict():
            problems.append(f"scheduler {i}: {got.state_dict()} vs fresh {want.state_dict()}")
    if source.steps_done != fresh.steps_done:
        problems.append(f"steps done: {source.steps_done} vs fresh {fresh.steps_done}")
    return problems


def run_ahead_refuses_a_setup_that_does_not_come_back(ctx) -> str:
    from conformance.world.resuming import _run_ahead

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

    from conformance.world import resuming
    from conformance.world.layouts import parse_layout

    c = _context(ctx)
    how = resuming.recipe(parse_layout("single"), "adamw")
    kept = resuming.trained_source(c, how, 1, after=1)
    kept.save(c, "sharded")
    problems = []
    again = resuming.trained_source(c, how, 1, after=1)
    if again.setup is not kept.setup:
        problems.append("an unchanged source was built again")

    def vandalise(setup):
        with torch.no_grad():
            next(iter(setup.module.parameters())).add_(1.0)

    again.save(c, "sharded", first=vandalise)
    third = resuming.trained_source(c, how, 1, after=1)
    if third.setup is again.setup:
        problems.append("a changed source was kept")
    if third.expected is not again.expected:
        problems.append("the uninterrupted run was dropped with the source")
    return problems


def warm_target_differs_everywhere(ctx, layout: str, optimizer: str) -> list[str]:
    """A warm target (OPT-RT-5) holds values of its own wherever the
    checkpoint has some: every state value, ``step`` included, every group
    field a seed scales, every parameter; so a load that keeps any of them
    shows. Moments of a parameter whose gradient is always zero (``aux``)
    are zero in every run, so no run can tell them apart."""
    import torch

    from conformance.judging.oracle import snapshot
    from conformance.sections.roundtrip import BEFORE, WARM
    from conformance.world import resuming
    from conformance.world.layouts import parse_layout
    from hyperdsd import tree

    how = resuming.recipe(parse_layout(layout), optimizer)
    c = _context(ctx)
    source = how.build(c, 0)
    source.train(BEFORE)
    target = how.build(c, 1)
    resuming.warm_up(target, WARM)
    want, got = snapshot(source), snapshot(target)
    problems = []
    if not want["state"] and optimizer != "sgd_plain":
        problems.append("the source has no state")
    if set(want["state"]) != set(got["state"]):
        problems.append(f"state entries: {sorted(got['state'])} vs the source's {sorted(want['state'])}")
    for part in ("params", "state"):
        for path, leaf in tree.leaves(want[part]):
            mine, leaf = _local(_at(got[part], path)), _local(leaf)
            if leaf.numel() and leaf.any() and torch.equal(leaf, mine):
                problems.append(f"{part}{tree.where(path)}: the warm target holds the source's value")
    for i, (g_want, g_got) in enumerate(zip(want["groups"], got["groups"], strict=True)):
        for key in ("lr", "weight_decay"):
            if g_want[key] == g_got[key]:
                problems.append(f"groups[{i}][{key!r}]: the warm target holds the source's value")
    if target.steps_done != resuming.WARM_DATA + WARM:
        problems.append(f"the warm target trained from step {target.steps_done - WARM}, not on data of its own")
    return problems


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _at(obj, path):
    for key in path:
        obj = obj[key]
    return obj


def gathered_dtensors_are_full_tensors(ctx, mesh_spec: str) -> list[str]:
    """The suite's batched gather (one object exchange) gives each DTensor
    what its own ``full_tensor()`` gives: uneven and empty shards, a dim
    other than 0, 2-D meshes, a strided layout it leaves to full_tensor."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from conformance import tensors
    from conformance.judging.oracle import gather_distributed

    mesh = ctx.mesh(mesh_spec)
    torch.manual_seed(0)
    shards = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
    on_dim_1 = [Shard(1)] if mesh.ndim == 1 else [Shard(0), Shard(1)]
    tree = {
        "rows": {f"p{n}": distribute_tensor(torch.randn(n, 3), mesh, shards) for n in (1, 2, 3, 5, 8)},
        "cols": distribute_tensor(torch.randn(4, 7), mesh, on_dim_1),
        "both": [distribute_tensor(torch.randn(6, 5, dtype=torch.float64), mesh, shards), "text", 3],
        "plain": torch.arange(4),
    }
    if mesh.ndim == 2:  # the same tensor dim sharded on both mesh dims: not one block a rank, gathered by full_tensor
        tree["twice"] = distribute_tensor(torch.randn(9, 2), mesh, [Shard(0), Shard(0)])
        if tensors.block_start(tree["twice"], dist.get_rank()) is not None:
            return ["a tensor dim sharded twice was taken for one block"]
    got = gather_distributed(tree)
    problems = []
    for path, value in [(("rows", k), v) for k, v in tree["rows"].items()] + [
        (("cols",), tree["cols"]),
        (("both", 0), tree["both"][0]),
        (("twice",), tree.get("twice")),
    ]:
        if value is None:
            continue
        out = got
        for part in path:
            out = out[part]
        want = value.full_tensor()
        if type(out) is not torch.Tensor or out.dtype != want.dtype or not torch.equal(out, want):
            problems.append(f"{path}: {out!r} != {want!r}")
    if got["both"][1:] != ["text", 3] or not torch.equal(got["plain"], torch.arange(4)):
        problems.append("the leaves that are not DTensors changed")
    return problems
