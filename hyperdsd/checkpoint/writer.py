"""A DCP ``FileSystemWriter`` for checkpoints with many small tensors.

DCP's writer saves every tensor item with ``torch.save``, which pickles it
anew: a pickler class per call and Python callbacks per object, about as
long as writing the archive itself for small tensors. This writer writes
the same files, item for item: for each kind of tensor (dtype, shape,
strides, storage size) it has ``torch.save``'s own code produce the
archive's records once, then writes each tensor's archive through
``torch.save``'s archive writer with those records and the tensor's own
bytes. Anything else (bytes items, tensors of other kinds) goes through
``torch.save`` as in DCP. The checkpoint stays plain DCP.
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _compat

__all__ = ["Writer", "save_tensor"]

_records: dict[tuple, list | None] = {}  # a kind of tensor -> torch.save's records for it (None: torch.save itself)


def _kind(tensor: torch.Tensor) -> tuple | None:
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.device.type != "cpu"
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.requires_grad
        or tensor.__dict__
    ):
        return None
    storage_bytes = tensor.untyped_storage().nbytes()
    return (tensor.dtype, tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), storage_bytes)


def save_tensor(tensor: torch.Tensor, stream) -> None:
    """``torch.save(tensor, stream)``, the same archive, pickling once per kind of tensor."""
    kind = _kind(tensor)
    records = None
    if kind is not None:
        if kind not in _records:
            if len(_records) >= 4096:
                _records.clear()
            _records[kind] = _compat.save_records(tensor)
        records = _records[kind]
    if records is None:
        torch.save(tensor, stream)
        return
    storage = tensor.untyped_storage()
    with _compat.archive_writer(stream) as archive:
        for name, data in records:
            if data is None:
                archive.write_record(name, storage, storage.nbytes())
            else:
                archive.write_record(name, data, len(data))


class Writer(FileSystemWriter):
    """DCP's ``FileSystemWriter`` (one file per rank, synced), writing tensors with :func:`save_tensor`."""

    def __init__(self, path):
        super().__init__(path)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        file_name = f"{plan.storage_data.prefix}0.distcp"
        results: list[WriteResult] = []
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        with open(os.path.join(self.path, file_name), "wb") as stream:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    offset = stream.tell()
                    stream.write(planner.resolve_data(item).getbuffer())
                    results.append(self._result(item, file_name, offset, stream.tell() - offset))
            for item in tensors:
                # What DCP writes: detached, on the CPU, in a storage of its own size.
                tensor = planner.resolve_data(item).detach().cpu()
                if tensor.untyped_storage().size() != tensor.nbytes:
                    tensor = tensor.clone()
                offset = stream.tell()
                save_tensor(tensor, stream)
                results.append(self._result(item, file_name, offset, stream.tell() - offset))
            stream.flush()
            os.fsync(stream.fileno())
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    @staticmethod
    def _result(item, file_name: str, offset: int, length: int) -> WriteResult:
        return WriteResult(
            index=item.index, size_in_bytes=length, storage_data=_compat.storage_info(file_name, offset, length)
        )
