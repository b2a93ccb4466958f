"""Saving and loading a setup's state in a mode (SPEC §2), carried out: how a
state dict leaves a setup and comes back. What each mode is, is
:mod:`conformance.modes`; this module does what the mode says, asking it,
never its name.

A setup whose model spans part of the world (OPT-MESH-2) keeps everything
to its own ranks: its first rank is the root of ``full_cpu``, ``bcast`` and
``file``, DCP runs in its process group, its files are its own.

Where a clause is about optimizer state, the model goes the *reference* way
(the model's own ``state_dict``, copied by the suite), so that a deviation of
the implementation's model functions fails the MODEL clauses only; MODEL
cases send the model through the implementation (``model="iut"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from .. import _compat
from ..adapters import iut_call
from ..judging.oracle import clone_tree, without_empty_groups
from ..modes import Mode, mode_of
from .dcp_storage import BatchedReader, BatchedWriter

# The suite saves and loads through DCP on subgroups; torch 2.6 needs this for it.
_compat.dcp_on_subgroups()


def get_options(iut, mode: Mode | str, **extra):
    return iut.options(**dict(mode_of(mode).get_options), **extra)


def set_options(iut, mode: Mode | str, **extra):
    return iut.options(**dict(mode_of(mode).set_options), **extra)


def read_full(path: str):
    """Read a full-state file written with torch.save; never runs pickled code."""
    return torch.load(path, weights_only=True)


def optimizers_arg(setup):
    """One optimizer is passed as itself, several as a list: both are the API."""
    return setup.optimizers[0] if len(setup.optimizers) == 1 else list(setup.optimizers)


@dataclass
class Saved:
    mode: Mode  # as it ran on the setup saved (dcp on pipeline stages: flat_dcp)
    model: Any = None  # the implementation's model dict (model="iut")
    optim: Any = None
    path: str = ""
    model_ref: Any = None  # the model's own state_dict, copied (model="reference")
    batched: bool = False  # through DCP in one file a rank (conformance.world.dcp_storage), not DCP's file storage


def _path(c, setup, name: str) -> str:
    """A checkpoint path of the setup's own (models on parts of the world save apart)."""
    return c.path(name if setup.group_size == c.world_size else f"{name}-ranks{setup.ranks[0]}-{setup.ranks[-1]}")


def effective(mode: Mode | str, setup) -> Mode:
    """``mode`` as it runs on ``setup``: ``dcp`` on pipeline stages goes flat."""
    return mode_of(mode).on(setup.layout.pp > 1)


def comparable(mode: Mode, setup, want: dict, got: dict) -> tuple[dict, dict]:
    """Snapshots ``want`` and ``got`` without the fields of groups that have
    no parameters, where ``mode`` cannot carry them (OPT-EMPTY-2 judges those)."""
    if effective(mode, setup).carries_empty_groups:
        return want, got
    return without_empty_groups(want), without_empty_groups(got)


def save(
    c,
    setup,
    mode: Mode | str,
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
    if mode.through_dcp:
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
    elif mode.file:
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
    mode = saved.mode
    strict = strict and mode.strict_on(setup.layout.pp > 1)  # a consolidated dict holds every stage
    opts = set_options(iut, saved.mode, strict=strict, **(options or {}))
    optims = optimizers_arg(setup)
    keys = None
    if model and saved.model_ref is not None:
        load_reference_model(setup, saved.model_ref, strict=strict)
    iut_model = model and saved.model_ref is None
    if mode.through_dcp:
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
    if mode.file:  # the root's file: read by every rank, or by the root alone for a broadcast
        data = read_full(saved.path) if mode.every_rank_reads or setup.is_root else {"model": {}, "optim": {}}
        msd, osd = data["model"], data["optim"]
    elif mode.broadcast:
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
