"""SPEC §3 Partial state (OPT-PART)."""

from __future__ import annotations

from .. import flows
from ..flows import get_options, optimizers_arg, set_options
from ..layouts import Setup
from ..models import ModelConfig
from ..oracle import check, diff_snapshots, diff_values, expect_error, expect_unchanged, fail_if, optimizer_view, snapshot
from ..registry import make_case

ADAPTER = ["adapter.weight", "adapter.bias"]


def part_1(c, layout, mode, strict):
    """The target has parameters the checkpoint lacks (an adapter added for fine-tuning)."""
    a = Setup(c, layout, "adamw")
    a.train(2)
    saved = flows.save(c, a, mode)
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1, cfg=ModelConfig(adapter=True))
    b.set_steps_done(2)
    mine = [f for f in ADAPTER if f in dict(b.named_parameters())]
    if strict:
        before = optimizer_view(b)
        names = ADAPTER
        expect_error(
            lambda: flows.load(c, b, saved, strict=True, model=False),
            names=names if mine else [],
            what="OPT-PART-1: strict=True with parameters the checkpoint lacks",
        )
        expect_unchanged(before, optimizer_view(b), "OPT-PART-1: the failed strict load changed the optimizer")
        return
    flows.load(c, b, saved, strict=False, partial=True)
    got = snapshot(b)
    problems = []
    for fqn in mine:
        if fqn in got["state"]:
            problems.append(f"state[{fqn!r}]: present, expected fresh (absent) state for a parameter the checkpoint lacks")
    shared = {k: v for k, v in got["state"].items() if k not in ADAPTER}
    problems += diff_values(want["state"], shared, "state")
    problems += diff_values({k: v for k, v in want["params"].items()}, {k: v for k, v in got["params"].items() if k not in ADAPTER}, "params")
    fail_if(problems, "OPT-PART-1: strict=False did not load the rest, or touched the new parameters")
    b.train(1)  # training goes on; the adapter gets state of its own
    if mine:
        check(all(f in snapshot(b)["state"] for f in mine), "OPT-PART-1: the new parameters got no state after a step")


def part_2(c, layout, mode):
    """Lazy state: parameters that never had a gradient have no state, before and after."""
    a = Setup(c, layout, "adamw", cfg=ModelConfig(lazy_aux=True))
    a.train(2)
    lazy = [f for f, p in a.named_parameters() if p.requires_grad and not a.optimizers[0].state.get(p)]
    check(bool(lazy) or layout.startswith("pp"), "setup error: no lazy parameter")
    saved = flows.save(c, a, mode)
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1, cfg=ModelConfig(lazy_aux=True))
    b.set_steps_done(2)
    flows.load(c, b, saved, strict=True)
    fail_if(diff_snapshots(want, snapshot(b)), "OPT-PART-2: the loaded optimizer does not reproduce the source (lazy state included)")


def part_3(c, layout, mode):
    """Freezing after training: ignore_frozen_params drops them from the model dict, never their optimizer state."""
    frozen = ["layers.0.fc1.weight", "layers.0.fc1.bias"]
    a = Setup(c, layout, "adamw", cfg=ModelConfig(frozen=True))
    a.train(2)
    a.freeze(frozen)
    opts = get_options(c.iut, mode, ignore_frozen_params=True)
    msd = c.iut.get_model_state_dict(a.model, options=opts)
    if mode != "full_cpu" or c.rank == 0:
        leaked = [f for f in frozen + ["frozen.weight", "frozen.bias"] if f in msd]
        check(not leaked, f"OPT-PART-3: ignore_frozen_params kept frozen parameters {leaked}")
    saved = flows.save(c, a, mode, options={"ignore_frozen_params": True})
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1, cfg=ModelConfig(frozen=True))
    b.freeze(frozen)
    flows.load(c, b, saved, options={"ignore_frozen_params": True}, model=False)
    got = snapshot(b)
    problems = [f"state[{f!r}]: dropped" for f in frozen if f in want["state"] and f not in got["state"]]
    problems += diff_values(want["state"], got["state"], "state")
    fail_if(problems, "OPT-PART-3: optimizer state of frozen parameters was not kept")


def part_4(c, layout, mode):
    """An optimizer over a subset of the parameters round-trips."""
    r = flows.resume(c, flows.recipe(layout, trainable=only_layers), mode)
    fail_if(diff_snapshots(r.expected, snapshot(r.resumed)), "OPT-PART-4: an optimizer over some parameters does not resume like the uninterrupted run")


def only_layers(fqn: str) -> bool:
    return fqn.startswith("layers.")


def cases():
    for layout in ("single", "fsdp2", "fsdp4", "hsdp2x2", "pp2xfsdp2"):
        for mode in ("sharded", "full", "flat", "dcp"):
            yield make_case("OPT-PART-1", layout, part_1, mode=mode, variant="nonstrict", strict=False)
            yield make_case("OPT-PART-1", layout, part_1, mode=mode, variant="strict", strict=True)
    for layout in ("single", "ddp", "fsdp3", "fsdp4", "hsdp2x2", "pp2xfsdp2"):
        for mode in flows.MODES:
            yield make_case("OPT-PART-2", layout, part_2, mode=mode)
    for layout in ("single", "fsdp2", "fsdp4", "hsdp2x2"):
        for mode in ("sharded", "full", "flat", "dcp"):
            yield make_case("OPT-PART-3", layout, part_3, mode=mode)
    for layout in ("single", "ddp", "fsdp4", "hsdp2x2", "pp2", "pp2xfsdp2"):
        for mode in ("sharded", "full", "flat", "dcp"):
            yield make_case("OPT-PART-4", layout, part_4, mode=mode)
