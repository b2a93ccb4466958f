"""Loading a checkpoint: :func:`load` in one call, committed checkpoints only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from ..options import StateDictOptions, resolve_options
from . import commit
from .app_state import _apply, _as_list, _check_extra, _state
from .load_planner import LoadPlanner, _plain_plans
from .reader import Reader
from .saving import _committed, _gc_paused, _one_error, settle


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
