"""Checkpoints through torch.distributed.checkpoint (DCP) that resume as users expect.

Checkpoints stay plain DCP directories that torch's tools read. Three ways
to write and read them, from the least to the most that is done for you:

- :class:`LoadPlanner`: the flow users already write (a template from
  ``get``, ``dcp.load``, then ``set``) with ``planner=LoadPlanner()`` as its
  only change. It resumes optimizers whose parameters never had a gradient
  (lazy state) and refuses checkpoints with partly missing state.
- :func:`save` and :func:`load`: the model, its optimizers, LR schedulers
  and any other ``Stateful`` objects in one call each.
- :class:`AppState`: a DCP ``Stateful`` over the model, optimizers and
  schedulers, the pattern of torch's DCP tutorial.

:func:`save` commits atomically (:mod:`hyperdsd.commit`): a save that fails
or is cut short on any rank leaves the checkpoint committed before it, and
:func:`load` takes only committed checkpoints; plain ``dcp.save`` rewrites
data files in place, so a failed save over a checkpoint loads as a mix of
both. :class:`Manager` keeps the last few of a run's checkpoints as step
directories and resumes from the newest committed one (docs/CHECKPOINTS.md).

Every problem is found while DCP plans the load, before any data is read;
DCP then raises on every rank (a ``CheckpointException`` carrying each
failing rank's error; :func:`load` turns it into one :class:`StateDictError`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import inspect
import os
import re
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
    DefaultLoadPlanner,
    FileSystemReader,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from . import api, commit
from .dcp_plans import SavePlanner, local_load_plan, local_shard
from .dcp_reader import Reader
from .dcp_writer import Writer
from .errors import StateDictError
from .options import StateDictOptions, resolve_options
from .state.dcp_template import add_saved_state, judge, optimizer_entries, unexpected

__all__ = ["AppState", "LoadPlanner", "Manager", "SaveFuture", "load", "save", "settle"]

MODEL, OPTIM, SCHEDULERS = "model", "optim", "schedulers"
_SHOWN = 10  # unexpected keys named in an error; the rest are counted


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, knowing what optimizer state may be absent.

    Pass it to ``dcp.load`` when the state dict holds optimizer state from
    ``get_optimizer_state_dict`` (nested or flat, under any key; a
    ``Stateful`` that returns one works too). Per parameter:

    - state wholly absent from the checkpoint, where the template holds
      placeholders (a never-stepped optimizer's): lazy state; the parameter
      never had a gradient when the checkpoint was saved. It is left out of
      the load, and ``set`` leaves the parameter without state.
    - state in the checkpoint for a parameter the optimizer lists but holds
      no state for (a stepped optimizer's frozen parameter, or one without a
      gradient so far): the template gets an entry for it, full tensors of
      the saved shapes on the CPU, and ``set`` loads it like any other (a
      never-stepped template saved before the first step: no state).
    - state partly absent (``exp_avg`` there, ``exp_avg_sq`` or ``step`` not):
      corruption; :class:`StateDictError` names the FQN and the keys. For a
      parameter a stepped optimizer holds no state for, the template cannot
      say which keys are due: ``set`` refuses a partial entry after the read.
      :func:`load` gives such parameters placeholder state in its template,
      so it refuses one before anything is read.

    Everything else stays required, as with DCP's default planner: the
    model, a stepped optimizer's state, the param groups. With ``strict``
    (the default), entries the checkpoint holds under the state dict's
    top-level keys that no rank asks for are an error too (a checkpoint of
    another model, or with more param groups). ``strict=False`` skips
    missing and unexpected entries as ``allow_partial_load=True`` does;
    partly absent state is still refused.
    """

    def __init__(self, *, strict: bool = True):
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.asked: set[str] = set()
        self.tops: set[str] = set()
        # Keep the read items on their rank: the plans exchanged carry none, and
        # finish_plan puts them back. Only for readers whose global and local
        # planning do not look at the items (see _plain_plans).
        self.local_items = False
        self._items: list | None = None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.flatten_state_dict:
            for key, (path, value) in add_saved_state(self.original_state_dict, metadata).items():
                self.state_dict[key] = value
                self.mappings[key] = path
        self.asked = set(self.state_dict)
        self.tops = {str(path[0]) for path in self.mappings.values()} if self.mappings else set(self.state_dict)
        entries = optimizer_entries(self.original_state_dict, self.state_dict, self.mappings)
        drop, problems = judge(entries, metadata.state_dict_metadata, strict=self.strict)
        if problems:
            raise StateDictError("the checkpoint's optimizer state cannot be loaded:\n  " + "\n  ".join(problems))
        for key in drop:
            del self.state_dict[key]

    def create_local_plan(self):
        if self.flatten_state_dict and not set(self.metadata.state_dict_metadata) - set(self.state_dict):
            plan = local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        else:  # keys of the checkpoint no rank asks for: DCP's default planner tells an old checkpoint
            plan = super().create_local_plan()
        if self.local_items:
            self._items = plan.items
            plan = dataclasses.replace(plan, items=[])
        if not self.strict:
            return plan
        # Every rank's keys go to the coordinator, which alone can tell a key
        # no rank asks for (pipeline stages each ask for their own).
        return dataclasses.replace(plan, planner_data=(sorted(self.asked), sorted(self.tops)))

    def create_global_plan(self, global_plan):
        plans = super().create_global_plan(global_plan)
        if not self.strict:
            return plans
        asked: set[str] = set()
        tops: set[str] = set()
        for plan in plans:
            keys, names = plan.planner_data or ((), ())
            asked.update(keys)
            tops.update(names)
        extra = unexpected(asked, tops, self.metadata.state_dict_metadata)
        if extra:
            more = f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else ""
            raise StateDictError(
                "the checkpoint holds entries that no rank's state dict has "
                "(strict=True; another model's checkpoint?): "
                f"{extra[:_SHOWN]}{more}"
            )
        return [dataclasses.replace(plan, planner_data=None) for plan in plans]

    def lookup_tensor(self, index):
        found = local_shard(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        if self._items is not None:
            plan = dataclasses.replace(plan, items=self._items)
        return plan


def _plain_plans(reader) -> bool:
    """Whether ``reader`` plans as DCP's file-system reader does: it leaves plans as they are."""
    cls = type(reader)
    return (
        isinstance(reader, FileSystemReader)
        and cls.prepare_local_plan is FileSystemReader.prepare_local_plan
        and cls.prepare_global_plan is FileSystemReader.prepare_global_plan
    )


# -- the model, optimizers and schedulers as one state dict ------------------


def _as_list(items) -> list:
    if items is None:
        return []
    return [items] if not isinstance(items, (list, tuple)) else list(items)


def _check_extra(extra: Mapping[str, Any] | None) -> None:
    taken = sorted(set(extra or {}) & {MODEL, OPTIM, SCHEDULERS})
    if taken:
        raise StateDictError(
            f"extra uses the names {taken}, which hold the model, optimizers and schedulers; choose others"
        )


def _state(model, optimizers, schedulers, extra, opts: StateDictOptions, *, to_load: bool = False) -> dict[str, Any]:
    get = api.load_template if to_load else api.get_state_dict
    msd, osd = get(model, optimizers, options=opts)
    state: dict[str, Any] = {MODEL: msd, OPTIM: osd}
    if schedulers:
        state[SCHEDULERS] = [s.state_dict() for s in schedulers]
    for key, obj in (extra or {}).items():
        state[key] = obj.state_dict() if isinstance(obj, Stateful) else obj
    return state


def _apply(state: dict[str, Any], model, optimizers, schedulers, extra, opts: StateDictOptions) -> None:
    """Set what DCP loaded: model and optimizers validated first, then the rest."""
    api.set_state_dict(model, optimizers, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM], options=opts)
    for scheduler, sd in zip(schedulers, state.get(SCHEDULERS, ())):
        scheduler.load_state_dict(sd)
    for key, obj in (extra or {}).items():
        if isinstance(obj, Stateful):
            obj.load_state_dict(state[key])


