"""A checkpoint in one call each: :func:`save` (atomic, optionally async) and :func:`load` (committed only)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ..options import StateDictOptions, resolve_options
from . import commit
from .app_state import _apply, _as_list, _check_extra, _state
from .planner import LoadPlanner, _plain_plans
from .reader import Reader
from .saving import _committed, _gc_paused, _one_error, _path, _save, settle


def save(
    checkpoint_id,
    model,
    optimizers,
    *,
    schedulers=(),
    extra: Mapping[str, Any] | None = None,
    options: StateDictOptions | None = None,
    async_save: bool = False,
    storage_writer: StorageWriter | None = None,
):
    """Save the model, optimizers, schedulers and ``extra`` as a DCP checkpoint, atomically.

    The checkpoint holds ``model``, ``optim`` (by FQN), ``schedulers`` (a
    list of their state dicts, if any) and each key of ``extra`` (a
    ``Stateful``'s state dict, or any value DCP saves). Pipeline stages
    pass ``StateDictOptions(flatten_optimizer_state_dict=True)``, so that
    stages write disjoint keys.

    ``checkpoint_id`` is a directory path. The checkpoint is written beside
    it and takes its place only once every rank has written it (see
    :mod:`hyperdsd.checkpoint.commit`); a save that fails on any rank raises
    :class:`StateDictError` on every rank and leaves what was committed
    there before. ``storage_writer`` is DCP's (a ``FileSystemWriter``, or a
    subclass, that writes where it is reset to).

    With ``async_save`` the state is staged and written in the background;
    returns a future that completes once the checkpoint is committed, or
    holds the error. The next :func:`save` or :func:`load` waits for it and
    raises that error if nobody has asked the future for it.
    """
    return _save(_path(checkpoint_id), model, optimizers, schedulers, extra, options, async_save, storage_writer)


def load(
    checkpoint_id,
    model,
    optimizers,
    *,
    schedulers=(),
    extra: Mapping[str, Any] | None = None,
    options: StateDictOptions | None = None,
    storage_reader: StorageReader | None = None,
) -> None:
    """Load what :func:`save` wrote into the model, optimizers, schedulers and ``extra``.

    Optimizers may be freshly built: parameters that had no state when the
    checkpoint was saved stay without state. A checkpoint of another model
    (FQNs it lacks or does not know, other shapes), with partly missing
    optimizer state or other param groups raises :class:`StateDictError`
    on every rank alike, before anything is changed. ``options.strict=False``
    loads what matches and leaves the rest as it is.

    Only a committed checkpoint loads: a directory a save did not finish
    (a staging leftover, no ``.metadata``, data files that are missing or
    not the size their commit or metadata says) is refused alike on every
    rank. ``storage_reader`` is DCP's (a ``FileSystemReader`` or subclass).
    """
    settle()
    with _gc_paused():
        _load(checkpoint_id, model, optimizers, schedulers, extra, options, storage_reader)


def _load(checkpoint_id, model, optimizers, schedulers, extra, options, storage_reader) -> None:
    opts = resolve_options(options)
    _check_extra(extra)
    schedulers = _as_list(schedulers)
    folder = _committed(checkpoint_id)
    state = _state(model, optimizers, schedulers, extra, opts, to_load=True)
    if storage_reader is None:
        storage_reader = Reader(str(folder), *commit.take_metadata(folder))
    planner = LoadPlanner(strict=opts.strict)
    planner.local_items = _plain_plans(storage_reader)
    try:
        dcp.load(state, checkpoint_id=str(folder), storage_reader=storage_reader, planner=planner)
    except CheckpointException as exc:
        raise _one_error(checkpoint_id, exc) from None
    _apply(state, model, optimizers, schedulers, extra, opts)
