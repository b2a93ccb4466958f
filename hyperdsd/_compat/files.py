"""Checkpoint files: torch.save's archives and DCP's file-system layout."""

from __future__ import annotations

import io
from typing import Any

import torch


def storage_dtypes() -> dict:
    """The storage classes ``torch.save`` names in an archive (``torch.FloatStorage``, ...), with their dtypes."""
    # The unpickler that rebuilds DCP's items must allow exactly these; the
    # map is torch's own, and asking each class for its dtype warns.
    return {
        getattr(torch, name): dtype
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
        if hasattr(torch, name)
    }


def tensor_archive(data):
    """The archive ``torch.save`` wrote into ``data``, for its records (``get_record``, ``get_storage_from_record``)."""
    # torch.load's own C++ archive reader; torch.load around it costs ~100 us
    # an item in Python (an unpickler class per call, the weights-only
    # unpickler in Python), most of the time for small tensors.
    return torch._C.PyTorchFileReader(io.BytesIO(data))


def file_window(reader, stream, info):
    """DCP's view of one item in an open data file (as its reader reads an item)."""
    # FileSystemReader._slice_file: a seekable window that torch.load reads
    # from without copying the item first.
    return reader._slice_file(stream, info)


def storage_info(relative_path: str, offset: int, length: int):
    """Where DCP's file-system metadata says an item lies (``_StorageInfo``: the checkpoint format's own type)."""
    # Readers of the checkpoint (torch's included) unpickle this very class
    # from .metadata; a writer of plain DCP files must produce it.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def save_records(tensor: torch.Tensor) -> list[tuple[str, Any]] | None:
    """The records ``torch.save(tensor, f)`` writes into its archive, in order: (name, data), with
    None as the data of the tensor's storage record; None where this torch cannot tell."""
    # torch.serialization._save writes an object's records into the archive
    # writer it is given; a recorder in its place sees them without writing.
    # torch.save pickles each tensor anew (a pickler class per call, a
    # Python persistent_id per object): most of its time for small tensors.
    import pickle

    from torch import serialization

    recorder = _Recorder(tensor.untyped_storage())
    try:
        serialization._save(tensor, recorder, pickle, serialization.DEFAULT_PROTOCOL, False)
    except Exception:  # noqa: BLE001 - another torch's _save, or a tensor it saves otherwise
        return None
    if [data for _, data in recorder.records].count(None) != 1:
        return None
    return recorder.records


class _Recorder:
    """An archive writer for :func:`save_records` that keeps the records it is
    given (a class made per call would be a cycle for the collector)."""

    def __init__(self, storage: torch.UntypedStorage):
        self.storage = storage
        self.records: list[tuple[str, Any]] = []

    def write_record(self, name, data, size):
        if isinstance(data, torch.UntypedStorage):
            if data.data_ptr() != self.storage.data_ptr() or size != self.storage.nbytes():
                raise ValueError("another storage")
            self.records.append((name, None))
        else:
            self.records.append((name, bytes(data, "ascii") if isinstance(data, str) else bytes(data)))


def archive_writer(stream):
    """torch.save's archive writer over ``stream``: a context giving the writer; its exit ends the archive."""
    from torch import serialization

    return serialization._open_zipfile_writer(stream)


def dcp_global_plan_check():
    """DCP's own check of a global save plan (``_validate_global_plan``): a list
    of errors (torch 2.12 on) or a bool (before); None where a release lacks it.
    The fast global save plan runs it once per layout of chunks, as DCP runs it."""
    from torch.distributed.checkpoint import default_planner

    return getattr(default_planner, "_validate_global_plan", None)


def dcp_plan_caching(planner) -> bool:
    """Whether a DCP save planner caches its plans (``_enable_plan_caching``,
    torch 2.7 on): then DCP's own planning runs, whose caches it keeps."""
    return bool(getattr(planner, "_enable_plan_caching", False))
