"""SPEC §3 Round trip (OPT-RT)."""

from __future__ import annotations

from .. import flows
from ..layouts import Setup
from ..oracle import diff_snapshots, fail_if, snapshot
from ..registry import make_case

LAYOUTS = ("single", "ddp", "fsdp2", "fsdp3", "fsdp4", "hsdp2x2", "pp2", "pp2xfsdp2")
OPTS = ("adamw", "adam_amsgrad", "sgd", "sgd_plain", "adagrad")
BEFORE, AFTER = 2, 2


def rt_1(c, layout, opt, mode):
    """Resume in a fresh setup; K more steps must match the uninterrupted run bitwise."""
    a = Setup(c, layout, opt, seed=0)
    a.train(BEFORE)
    saved = flows.save(c, a, mode)
    a.train(AFTER)
    expected = snapshot(a)
    b = Setup(c, layout, opt, seed=1)
    b.set_steps_done(BEFORE)
    flows.load(c, b, saved)
    b.train(AFTER)
    fail_if(diff_snapshots(expected, snapshot(b)), f"{mode}: after resuming, the run differs from the uninterrupted one")


def cases():
    for layout in LAYOUTS:
        for opt in OPTS:
            for mode in flows.MODES:
                yield make_case("OPT-RT-1", layout, rt_1, opt=opt, mode=mode)
