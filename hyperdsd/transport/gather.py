"""Full tensors from DTensor shards, many at a time.

:class:`Gatherer` packs the shards of many DTensors into byte buckets, one
collective per bucket instead of one per tensor, and delivers each full
tensor to every rank of its shard group or only to a root. DTensors of one
layout (mesh dim, shard dim, global shape, dtype) and root form a run,
packed and assembled as one stack: a model of tens of thousands of small
tensors has a handful of layouts, and tensor by tensor the slicing and
viewing of pieces cost more than the gather. Pieces of 64 KiB and more are
packed and assembled one by one, each copied once. Large pieces evenly split along
dim 0 skip the packing and land straight in the full tensor. Placements
other than one plain Shard (plus Replicate) fall back to
``DTensor.full_tensor()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _compat
from ..placement import chunk_bounds
from .collectives import BUCKET_BYTES, DIRECT_BYTES, aligned, rank

# Pieces smaller than this are stacked, a run of them in one copy: tensor by
# tensor, a small piece's slicing and viewing cost more than its bytes.
# Larger ones are copied one by one, once each (a stack would copy them twice).
STACK_BYTES = 1 << 16


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


@dataclass
class _Run:
    """DTensors of one layout and root, in the order they were added: what
    each rank holds of each, and where it lies in the full tensor, is the
    same for all of them."""

    mesh_dim: int
    shard_dim: int
    root: int | None  # global rank that keeps the results; None: every rank
    order: list[int] = field(default_factory=list)  # each one's place among everything added
    keys: list = field(default_factory=list)
    tensors: list[DTensor] = field(default_factory=list)

    @property
    def first(self) -> DTensor:
        return self.tensors[0]

    def piece_bytes(self, n: int) -> int:
        """Bytes of the largest piece of one of them among ``n`` ranks (chunks of the shard dim)."""
        shape = self.first.shape
        rows = -(-shape[self.shard_dim] // n) if shape[self.shard_dim] else 0
        inner = math.prod(s for d, s in enumerate(shape) if d != self.shard_dim)
        return rows * inner * self.first.dtype.itemsize

    def merge(self, other: _Run) -> None:
        """Take ``other``'s tensors (the same layout and root) in, keeping the order they were added in."""
        items = sorted(zip(self.order + other.order, self.keys + other.keys, self.tensors + other.tensors))
        self.order, self.keys, self.tensors = (list(column) for column in zip(*items))


