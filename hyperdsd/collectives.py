"""Collectives, batched: the *how* of moving state between ranks.

Three jobs, each in as few collectives as the data allows:

* :func:`agree` - every rank learns whether any rank found a problem, so all
  raise together instead of some waiting forever in a later collective.
* :class:`Gatherer` - full tensors from DTensor shards, packed into byte
  buckets (one collective per bucket, not per tensor), to every rank of a
  shard group or only to a root.
* :func:`scatter_from_rank0` - rank 0 holds full tensors; each rank receives
  only the pieces it needs, in bounded buckets.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _compat
from .errors import StateDictError
from .placement import DTensorLayout, chunk_bounds

_ALIGN = 16
# Bucket size in bytes: one bucket is what a collective moves at once, and
# the most a rank holds beyond its own state while a transfer is in flight.
BUCKET_BYTES = int(float(os.environ.get("HYPERDSD_BUCKET_MB", "64")) * 2**20)
# Pieces at least this large, evenly split along dim 0, move on their own,
# straight between the shards and the full tensor: no packing, no copies.
DIRECT_BYTES = 1 << 20


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    if buf.numel() == 0:  # views of empty buffers may sit at unaligned offsets
        return torch.empty(shape, dtype=dtype, device=buf.device)
    return buf.view(dtype).reshape(shape)


# -- agreement -------------------------------------------------------------

def agree(problems: list[str], what: str, questions: dict[str, bool | None] | None = None) -> dict[str, bool]:
    """Raise :class:`StateDictError` on every rank if any rank has problems.

    One all-reduce of two flags when all is well; messages travel only when
    something is wrong. ``questions`` (name -> this rank's answer, or None
    where it cannot tell) are answered by the other ranks in the same step:
    the answer is True if any rank answered True. Returns the answers to this
    rank's open questions.
    """
    questions = questions or {}
    open_ = [k for k, v in questions.items() if v is None]
    if not active():
        if problems:
            raise StateDictError(_format(what, {0: problems}))
        return {k: True for k in open_}
    flags = torch.tensor([1 if problems else 0, 1 if open_ else 0], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    answers: dict[str, bool] = {}
    if flags[1]:
        known = exchange({k: v for k, v in questions.items() if v is not None})
        answers = answer(open_, known)
    if flags[0]:
        raise_if_any(exchange(problems), what)
    return answers


def exchange(obj: Any) -> list[Any]:
    """Every rank's ``obj``, on every rank (one all-gather of objects)."""
    if not active():
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def answer(open_questions, known_by_rank: list[dict[str, bool]]) -> dict[str, bool]:
    """True where any rank knows the answer is True; nobody knowing means nothing was there."""
    known: dict[str, bool] = {}
    for part in known_by_rank:
        for k, v in part.items():
            known[k] = known.get(k, False) or v
    return {k: known.get(k, True) for k in open_questions}


def raise_if_any(problems_by_rank: list[list[str]], what: str) -> None:
    if any(problems_by_rank):
        raise StateDictError(_format(what, {r: p for r, p in enumerate(problems_by_rank) if p}))


def _format(what: str, by_rank: dict[int, list[str]]) -> str:
    lines = [what]
    seen: dict[tuple, list[int]] = {}
    for r, problems in by_rank.items():
        seen.setdefault(tuple(problems), []).append(r)
    for problems, ranks in seen.items():
        who = "rank" if len(ranks) == 1 else "ranks"
        shown = list(problems[:20]) + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        lines.append(f"  on {who} {','.join(map(str, ranks))}:")
        lines += [f"    {p}" for p in shown]
    return "\n".join(lines)


# -- who holds what --------------------------------------------------------

def same_everywhere(keys: Sequence[str]) -> bool:
    """Whether every rank has the same keys (one small all-gather of digests)."""
    if not active():
        return True
    digest = hashlib.sha1("\0".join(keys).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    out = torch.empty(dist.get_world_size() * len(digest), dtype=torch.uint8)
    _compat.all_gather_into(out, mine, group=None)
    return bool((out.view(dist.get_world_size(), -1) == mine).all())


def roots_of(keys: Sequence[str]) -> dict[str, int]:
    """For each key any rank holds, the lowest rank that holds it."""
    if not active():
        return {k: 0 for k in keys}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, list(keys))
    roots: dict[str, int] = {}
    for r, ks in enumerate(everyone):
        for k in ks:
            roots.setdefault(k, r)
    return roots


