"""Atomic commits of DCP checkpoints on a filesystem.

DCP writes a checkpoint in place: the data files (``__{rank}_{i}.distcp``)
are rewritten, and ``.metadata`` is replaced last. A save over an existing
checkpoint that fails part-way therefore leaves the old metadata pointing
into new bytes, which loads without complaint as a state nobody saved.

Here a save to ``P`` writes into the staging directory ``.P.staging`` beside
it, and the coordinator (rank 0) commits inside DCP's own finish step, once
every rank's writes have succeeded and ``.metadata`` is written:

1. it checks the data files against the metadata and writes the commit
   record ``.hyperdsd-commit`` (each data file's size) into the staging
   directory, fsynced;
2. it renames the previous checkpoint ``P`` aside to ``.P.previous``;
3. it renames ``.P.staging`` to ``P``: the commit;
4. it renames ``.P.previous`` to ``.P.trash-<id>``: garbage from now on.

Every rank then removes its own data files (``__{rank}_*``) from the trash,
in parallel, in the background and outside DCP's collectives, and the next
save's coordinator removes what is left of it before any rank writes: deleting a checkpoint
is as much work as writing one on some filesystems (ext4 mounted with
``discard``), and one rank doing it alone while the others wait would
cost a save far more than plain ``dcp.save``'s rewrite in place, whose
truncations each rank does for its own file.

Because the commit is part of ``finish``, DCP's own broadcast of the finish
step's outcome tells every rank whether the save succeeded: a failure on
any rank, in the metadata write or in the commit, raises on every rank, and
``async_save`` needs no collective of its own in the background thread.
A crash at any point leaves a state that :func:`resolve` reads right:

- before step 3: ``P`` is the previous checkpoint (or absent), untouched; a
  staging leftover is never read, and the next save removes it;
- between steps 2 and 3: ``P`` is absent and ``.P.previous`` holds the
  previous checkpoint, which loads; the next save renames it back first;
- after step 3: ``P`` is the new checkpoint; the next save removes
  ``.P.previous`` and every ``.*.trash-*`` beside it.

So ``P`` is never a mix, and it is never absent while nothing else loads.
The renames are not fsynced (nor is DCP's own rename of ``.metadata``): after
a power loss any of them may be undone, which leaves one of the states
above. A save that returned is as durable as plain ``dcp.save``'s.
The guarantee needs one POSIX filesystem holding ``P`` and its parent
(``rename`` is atomic within it); object stores have no atomic rename: there
the commit record, written last, is the commit (docs/CHECKPOINTS.md).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.storage import StorageWriter

RECORD = ".hyperdsd-commit"
METADATA = ".metadata"
_STAGING, _PREVIOUS = ".staging", ".previous"


def staging_of(path: Path) -> Path:
    return path.parent / f".{path.name}{_STAGING}"


def previous_of(path: Path) -> Path:
    return path.parent / f".{path.name}{_PREVIOUS}"


def _is_trash(name: str) -> bool:
    return re.fullmatch(r"\..+\.trash-[0-9a-f]{12}", name) is not None


def to_trash(folder: Path) -> None:
    """Rename ``folder`` to a trash name beside it (atomic; the files go later)."""
    os.rename(folder, folder.parent / f".{folder.name.lstrip('.')}.trash-{uuid.uuid4().hex[:12]}")


def empty_trash(parent: Path, rank: int, coordinator: bool) -> None:
    """After a committed save, on every rank: remove this rank's data files from
    the trash beside the checkpoint (the coordinator: the files of no rank too)."""
    mine = f"__{rank}_"
    try:
        bins = [e.path for e in os.scandir(parent) if e.is_dir() and _is_trash(e.name)]
    except OSError:
        return
    for folder in bins:
        with contextlib.suppress(OSError):  # gone already, or a file is: another rank or save removed it
            for entry in os.scandir(folder):
                if entry.name.startswith(mine) or (coordinator and not re.match(r"__\d+_", entry.name)):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
            if coordinator:
                os.rmdir(folder)  # fails while other ranks are still at it: the next save removes it


_read: dict[str, tuple] = {}  # the metadata check() read last: folder -> (stamp, metadata)


def metadata_stamp(folder) -> tuple | None:
    """What tells whether ``folder``'s ``.metadata`` changed: its inode, size and modification time."""
    try:
        st = os.stat(os.path.join(folder, METADATA))
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def take_metadata(folder: Path) -> tuple[Any, tuple | None]:
    """The metadata :func:`check` read from ``folder`` last and its stamp, once; (None, None) if none."""
    stamp, metadata = _read.pop(str(folder), (None, None))
    return metadata, stamp