class AppState(Stateful):
    """A model, its optimizers and LR schedulers as one DCP ``Stateful``.

    ``state_dict()`` is ``{"model": ..., "optim": ..., "schedulers": [...]}``
    by FQN (``get_state_dict``); ``load_state_dict`` sets them back, model
    and optimizers validated together before anything changes::

        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=path)
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path, planner=LoadPlanner())
    """

    def __init__(self, model, optimizers, schedulers=(), *, options: StateDictOptions | None = None):
        self.model = model
        self.optimizers = optimizers
        self.schedulers = _as_list(schedulers)
        self.options = resolve_options(options)

    def state_dict(self) -> dict[str, Any]:
        return _state(self.model, self.optimizers, self.schedulers, None, self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _apply(state_dict, self.model, self.optimizers, self.schedulers, None, self.options)


# -- one call each -------------------------------------------------------------


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
    :mod:`hyperdsd.commit`); a save that fails on any rank raises
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


class Manager:
    """Checkpoints of a run as step directories ``root/step-{n}``, the last ``keep`` of them kept.

    Each :meth:`save` commits atomically (as :func:`save`); once it is
    committed, rank 0 removes committed steps older than the newest
    ``keep`` ones (never the one just saved: ``keep`` is at least 1).
    :meth:`latest` is the newest committed step, skipping steps whose save
    did not finish; :meth:`load` resumes from it::

        manager = Manager("checkpoints/run", keep=3)
        start = manager.load(model, optimizer) if manager.latest() is not None else 0
        for step in range(start + 1, steps + 1):
            train_one_step()
            if step % 100 == 0:
                manager.save(step, model, optimizer)

    ``storage_writer`` and ``storage_reader`` are DCP's, used for every
    save and load. With a process group, call every method on every rank:
    rank 0 looks at the directory and tells the others.
    """

    def __init__(
        self,
        root,
        keep: int = 3,
        *,
        options: StateDictOptions | None = None,
        storage_writer: StorageWriter | None = None,
        storage_reader: StorageReader | None = None,
    ):
        if int(keep) < 1:
            raise ValueError(f"keep must be at least 1 (the checkpoint just saved), not {keep}")
        self.root = _path(root)
        self.keep = int(keep)
        self.options = options
        self.storage_writer = storage_writer
        self.storage_reader = storage_reader

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(
        self,
        step: int,
        model,
        optimizers,
        *,
        schedulers=(),
        extra: Mapping[str, Any] | None = None,
        async_save: bool = False,
    ):
        """:func:`save` to ``root/step-{step}``; then the steps beyond the newest ``keep`` are removed."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        return _save(
            self.path(step),
            model,
            optimizers,
            schedulers,
            extra,
            self.options,
            async_save,
            self.storage_writer,
            after_commit=self._prune,
        )

    def latest(self) -> int | None:
        """The newest step with a committed checkpoint, or None (after :func:`settle`)."""
        settle()
        return _agreed(self._latest_here)

    def load(
        self, model, optimizers, *, schedulers=(), extra: Mapping[str, Any] | None = None, step: int | None = None
    ) -> int:
        """Load the newest committed step (or ``step``) as :func:`load` does; returns its step."""
        if step is None:
            step = self.latest()
            if step is None:
                raise StateDictError(f"there is no committed checkpoint under {self.root}")
        load(
            self.path(step),
            model,
            optimizers,
            schedulers=schedulers,
            extra=extra,
            options=self.options,
            storage_reader=self.storage_reader,
        )
        return step

    def _steps(self) -> list[int]:
        """Steps named in ``root`` (committed or not), newest first."""
        if not self.root.is_dir():
            return []
        found = set()
        for name in os.listdir(self.root):
            match = _STEP.fullmatch(name)
            if match:
                found.add(int(match.group(1)))
        return sorted(found, reverse=True)

    def _latest_here(self) -> int | None:
        for step in self._steps():
            if commit.resolve(self.path(step))[0] is not None:
                return step
        return None

    def _prune(self) -> None:
        """On rank 0, after a commit: remove committed steps beyond the newest ``keep``."""
        committed = [s for s in self._steps() if (self.path(s) / commit.RECORD).is_file()]
        for step in committed[self.keep :]:
            # Into the trash, atomically: each rank removes its own files from there.
            with contextlib.suppress(OSError):
                commit.to_trash(self.path(step))


_STEP = re.compile(r"\.?step-(\d+)(?:\.previous)?")  # step-{n}, and .step-{n}.previous (a commit cut short)


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
