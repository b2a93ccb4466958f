"""Saving a checkpoint: :func:`save` in one call (atomic, optionally async),
async saves that finish, and the paths and errors loading shares."""

from __future__ import annotations

import atexit
import contextlib
import gc
import inspect
import os
import shutil
import threading
from collections.abc import Mapping
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter

from ..errors import StateDictError
from ..options import StateDictOptions, resolve_options
from . import commit
from .app_state import _as_list, _check_extra, _state
from .save_planner import SavePlanner
from .writer import Writer

# -- atomic saves, and async saves that finish -----------------------------------


def _path(checkpoint_id) -> Path:
    return Path(os.fspath(checkpoint_id))


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _agreed(fn):
    """``fn()`` on rank 0 (DCP's coordinator), its value on every rank."""
    box = [fn() if _is_coordinator() else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _committed(checkpoint_id) -> Path:
    """The directory holding the checkpoint committed at ``checkpoint_id``; raises on every rank alike if none."""

    def look():
        try:
            folder, why = commit.resolve(_path(checkpoint_id), keep=True)
        except OSError as exc:
            folder, why = None, f"{type(exc).__name__}: {exc}"
        return (str(folder) if folder else None), why

    folder, why = _agreed(look)
    if folder is None:
        raise StateDictError(f"checkpoint {checkpoint_id!s} cannot be loaded (nothing was changed): {why}")
    return Path(folder)


class SaveFuture(Future):
    """The future of an async save: done once the checkpoint is committed, or with the save's error."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path
        self.error: BaseException | None = None
        self.observed = False

    def result(self, timeout=None):
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout=None):
        self.observed = True
        return super().exception(timeout)


_pending: list[SaveFuture] = []
_sweepers: list[threading.Thread] = []  # deleting this rank's files of replaced checkpoints, after a save
_WAIT_S = 3600.0  # for an earlier async save, before the next call gives up on it


def settle() -> None:
    """Wait for earlier async saves and for this rank's share of deleting the checkpoints they
    replaced; then raise the error of an async save that failed unseen (on every rank alike).

    Every :func:`save` and :func:`load` (and :class:`Manager` call) starts with it.
    """
    error = None
    while _pending:
        fut = _pending.pop(0)
        done, _ = futures.wait([fut], timeout=_WAIT_S)
        if not done:
            raise StateDictError(f"the async save of {fut.path} has not finished after {_WAIT_S:g} s")
        if fut.error is not None and not fut.observed and error is None:
            error = StateDictError(f"an earlier async save failed, and nothing has asked its future:\n{fut.error}")
    _join_sweepers()
    if error is not None:
        raise error


def _sweep(path: Path) -> None:
    """After a committed save: this rank's share of deleting what it replaced, in the background."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sweeper = threading.Thread(
        target=commit.empty_trash, args=(path.parent, rank, rank == 0), name="hyperdsd-trash", daemon=True
    )
    _sweepers.append(sweeper)
    sweeper.start()


def _join_sweepers() -> None:
    while _sweepers:
        _sweepers.pop(0).join(_WAIT_S)


atexit.register(_join_sweepers)  # a script that ends after a save leaves no garbage beside it


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


def _save(*args, **kwargs):
    """What :func:`save` and :meth:`Manager.save` do (see :func:`_save_now`), without cyclic garbage collection."""
    settle()
    with _gc_paused():
        return _save_now(*args, **kwargs)


def _save_now(
    path: Path,
    model,
    optimizers,
    schedulers,
    extra,
    options,
    async_save: bool,
    storage_writer: StorageWriter | None,
    after_commit=None,
):
    """What :func:`save` and :meth:`Manager.save` do: earlier async saves settled, the state read, then written
    into the staging directory and committed (in the background with ``async_save``)."""
    opts = resolve_options(options)
    _check_extra(extra)
    state = _state(model, optimizers, _as_list(schedulers), extra, opts)
    staging = commit.staging_of(path)
    writer = commit.CommittingWriter(storage_writer or Writer(str(staging)), path, after_commit)
    if not async_save:
        try:
            dcp.save(state, checkpoint_id=str(staging), storage_writer=writer, planner=SavePlanner())
        except CheckpointException as exc:
            _clean(path)
            raise _save_error(path, exc) from None
        _sweep(path)
        return None
    stager = storage_writer if isinstance(storage_writer, AsyncStager) else None
    staging_by = {}
    if stager is not None and _HAS_ASYNC_STAGER:
        staging_by["async_stager"] = stager
    elif stager is not None:  # torch 2.6: async_save stages through its storage writer only (the wrapper here)
        state = stager.stage(state)
    upload = dcp.async_save(
        state, checkpoint_id=str(staging), storage_writer=writer, planner=SavePlanner(), **staging_by
    )
    upload = getattr(upload, "upload_completion", upload)
    fut = SaveFuture(path)
    _pending.append(fut)

    def finished(done: Future) -> None:
        exc = done.exception()
        if exc is None:
            _sweep(path)
            fut.set_result(None)
            return
        _clean(path)
        fut.error = _save_error(path, exc) if isinstance(exc, CheckpointException) else exc
        fut.set_exception(fut.error)

    upload.add_done_callback(finished)
    return fut


_HAS_ASYNC_STAGER = "async_stager" in inspect.signature(dcp.async_save).parameters  # torch 2.7 on


@contextlib.contextmanager
def _gc_paused():
    """Python's cyclic garbage collector paused for a save or load.

    DCP builds and unpickles several objects per tensor (plans, metadata,
    write results); at tens of thousands of tensors the collections these
    allocations trigger scan them again and again, seconds per save or load.
    What becomes garbage meanwhile is collected once the collector resumes.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _clean(path: Path) -> None:
    """After a failed save, on rank 0: remove its staging directory (every rank is past its writes)."""
    if _is_coordinator():
        shutil.rmtree(commit.staging_of(path), ignore_errors=True)


def _save_error(path: Path, exc: CheckpointException) -> StateDictError:
    return _one_error(path, exc, f"checkpoint {path} was not saved; what was committed there before is unchanged:")


def _one_error(checkpoint_id, exc: CheckpointException, headline: str | None = None) -> StateDictError:
    """DCP's exception (the same failures on every rank) as one message."""
    by_text: dict[str, list[int]] = {}
    for rank, (error, _trace) in sorted(exc.failures.items()):
        text = str(error) if isinstance(error, StateDictError) else f"{type(error).__name__}: {error}"
        by_text.setdefault(text, []).append(rank)
    planning = bool(exc.args) and exc.args[0] == "plan"
    outcome = "nothing was changed" if planning else "the model and optimizers may be partly loaded"
    lines = [headline or f"checkpoint {checkpoint_id!s} cannot be loaded ({outcome}):"]
    for text, ranks in by_text.items():
        first, *rest = text.splitlines()
        lines.append(f"  on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {first}")
        lines += [f"    {line.strip()}" for line in rest]
    return StateDictError("\n".join(lines))