def _data_files(folder: Path) -> dict[str, int]:
    """Every file of a checkpoint directory but its metadata and commit record, with its size."""
    return {
        e.name: e.stat().st_size
        for e in os.scandir(folder)
        if e.is_file() and e.name not in (METADATA, RECORD) and not e.name.endswith(".tmp")
    }


def check(folder: Path, keep: bool = False) -> str | None:
    """Why ``folder`` holds no complete checkpoint, or None when it does.

    With ``keep``, the metadata read is kept for :func:`take_metadata`
    (the load that follows reads it once, not twice).

    It needs ``.metadata``; every file the metadata points into must be
    there and long enough; with a commit record, every data file must have
    the size recorded at the commit. (A directory without a record, as plain
    ``dcp.save`` writes, is checked against its metadata only.)
    """
    if folder.name.startswith(".") and folder.name.endswith(_STAGING):
        return f"{folder} is the staging directory of a save that did not finish"
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not (folder / METADATA).is_file():
        return f"{folder} has no {METADATA}: not a DCP checkpoint, or one whose save did not finish"
    try:
        stamp = metadata_stamp(folder)
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: say which
        return f"{folder / METADATA} cannot be read ({type(exc).__name__}: {exc})"
    files = _data_files(folder)
    record = folder / RECORD
    if record.is_file():
        try:
            recorded = json.loads(record.read_text())["files"]
        except (ValueError, KeyError, TypeError) as exc:
            return f"{record} cannot be read ({type(exc).__name__}: {exc})"
        for name, size in sorted(recorded.items()):
            if name not in files:
                return f"{folder} lacks {name}, which its commit recorded ({size} bytes)"
            if files[name] != size:
                return f"{folder / name} is {files[name]} bytes; its commit recorded {size}"
    problem = _against_metadata(folder, metadata, files)
    if problem is None and keep:
        _read.clear()  # one at a time: the load that follows takes it
        _read[str(folder)] = (stamp, metadata)
    return problem


def _against_metadata(folder: Path, metadata: Any, files: dict[str, int]) -> str | None:
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = info.relative_path
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if name not in files:
            return f"{folder} lacks {name}, which its metadata points into"
        if files[name] < end:
            return f"{folder / name} is {files[name]} bytes; its metadata points up to byte {end}"
    return None


def resolve(path: Path, keep: bool = False) -> tuple[Path | None, str]:
    """The directory holding the checkpoint committed at ``path`` and "", or None and why there is none.

    ``keep``: as :func:`check`'s."""
    previous, staging = previous_of(path), staging_of(path)
    if path.exists():
        problem = check(path, keep)
        return (None, problem) if problem else (path, "")
    if previous.is_dir() and check(previous, keep) is None:
        return previous, ""  # a commit was cut short after setting the previous checkpoint aside
    if staging.exists():
        return None, f"nothing was committed at {path}: {staging.name} is what a save that did not finish left"
    return None, f"there is no checkpoint at {path}"