class Gatherer:
    """Full tensors for many DTensors, one collective per bucket.

    Call :meth:`add` for every DTensor, in the same order on every rank of a
    mesh, then :meth:`run`. With ``root`` set, only the ranks of the root's
    shard group take part and only the root keeps the result. Each result
    is a tensor of its own (no storage shared with another).
    """

    def __init__(self, cpu: bool = False, bucket_bytes: int | None = None):
        self.cpu = cpu
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        # By layout token (identity: DTensors of one layout mostly share one) and root; sorted into
        # runs by value when run, so that every rank makes the same runs.
        self._by_token: dict[tuple[int, int | None], _Run] = {}
        self._added = 0
        self.results: dict[Any, torch.Tensor] = {}

    def add(self, key: Any, dt: DTensor, root: int | None = None) -> None:
        token = (id(_compat.layout_token(dt)), root)
        run = self._by_token.get(token)
        if run is None:
            shard = _single_shard(dt)
            run = self._by_token[token] = _Run(*(shard if shard is not None else (-2, -2)), root)
        run.order.append(self._added)
        run.keys.append(key)
        run.tensors.append(dt)
        self._added += 1

    def _keep(self, key: Any, full: torch.Tensor) -> None:
        self.results[key] = full.cpu() if self.cpu else full

    def run(self) -> dict[Any, torch.Tensor]:
        me = rank()
        by_group: dict[tuple, list[_Run]] = {}
        fallback: list[tuple[int, Any, DTensor, int | None]] = []
        for run in self._runs():
            if run.mesh_dim == -2:  # placements other than one Shard
                fallback += [(i, key, dt, run.root) for i, key, dt in zip(run.order, run.keys, run.tensors)]
            elif run.mesh_dim == -1:  # replicated everywhere: the local tensor is the full tensor
                if run.root is None or run.root == me:
                    for key, dt in zip(run.keys, run.tensors):
                        self._keep(key, _compat.local_tensor(dt))
            else:
                pg = run.first.device_mesh.get_group(run.mesh_dim)
                if run.root is not None and run.root not in dist.get_process_group_ranks(pg):
                    continue  # another shard group gathers these
                by_group.setdefault((id(pg), run.root), []).append(run)
        for (_, root), runs in by_group.items():
            pg = runs[0].first.device_mesh.get_group(runs[0].mesh_dim)
            n = dist.get_world_size(pg)
            direct = sorted(
                (i, k, dt) for r in runs if self._direct(r, n) for i, k, dt in zip(r.order, r.keys, r.tensors)
            )
            for _, key, dt in direct:
                self._gather_direct(key, dt, pg, root, me, n)
            for bucket in self._buckets([r for r in runs if not self._direct(r, n)], n):
                self._gather_bucket(bucket, pg, root, me, n)
        for _, key, dt, root in sorted(fallback, key=lambda item: item[0]):
            full = dt.full_tensor()  # a collective on the whole mesh
            if root is None or root == me:
                self._keep(key, full)
        return self.results

    def _runs(self) -> list[_Run]:
        """The runs, by layout as every rank sees it (tokens alike in value, one
        run), in the order of their first tensors."""
        by_value: dict[tuple, _Run] = {}
        for run in self._by_token.values():
            dt = run.first
            value = (run.mesh_dim, run.shard_dim, run.root, tuple(dt.shape), dt.dtype, dt.device_mesh)
            if value in by_value:
                by_value[value].merge(run)
            else:
                by_value[value] = run
        return sorted(by_value.values(), key=lambda run: run.order[0])

    def _direct(self, run: _Run, n: int) -> bool:
        """Large, split evenly along dim 0: gathered without packing (each contiguous one)."""
        shape = run.first.shape
        return run.shard_dim == 0 and len(shape) > 0 and shape[0] % n == 0 and run.piece_bytes(n) >= DIRECT_BYTES

    def _gather_direct(self, key: Any, dt: DTensor, pg, root: int | None, me: int, n: int) -> None:
        local = _compat.local_tensor(dt).contiguous()
        if root is None:
            full = torch.empty(dt.shape, dtype=local.dtype, device=local.device)
            _compat.all_gather_into(full, local, group=pg)
        else:
            full = torch.empty(dt.shape, dtype=local.dtype, device=local.device) if me == root else None
            # Each rank's piece lands in its rows of the full tensor.
            dist.gather(local, list(full.chunk(n)) if full is not None else None, dst=root, group=pg)
            if full is None:
                return
        self._keep(key, full)

    def _buckets(self, runs: list[_Run], n: int):
        """Buckets of (run, start, stop): runs in order, cut where a bucket is full."""
        limit = max(self.bucket_bytes // n, 1)
        bucket, size = [], 0
        for run in runs:
            piece, start, count = run.piece_bytes(n), 0, len(run.tensors)
            while start < count:
                take = min(count - start, (limit - aligned(size)) // piece if piece else count)
                if take <= 0 and bucket:
                    yield bucket
                    bucket, size = [], 0
                    continue
                take = max(take, 1)  # one at least in an empty bucket
                bucket.append((run, start, start + take))
                size = aligned(size) + take * piece
                start += take
        if bucket:
            yield bucket

    def _gather_bucket(self, bucket: list[tuple[_Run, int, int]], pg, root: int | None, me: int, n: int) -> None:
        offsets, total = [], 0
        for run, start, stop in bucket:
            total = aligned(total)
            offsets.append(total)
            total += (stop - start) * run.piece_bytes(n)
        total = aligned(total)
        device = _compat.local_tensor(bucket[0][0].first).device
        if total == 0:  # only empty tensors: every rank knows that without asking
            if root is None or me == root:
                for run, start, stop in bucket:
                    for key, dt in zip(run.keys[start:stop], run.tensors[start:stop]):
                        self._keep(key, torch.empty(dt.shape, dtype=dt.dtype, device=device))
            return
        send = torch.zeros(total, dtype=torch.uint8, device=device)
        for (run, start, stop), off in zip(bucket, offsets):
            self._pack(send, off, run, start, stop, n)
        if root is None:
            recv = torch.empty(n * total, dtype=torch.uint8, device=device)
            _compat.all_gather_into(recv, send, group=pg)
            rows = list(recv.view(n, total))
        else:
            rows = [torch.empty(total, dtype=torch.uint8, device=device) for _ in range(n)] if me == root else None
            dist.gather(send, rows, dst=root, group=pg)
            if me != root:
                return
        for (run, start, stop), off in zip(bucket, offsets):
            self._assemble(run, start, stop, rows, off, n)

    @staticmethod
    def _pack(send: torch.Tensor, off: int, run: _Run, start: int, stop: int, n: int) -> None:
        """This rank's pieces of ``run``'s tensors ``start:stop``, each at its stride
        (the largest piece) in ``send`` from ``off``: small ones stacked in one
        copy, large ones copied one by one."""
        locals_ = [_compat.local_tensor(dt) for dt in run.tensors[start:stop]]
        first, width = locals_[0], run.piece_bytes(n)
        nbytes = first.numel() * first.dtype.itemsize
        if nbytes == 0:
            return
        if nbytes >= STACK_BYTES:  # one copy each, straight into its place
            for i, local in enumerate(locals_):
                at = off + i * width
                send[at : at + nbytes].view(local.dtype).view(local.shape).copy_(local)
            return
        stacked = torch.stack(locals_).reshape(len(locals_), first.numel()).view(torch.uint8)
        send[off : off + len(locals_) * width].view(len(locals_), width)[:, :nbytes].copy_(stacked)

    def _assemble(self, run: _Run, start: int, stop: int, rows, off: int, n: int) -> None:
        """The full tensors of ``run``'s tensors ``start:stop`` from every rank's
        pieces: one concatenation of the stacks, then a tensor of its own for each."""
        first, d, count = run.first, run.shard_dim, stop - start
        shape, width, itemsize = list(first.shape), run.piece_bytes(n), first.dtype.itemsize
        parts = []
        for r in range(n):
            begin, end = chunk_bounds(shape[d], n, r)
            piece_shape = [count] + shape[:d] + [end - begin] + shape[d + 1 :]
            nbytes = math.prod(piece_shape[1:]) * itemsize
            if nbytes == 0:
                parts.append(torch.empty(piece_shape, dtype=first.dtype, device=rows[r].device))
                continue
            block = rows[r][off : off + count * width].view(count, width)[:, :nbytes]
            parts.append(block.view(first.dtype).view(piece_shape))
        keys = run.keys[start:stop]
        if width >= STACK_BYTES:  # one concatenation each: a tensor of its own in one copy
            for i, key in enumerate(keys):
                self._keep(key, torch.cat([part[i] for part in parts], dim=d))
            return
        full = torch.cat(parts, dim=d + 1)
        if self.cpu:
            full = full.cpu()
        for key, tensor in zip(keys, full.unbind(0)):
            self.results[key] = tensor.clone()
