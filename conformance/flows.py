"""Modes: how a state dict leaves a setup and comes back.

``sharded``  default options, in memory.
``full``     ``full_state_dict`` on every rank, in memory.
``full_cpu`` ``full_state_dict`` + ``cpu_offload`` (rank 0 holds it all);
             loaded back with ``broadcast_from_rank0``.
``bcast``    as ``full_cpu``, but through ``torch.save`` / ``torch.load``
             (``weights_only=True``) on rank 0.
``flat``     ``flatten_optimizer_state_dict``, in memory.
``dcp``      default options through ``torch.distributed.checkpoint``; the
             target's own get provides the load template, as users do. On
             pipeline layouts (MPMD) the optimizer goes in the flat layout:
             nested ``param_groups.N`` keys of different stages would collide
             in one checkpoint, which is why the flat layout exists.

A never-stepped target's template can name optimizer state that the
checkpoint legitimately lacks (parameters that never had a gradient), so the
optimizer part is loaded with ``allow_partial_load=True`` unless a case asks
otherwise; telling loaded entries from the rest is the implementation's job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from .oracle import clone_tree

MODES = ("sharded", "full", "full_cpu", "bcast", "flat", "dcp")

_GET = {
    "sharded": {},
    "full": {"full_state_dict": True},
    "full_cpu": {"full_state_dict": True, "cpu_offload": True},
    "bcast": {"full_state_dict": True, "cpu_offload": True},
    "flat": {"flatten_optimizer_state_dict": True},
    "dcp": {},
    "flat_dcp": {"flatten_optimizer_state_dict": True},
}
_SET = dict(_GET)
_SET["full_cpu"] = _SET["bcast"] = {"full_state_dict": True, "broadcast_from_rank0": True}


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
    model: Any = None
    optim: Any = None
    path: str = ""


def _effective(mode: str, setup) -> str:
    return "flat_dcp" if mode == "dcp" and setup.layout.pp > 1 else mode


def save(c, setup, mode: str, *, model: bool = True, optim: bool = True, options: dict | None = None) -> Saved:
    iut = c.iut
    mode = _effective(mode, setup)
    opts = get_options(iut, mode, **(options or {}))
    msd = iut.get_model_state_dict(setup.model, options=opts) if model else None
    osd = iut.get_optimizer_state_dict(setup.model, optimizers_arg(setup), options=opts) if optim else None
    if mode in ("dcp", "flat_dcp"):
        path = c.path(f"dcp-{mode}")
        with c.under_test("dcp.save of the state dicts get returned"):
            dcp.save({k: v for k, v in (("model", msd), ("optim", osd)) if v is not None}, checkpoint_id=path)
        return Saved(mode, path=path)
    if mode == "bcast":
        path = c.path("full.pt")
        if c.rank == 0:
            with c.under_test("torch.save of the full state dicts get returned"):
                torch.save({"model": msd, "optim": osd}, path)
        return Saved(mode, path=path)
    return Saved(mode, model=clone_tree(msd), optim=clone_tree(osd))


def load(c, setup, saved: Saved, *, strict: bool = True, partial: bool = True, model: bool = True, optim: bool = True, options: dict | None = None):
    """Load ``saved`` into ``setup``; returns the model's (missing, unexpected) keys or None."""
    iut = c.iut
    opts = set_options(iut, saved.mode, strict=strict, **(options or {}))
    optims = optimizers_arg(setup)
    keys = None
    if saved.mode in ("dcp", "flat_dcp"):
        tmpl_opts = get_options(iut, saved.mode)
        if model:
            msd = iut.get_model_state_dict(setup.model, options=tmpl_opts)
            with c.under_test("dcp.load into the template get returned"):
                dcp.load({"model": msd}, checkpoint_id=saved.path, planner=DefaultLoadPlanner(allow_partial_load=not strict))
            keys = iut.set_model_state_dict(setup.model, msd, options=opts)
        if optim:
            osd = iut.get_optimizer_state_dict(setup.model, optims, options=tmpl_opts)
            with c.under_test("dcp.load into the template get returned"):
                dcp.load({"optim": osd}, checkpoint_id=saved.path, planner=DefaultLoadPlanner(allow_partial_load=partial))
            iut.set_optimizer_state_dict(setup.model, optims, osd, options=opts)
        return keys
    if saved.mode == "bcast":
        data = read_full(saved.path) if c.rank == 0 else {"model": {}, "optim": {}}
        msd, osd = data["model"], data["optim"]
    elif saved.mode == "full_cpu":
        msd, osd = (clone_tree(saved.model), clone_tree(saved.optim)) if c.rank == 0 else ({}, {})
    else:
        # A copy, so that an implementation that consumes its input cannot
        # change what a later load of the same checkpoint sees.
        msd, osd = clone_tree(saved.model), clone_tree(saved.optim)
    if model:
        keys = iut.set_model_state_dict(setup.model, msd, options=opts)
    if optim:
        iut.set_optimizer_state_dict(setup.model, optims, osd, options=opts)
    return keys


def resume(c, make, mode: str, *, before: int = 1, after: int = 1, strict: bool = True):
    """The scenario most clauses share: train, save in ``mode``, train on;
    load into a fresh setup and train as long.

    ``make(seed)`` builds a setup; seed 1 differs from seed 0 so that values
    can only come from the checkpoint. Returns (uninterrupted, resumed).
    """
    a = make(0)
    a.train(before)
    saved = save(c, a, mode)
    a.train(after)
    b = make(1)
    b.set_steps_done(before)
    load(c, b, saved, strict=strict)
    b.train(after)
    return a, b