def recover(path: Path) -> None:
    """Before a save, on the coordinator: undo a commit cut short, and remove what earlier saves left."""
    previous, staging = previous_of(path), staging_of(path)
    if previous.exists():
        if not path.exists() and check(previous) is None:
            os.rename(previous, path)
        else:
            shutil.rmtree(previous)
    if staging.exists():
        shutil.rmtree(staging)
    if path.parent.is_dir():
        for entry in os.scandir(path.parent):
            if entry.is_dir() and _is_trash(entry.name):
                shutil.rmtree(entry.path, ignore_errors=True)


def commit(path: Path, metadata: Any) -> None:
    """Make the complete staging directory the checkpoint at ``path`` (steps 1-4 above)."""
    staging, previous = staging_of(path), previous_of(path)
    if not (staging / METADATA).is_file():
        raise RuntimeError(f"the storage writer wrote no {METADATA} into {staging}: it must write where it is reset to")
    files = _data_files(staging)
    problem = _against_metadata(staging, metadata, files)
    if problem:
        raise RuntimeError(f"the checkpoint written is incomplete: {problem}")
    with open(staging / RECORD, "w") as f:  # never read before the rename: no temporary name needed
        json.dump({"format": 1, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())  # on disk before the rename that may make it P's
    had_previous = path.exists()
    if had_previous:
        os.rename(path, previous)
    try:
        os.rename(staging, path)
    except BaseException:
        if had_previous:
            os.rename(previous, path)
        raise
    if had_previous:
        with contextlib.suppress(OSError):
            to_trash(previous)


class CommittingWriter(StorageWriter):
    """A DCP storage writer that writes into ``.P.staging`` through ``inner``
    and commits to ``P`` in its finish step (on the coordinator).

    ``inner`` is any DCP writer that writes into the directory it is reset
    to (``FileSystemWriter`` and its subclasses); DCP resets it to the
    staging directory. ``after_commit`` runs on the coordinator once the
    commit is done (:class:`~hyperdsd.checkpoint.Manager` prunes old steps there).
    """

    def __init__(self, inner: StorageWriter, path: Path, after_commit: Callable[[], None] | None = None):
        super().__init__()
        self.inner = inner
        self.path = path
        self.after_commit = after_commit
        self.is_coordinator = False

    @property
    def checkpoint_id(self):
        return getattr(self.inner, "checkpoint_id", None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def reset(self, checkpoint_id=None) -> None:
        self.inner.reset(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        if "kwargs" in inspect.signature(self.inner.set_up_storage_writer).parameters:
            self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
        else:
            self.inner.set_up_storage_writer(is_coordinator)

    def prepare_local_plan(self, plan):
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans):
        # Runs on the coordinator after every rank's local plan and before any
        # rank writes: the one safe moment to clear what earlier saves left.
        recover(self.path)
        staging_of(self.path).mkdir(parents=True)
        return self.inner.prepare_global_plan(plans)

    def write_data(self, plan, planner):
        return self.inner.write_data(plan, planner)

    def finish(self, metadata, results) -> None:
        self.inner.finish(metadata=metadata, results=results)
        commit(self.path, metadata)
        if self.after_commit is not None:
            self.after_commit()
        if type(self.inner).finish is FileSystemWriter.finish:  # done with it (another writer may keep it)
            _emptied(metadata)

    def storage_meta(self):
        return self.inner.storage_meta()


def _emptied(metadata: Any) -> None:
    """Drop a committed checkpoint's entries from the metadata object its save made.

    DCP sends what the storage writer's finish step leaves of the metadata
    to every rank, pickled, as the value of ``dcp.save`` (which
    :func:`hyperdsd.checkpoint.save` does not return): a pickling on the
    coordinator and an unpickling on each rank of every key's chunks and
    storage (seconds at tens of thousands of keys) after the checkpoint is
    written and committed. ``.metadata`` on disk holds them all.
    """
    for name, empty in (("state_dict_metadata", {}), ("storage_data", {}), ("planner_data", None)):
        if hasattr(metadata, name):
            setattr(metadata, name, empty)