def send_to_rank0(obj: Any) -> list[Any] | None:
    """Rank 0 receives every rank's ``obj`` (None from those with nothing)."""
    if not active():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


# -- gathering shards ------------------------------------------------------

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
            piece = _aligned(self._piece_bytes(item, n))
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
        inner = 1
        for d, s in enumerate(shape):
            if d != item.shard_dim:
                inner *= s
        return rows * inner * item.dt.element_size()

    def _gather_bucket(self, bucket: list[_Item], pg, root: int | None, me: int) -> None:
        n = dist.get_world_size(pg)
        offsets, total = [], 0
        for item in bucket:
            offsets.append(total)
            total += _aligned(self._piece_bytes(item, n))
        device = _compat.local_tensor(bucket[0].dt).device
        if total == 0:  # only empty tensors: every rank knows that without asking
            if root is None or me == root:
                for item in bucket:
                    self._keep(item.key, torch.empty(item.dt.shape, dtype=item.dt.dtype, device=device))
            return
        send = torch.zeros(total, dtype=torch.uint8, device=device)
        for item, off in zip(bucket, offsets):
            raw = _as_bytes(_compat.local_tensor(item.dt))
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
            count = 1
            for s in piece_shape:
                count *= s
            nbytes = count * item.dt.element_size()
            pieces.append(_from_bytes(rows[r][off : off + nbytes], item.dt.dtype, piece_shape))
        return torch.cat(pieces, dim=d)


# -- scattering from rank 0 ------------------------------------------------

@dataclass(frozen=True)
class Need:
    """What a rank needs of a full tensor: a region (slices as (start, stop))."""

    region: tuple[tuple[int, int], ...]

    @classmethod
    def whole(cls, shape) -> "Need":
        return cls(tuple((0, n) for n in shape))

    @classmethod
    def of_layout(cls, layout: DTensorLayout) -> "Need":
        return cls(tuple((s.start, s.stop) for s in layout.local_slices()))

    def shape(self) -> list[int]:
        return [b - a for a, b in self.region]

    def numel(self) -> int:
        n = 1
        for a, b in self.region:
            n *= b - a
        return n

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        return full[tuple(slice(a, b) for a, b in self.region)] if self.region else full


class PackedNeeds(Sequence):
    """One rank's needs as sent to the others: each distinct region once,
    then an index per tensor. Thousands of same-shaped tensors cost a few
    bytes each on the wire and in every rank's memory, not an object each."""

    def __init__(self, needs: Sequence[Need | None]):
        table: dict[Need, int] = {}
        index = array("i")
        for need in needs:
            index.append(-1 if need is None else table.setdefault(need, len(table)))
        self.table = list(table)
        self.index = index

    def __getitem__(self, i):  # type: ignore[override]
        j = self.index[i]
        return None if j < 0 else self.table[j]

    def __len__(self) -> int:
        return len(self.index)


