"""Full tensors from DTensor shards, many at a time.

:class:`Gatherer` packs the shards of many DTensors into byte buckets, one
collective per bucket instead of one per tensor, and delivers each full
tensor to every rank of its shard group or only to a root. Large pieces
evenly split along dim 0 skip the packing and land straight in the full
tensor. Placements other than one plain Shard (plus Replicate) fall back to
``DTensor.full_tensor()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _compat
from ..placement import chunk_bounds
from .collectives import BUCKET_BYTES, DIRECT_BYTES, aligned, as_bytes, from_bytes, rank


@dataclass
class _Item:
    key: Any
    dt: DTensor
    mesh_dim: int
    shard_dim: int
    root: int | None  # global rank that keeps the result; None: every rank


def _single_shard(dt: DTensor) -> tuple[int, int] | None:
    """(mesh dim, tensor dim) when exactly one plain Shard, the rest Replicate."""
    found = None
    for i, p in enumerate(dt.placements):
        if type(p) is Shard:
            if found is not None:
                return None
            found = (i, p.dim)
        elif type(p) is not Replicate:
            return None
    return found if found is not None else (-1, -1)


class Gatherer:
    """Full tensors for many DTensors, one collective per bucket.

    Call :meth:`add` for every DTensor, in the same order on every rank of a
    mesh, then :meth:`run`. With ``root`` set, only the ranks of the root's
    shard group take part and only the root keeps the result.
    """

    def __init__(self, cpu: bool = False, bucket_bytes: int | None = None):
        self.cpu = cpu
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        self._items: list[_Item] = []
        self._fallback: list[tuple[Any, DTensor, int | None]] = []
        self.results: dict[Any, torch.Tensor] = {}

    def add(self, key: Any, dt: DTensor, root: int | None = None) -> None:
        shard = _single_shard(dt)
        if shard is None:
            self._fallback.append((key, dt, root))
            return
        mesh_dim, shard_dim = shard
        if mesh_dim < 0:  # replicated everywhere: the local tensor is the full tensor
            if root is None or root == rank():
                self._keep(key, _compat.local_tensor(dt))
            return
        self._items.append(_Item(key, dt, mesh_dim, shard_dim, root))

    def _keep(self, key: Any, full: torch.Tensor) -> None:
        self.results[key] = full.cpu() if self.cpu else full

    def run(self) -> dict[Any, torch.Tensor]:
        by_group: dict[tuple, list[_Item]] = {}
        me = rank()
        for item in self._items:
            pg = item.dt.device_mesh.get_group(item.mesh_dim)
            if item.root is not None and item.root not in dist.get_process_group_ranks(pg):
                continue  # another shard group gathers this one
            by_group.setdefault((id(pg), item.root), []).append(item)
        for (_, root), items in by_group.items():
            pg = items[0].dt.device_mesh.get_group(items[0].mesh_dim)
            n = dist.get_world_size(pg)
            rest = []
            for item in items:
                if self._direct(item, n):
                    self._gather_direct(item, pg, root, me, n)
                else:
                    rest.append(item)
            for bucket in self._buckets(rest, n):
                self._gather_bucket(bucket, pg, root, me)
        for key, dt, root in self._fallback:
            full = dt.full_tensor()  # a collective on the whole mesh
            if root is None or root == me:
                self._keep(key, full)
        return self.results

    def _direct(self, item: _Item, n: int) -> bool:
        """Large, split evenly along dim 0, contiguous: gathered without packing."""
        shape = item.dt.shape
        return (
            item.shard_dim == 0
            and len(shape) > 0
            and shape[0] % n == 0
            and self._piece_bytes(item, n) >= DIRECT_BYTES
            and _compat.local_tensor(item.dt).is_contiguous()
        )

    def _gather_direct(self, item: _Item, pg, root: int | None, me: int, n: int) -> None:
        local = _compat.local_tensor(item.dt)
        if root is None:
            full = torch.empty(item.dt.shape, dtype=local.dtype, device=local.device)
            _compat.all_gather_into(full, local, group=pg)
        else:
            full = torch.empty(item.dt.shape, dtype=local.dtype, device=local.device) if me == root else None
            # Each rank's piece lands in its rows of the full tensor.
            dist.gather(local, list(full.chunk(n)) if full is not None else None, dst=root, group=pg)
            if full is None:
                return
        self._keep(item.key, full)

    def _buckets(self, items: list[_Item], n: int):
        limit = max(self.bucket_bytes // n, 1)
        bucket, size = [], 0
        for item in items:
            piece = aligned(self._piece_bytes(item, n))
            if bucket and size + piece > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(item)
            size += piece
        if bucket:
            yield bucket

    @staticmethod
    def _piece_bytes(item: _Item, n: int) -> int:
        shape = item.dt.shape
        rows = -(-shape[item.shard_dim] // n) if shape[item.shard_dim] else 0
        inner = math.prod(s for d, s in enumerate(shape) if d != item.shard_dim)
        return rows * inner * item.dt.dtype.itemsize

    def _gather_bucket(self, bucket: list[_Item], pg, root: int | None, me: int) -> None:
        n = dist.get_world_size(pg)
        offsets, total = [], 0
        for item in bucket:
            offsets.append(total)
            total += aligned(self._piece_bytes(item, n))
        device = _compat.local_tensor(bucket[0].dt).device
        if total == 0:  # only empty tensors: every rank knows that without asking
            if root is None or me == root:
                for item in bucket:
                    self._keep(item.key, torch.empty(item.dt.shape, dtype=item.dt.dtype, device=device))
            return
        send = torch.zeros(total, dtype=torch.uint8, device=device)
        for item, off in zip(bucket, offsets):
            raw = as_bytes(_compat.local_tensor(item.dt))
            send[off : off + raw.numel()] = raw
        if root is None:
            recv = torch.empty(n * total, dtype=torch.uint8, device=device)
            _compat.all_gather_into(recv, send, group=pg)
            rows = list(recv.view(n, total))
        else:
            rows = [torch.empty(total, dtype=torch.uint8, device=device) for _ in range(n)] if me == root else None
            dist.gather(send, rows, dst=root, group=pg)
            if me != root:
                return
        for item, off in zip(bucket, offsets):
            self._keep(item.key, self._assemble(item, rows, off, n))

    @staticmethod
    def _assemble(item: _Item, rows, off: int, n: int) -> torch.Tensor:
        shape, d = list(item.dt.shape), item.shard_dim
        pieces = []
        for r in range(n):
            start, stop = chunk_bounds(shape[d], n, r)
            piece_shape = shape[:d] + [stop - start] + shape[d + 1 :]
            nbytes = math.prod(piece_shape) * item.dt.dtype.itemsize
            pieces.append(from_bytes(rows[r][off : off + nbytes], item.dt.dtype, piece_shape))
        return torch.cat(pieces, dim=d)
