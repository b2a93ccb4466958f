"""A DCP ``FileSystemReader`` for checkpoints with many small tensors.

DCP's reader seeks to every item of a load plan and reads it with
``torch.load``, whose fixed cost (a new unpickler class, the pure-Python
``weights_only`` unpickler, checks of the zip archive) is about 100 µs per
item: at 40,000 items (10,000 parameters with AdamW), seconds per rank for a
few megabytes. This reader reads the same plain DCP files, written by
``torch.save`` per item:

- the items of a file are read in offset order, adjacent ones in one read
  of up to :data:`SPAN_BYTES` (large items alone, as DCP reads them);
- a tensor item whose archive holds exactly what ``torch.save`` writes for
  one tensor (``_rebuild_tensor_v2`` over one storage, little-endian, no
  extra metadata) is rebuilt from its storage record directly, with the
  same allow-list as ``torch.load(weights_only=True)``; any other item
  goes through ``torch.load`` as in DCP.

What it loads is what DCP's reader loads, byte for byte; the checkpoint
format is unchanged.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from .. import _compat
from . import commit

__all__ = ["Reader", "SPAN_BYTES"]

SPAN_BYTES = 32 * 2**20  # the most one read takes in; an item larger than this is read alone
_LARGE_BYTES = 2**20  # an item alone in its read and larger than this is read as DCP reads it, from the file
_GAP_BYTES = 64 * 2**10  # bytes between two items that are read through rather than skipped

_STORAGE_DTYPES = _compat.storage_dtypes()


class _NotPlain(Exception):
    """The item is not one plain tensor: ``torch.load`` reads it."""


def _rebuild(storage, offset, size, stride, requires_grad, hooks, *rest):
    if rest or hooks:
        raise _NotPlain
    return storage, int(offset), tuple(size), tuple(stride)


class _StorageView(pickle.Unpickler):
    """Unpickles a tensor's ``data.pkl`` into (storage, offset, size, stride), allowing only what
    ``torch.save`` writes for one plain tensor."""

    def find_class(self, module, name):
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch":
            obj = getattr(torch, name, None)
            if obj in _STORAGE_DTYPES:
                return obj
        raise _NotPlain

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGE_DTYPES):
            raise _NotPlain
        _, storage_type, key, _location, numel = pid
        return str(key), _STORAGE_DTYPES[storage_type], int(numel)


_views: dict[bytes, tuple] = {}  # data.pkl -> its view: the same for every tensor of a shape, dtype and layout


def _view_of(pkl: bytes) -> tuple:
    view = _views.get(pkl)
    if view is None:
        try:
            view = _StorageView(io.BytesIO(pkl)).load()
        except (_NotPlain, pickle.UnpicklingError, ValueError, TypeError, EOFError, AttributeError):
            view = ()
        if not (isinstance(view, tuple) and len(view) == 4 and isinstance(view[0], tuple)):
            view = ()
        if len(_views) < 4096:
            _views[pkl] = view
    return view


def tensor_from_bytes(data) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into ``data`` (one DCP item), as ``torch.load`` would return it."""
    try:
        archive = _compat.tensor_archive(data)
        view = _view_of(archive.get_record("data.pkl"))
        if view and archive.get_record("byteorder") == b"little":
            (key, dtype, numel), offset, size, stride = view
            raw = archive.get_storage_from_record(f"data/{key}", numel * dtype.itemsize, torch.uint8)
            return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), offset, size, stride)
    except RuntimeError:
        pass  # not an archive as expected (no byteorder record, ...): torch.load decides
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The part of a saved chunk that a read item asks for (as DCP narrows it)."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if length < tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


def _spans(located: list) -> list[tuple[int, int, list]]:
    """A file's items, each with where it lies (``(info, req)``), grouped into reads: (start, end, items), in
    offset order."""
    spans: list[tuple[int, int, list]] = []
    for info, req in sorted(located, key=lambda pair: pair[0].offset):
        start, end = info.offset, info.offset + info.length
        if spans:
            s0, e0, items = spans[-1]
            if start - e0 <= _GAP_BYTES and end - s0 <= SPAN_BYTES and start >= e0:
                spans[-1] = (s0, end, items)
                items.append((info, req))
                continue
        spans.append((start, end, [(info, req)]))
    return spans


class Reader(FileSystemReader):
    """DCP's ``FileSystemReader``, reading a plan's items in few large reads (see the module).

    ``metadata`` is the checkpoint's metadata when the caller has just read
    it (a load checks the checkpoint first): it is used once, instead of
    reading ``.metadata`` again, if that file has not changed since.
    """

    def __init__(self, path, metadata=None, metadata_stamp=None):
        super().__init__(path)
        self._metadata = metadata
        self._stamp = metadata_stamp

    def read_metadata(self, *args: Any, **kwargs: Any):
        metadata, self._metadata = self._metadata, None
        if metadata is not None and not kwargs.get("rank") and commit.metadata_stamp(self.path) == self._stamp:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage = self.storage_data
        # Each item's place in the files, looked up once (a MetadataIndex hashes and compares in Python).
        located = [(storage[req.storage_index], req) for req in plan.items]
        if any(getattr(info, "transform_descriptors", None) for info, _ in located):
            return super().read_data(plan, planner)  # stream transforms: DCP's own path
        per_file: dict[str, list] = {}
        for pair in located:
            per_file.setdefault(pair[0].relative_path, []).append(pair)
        for relative_path, pairs in per_file.items():
            with open(os.path.join(self.path, relative_path), "rb") as f:
                for start, end, items in _spans(pairs):
                    if len(items) == 1 and end - start > _LARGE_BYTES:
                        self._load_large(*items[0], f, planner)
                        continue
                    f.seek(start)
                    block = memoryview(f.read(end - start))
                    if len(block) != end - start:
                        raise OSError(f"{relative_path} ends before byte {end}, which the checkpoint's metadata needs")
                    for info, req in items:
                        data = block[info.offset - start : info.offset - start + info.length]
                        self._load_item(req, data, planner)
                    del block
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _load_large(self, info, req, f, planner: LoadPlanner) -> None:
        view = _compat.file_window(self, f, info)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(view.read(-1)))
            return
        self._copy(req, torch.load(view, map_location="cpu", weights_only=True), planner)

    @classmethod
    def _load_item(cls, req, data, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            return
        cls._copy(req, tensor_from_bytes(data), planner)

    @staticmethod
    def _copy(req, tensor: torch.Tensor, planner: LoadPlanner) -> None:
        tensor = _narrow(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)