def scatter_from_rank0(
    metas: Sequence[tuple[torch.Size, torch.dtype]],
    fulls: Sequence[torch.Tensor] | None,
    needs: Sequence[Need | None],
    device: torch.device,
    bucket_bytes: int | None = None,
    on_piece: Callable[[int, torch.Tensor], None] | None = None,
    target_for: Callable[[int], torch.Tensor | None] | None = None,
    everyone_needs: list[list[Need | None]] | None = None,
) -> list[torch.Tensor | None]:
    """Deliver to every rank the regions it needs of tensors only rank 0 holds.

    ``metas`` (shape, dtype per tensor) are known everywhere; ``fulls`` only on
    rank 0; ``needs`` are this rank's. Every rank learns every rank's needs
    (one all-gather of small objects, unless the caller already exchanged
    them: ``everyone_needs``), then large pieces move one scatter each and
    the rest in buckets. With ``on_piece``, each piece is handed over as a
    view into the bucket as it arrives (copy what you keep), so a rank holds its own state
    plus one bucket; without it, pieces are returned.
    """
    limit = bucket_bytes or BUCKET_BYTES
    world = dist.get_world_size() if active() else 1
    me = rank()
    everyone = everyone_needs if everyone_needs is not None else exchange(PackedNeeds(needs))
    out: list[torch.Tensor | None] = [None] * len(metas)

    def piece_bytes(i: int, r: int) -> int:
        need = everyone[r][i]
        return 0 if need is None else _aligned(need.numel() * _elem(metas[i][1]))

    direct = [i for i in range(len(metas)) if world > 1 and _scatter_direct(i, metas, everyone)]
    for i in direct:
        _scatter_one(i, metas, fulls, everyone, out, device, me, world, on_piece, target_for)
    bucket: list[int] = []
    sizes = [0] * world
    skip = set(direct)
    for i in range(len(metas)):
        if i in skip:
            continue
        grow = [piece_bytes(i, r) for r in range(world)]
        if bucket and max(s + g for s, g in zip(sizes, grow)) > limit:
            _scatter_bucket(bucket, metas, fulls, everyone, out, device, me, world, on_piece)
            bucket, sizes = [], [0] * world
        bucket.append(i)
        sizes = [s + g for s, g in zip(sizes, grow)]
    if bucket:
        _scatter_bucket(bucket, metas, fulls, everyone, out, device, me, world, on_piece)
    return out


def _scatter_direct(i: int, metas, everyone) -> bool:
    """Every rank needs an equal run of whole rows of tensor ``i``, and it is large."""
    shape, dtype = metas[i]
    sizes = set()
    for needs in everyone:
        need = needs[i]
        if need is None or not need.region or any(need.region[d] != (0, shape[d]) for d in range(1, len(shape))):
            return False
        sizes.add(need.numel())
    return len(sizes) == 1 and sizes.pop() * _elem(dtype) >= DIRECT_BYTES


def _scatter_one(i, metas, fulls, everyone, out, device, me, world, on_piece, target_for) -> None:
    """One large tensor: rank 0's rows go straight into each rank's destination."""
    need = everyone[me][i]
    shape, dtype = need.shape(), metas[i][1]
    target = target_for(i) if target_for is not None else None
    usable = target is not None and target.is_contiguous() and list(target.shape) == shape and target.dtype == dtype
    recv = target if usable else torch.empty(shape, dtype=dtype, device=device)
    sends = [everyone[r][i].cut(fulls[i]).to(device) for r in range(world)] if me == 0 else None
    dist.scatter(recv, sends, src=0)
    if on_piece is not None:
        on_piece(i, recv)
    else:
        out[i] = recv


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _scatter_bucket(bucket, metas, fulls, everyone, out, device, me, world, on_piece) -> None:
    layouts = []  # per rank: [(item, offset, nbytes)]
    for r in range(world):
        off, parts = 0, []
        for i in bucket:
            need = everyone[r][i]
            if need is None:
                continue
            nbytes = need.numel() * _elem(metas[i][1])
            parts.append((i, off, nbytes))
            off += _aligned(nbytes)
        layouts.append((parts, off))
    width = max(total for _, total in layouts)
    if width == 0:
        return
    recv = torch.empty(width, dtype=torch.uint8, device=device)
    if me == 0:
        sends = []
        for r in range(world):
            buf = torch.zeros(width, dtype=torch.uint8, device=device)
            for i, off, nbytes in layouts[r][0]:
                piece = everyone[r][i].cut(fulls[i])
                buf[off : off + nbytes] = _as_bytes(piece.to(device))
            sends.append(buf)
        if world > 1:
            dist.scatter(recv, sends, src=0)
        else:
            recv = sends[0]
    else:
        dist.scatter(recv, None, src=0)
    for i, off, nbytes in layouts[me][0]:
        piece = _from_bytes(recv[off : off + nbytes], metas[i][1], everyone[me][i].shape())
        if on_piece is not None:
            on_piece(i, piece)
        else:
            out[i] = piece.clone()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not active():
        return obj
    box = [obj if rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
