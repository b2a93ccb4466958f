"""Pieces of tensors only the root holds, delivered to the ranks that need them.

Every rank knows each tensor's shape and dtype (a manifest) and what region
of it each rank needs (:class:`Need`, exchanged as :class:`PackedNeeds`).
:class:`Scatterer` then moves the pieces from the root (the first rank of
the model's group, see :mod:`group`): a large tensor that
every rank needs an equal run of whole rows of moves in one scatter, straight
into each rank's destination; the rest travel packed in bounded byte
buckets, one scatter per bucket. The bucket plan is computed alike on every
rank from what every rank knows, so no rank waits on a collective another
does not issue.
"""

from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .collectives import BUCKET_BYTES, DIRECT_BYTES, aligned, as_bytes, exchange, from_bytes
from .group import Group, world
from .placement import DTensorLayout

# (shape, dtype) of each of the root's tensors, in manifest order
Metas = Sequence[tuple[torch.Size, torch.dtype]]


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

    # Needs repeat (many tensors of one shape share a Need): computed once each.
    @functools.cached_property
    def size(self) -> int:
        return math.prod(b - a for a, b in self.region)

    def numel(self) -> int:
        return self.size

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


class Scatterer:
    """Every rank's needs of the root's tensors, delivered one collective per bucket.

    Build it alike on every rank of ``group`` (``fulls`` only on its root;
    ``everyone``: needs by group rank) and call
    :meth:`run`. With ``on_piece``, each piece is handed over as a view into
    the bucket as it arrives (copy what you keep), so a rank holds its own
    state plus one bucket; without it, pieces are returned. ``target_for``
    names where a large piece may be received in place.
    """

    def __init__(
        self,
        metas: Metas,
        fulls: Sequence[torch.Tensor] | None,
        everyone: Sequence[Sequence[Need | None]],
        device: torch.device,
        bucket_bytes: int | None = None,
        on_piece: Callable[[int, torch.Tensor], None] | None = None,
        target_for: Callable[[int], torch.Tensor | None] | None = None,
        group: Group | None = None,
    ):
        self.group = group or world()
        self.metas = metas
        self.fulls = fulls
        self.everyone = everyone
        self.device = device
        self.limit = bucket_bytes or BUCKET_BYTES
        self.on_piece = on_piece
        self.target_for = target_for
        self.world = self.group.size
        self.me = self.group.index
        self.out: list[torch.Tensor | None] = [None] * len(metas)

    def run(self) -> list[torch.Tensor | None]:
        direct = [i for i in range(len(self.metas)) if self.world > 1 and self._direct(i)]
        for i in direct:
            self._scatter_one(i)
        skip = set(direct)
        # A range, not a list, when nothing went direct (tens of thousands of small tensors).
        rest = [i for i in range(len(self.metas)) if i not in skip] if skip else range(len(self.metas))
        # Bytes of each rank's piece of each tensor (-1: not needed), computed
        # once per rank: the bucket plan reads them for every tensor.
        self.nbytes = [self._piece_sizes(r) for r in range(self.world)]
        totals = [sum(aligned(n) for n in (self.nbytes[r][i] for i in rest) if n > 0) for r in range(self.world)]
        if max(totals, default=0) <= self.limit:  # everything fits one bucket (small tensors, however many)
            if rest:
                self._scatter_bucket(rest)
            return self.out
        bucket: list[int] = []
        sizes = [0] * self.world
        for i in rest:
            grow = [aligned(max(self.nbytes[r][i], 0)) for r in range(self.world)]
            if bucket and max(s + g for s, g in zip(sizes, grow)) > self.limit:
                self._scatter_bucket(bucket)
                bucket, sizes = [], [0] * self.world
            bucket.append(i)
            sizes = [s + g for s, g in zip(sizes, grow)]
        if bucket:
            self._scatter_bucket(bucket)
        return self.out

    def _piece_sizes(self, r: int) -> array:
        """Bytes of rank ``r``'s piece of every tensor; -1 where it needs none."""
        needs = self.everyone[r]
        return array("q", (-1 if (need := needs[i]) is None else need.numel() * dtype.itemsize for i, (_, dtype) in enumerate(self.metas)))

    def _direct(self, i: int) -> bool:
        """Every rank needs an equal run of whole rows of tensor ``i``, and it is large."""
        shape, dtype = self.metas[i]
        if math.prod(shape) * dtype.itemsize < DIRECT_BYTES:
            return False  # no piece can be large: most tensors of a model with many parameters
        sizes = set()
        for needs in self.everyone:
            need = needs[i]
            if need is None or not need.region or any(need.region[d] != (0, shape[d]) for d in range(1, len(shape))):
                return False
            sizes.add(need.numel())
        return len(sizes) == 1 and sizes.pop() * dtype.itemsize >= DIRECT_BYTES

    def _deliver(self, i: int, piece: torch.Tensor, *, view: bool) -> None:
        if self.on_piece is not None:
            self.on_piece(i, piece)
        else:
            self.out[i] = piece.clone() if view else piece

    def _scatter_one(self, i: int) -> None:
        """One large tensor: the root's rows go straight into each rank's destination."""
        need = self.everyone[self.me][i]
        shape, dtype = need.shape(), self.metas[i][1]
        target = self.target_for(i) if self.target_for is not None else None
        usable = target is not None and target.is_contiguous() and list(target.shape) == shape and target.dtype == dtype
        recv = target if usable else torch.empty(shape, dtype=dtype, device=self.device)
        sends = None
        if self.me == 0:
            sends = [self.everyone[r][i].cut(self.fulls[i]).to(self.device) for r in range(self.world)]
        dist.scatter(recv, sends, src=self.group.root, group=self.group.pg)
        self._deliver(i, recv, view=False)

    def _scatter_bucket(self, bucket: Sequence[int]) -> None:
        # Every rank computes every buffer's width, but walks only its own
        # pieces (the root: every rank's, one at a time, as it packs them):
        # a list of every rank's offsets would be the largest thing a
        # non-root rank holds during a load of many small tensors.
        width = max(self._bucket_width(bucket, r) for r in range(self.world))
        if width == 0:
            return
        recv = torch.empty(width, dtype=torch.uint8, device=self.device)
        if self.me == 0:
            sends = [self._pack(bucket, r, width) for r in range(self.world)]
            if self.world > 1:
                dist.scatter(recv, sends, src=self.group.root, group=self.group.pg)
            else:
                recv = sends[0]
        else:
            dist.scatter(recv, None, src=self.group.root, group=self.group.pg)
        for i, off, nbytes in self._pieces(bucket, self.me):
            piece = from_bytes(recv[off : off + nbytes], self.metas[i][1], self.everyone[self.me][i].shape())
            self._deliver(i, piece, view=True)

    def _pack(self, bucket: Sequence[int], r: int, width: int) -> torch.Tensor:
        """Rank ``r``'s buffer: its pieces at their offsets, zero padding between (one concatenation)."""
        parts, end = [], 0
        zeros = torch.zeros(aligned(1), dtype=torch.uint8, device=self.device)  # padding is shorter than this
        for i, off, nbytes in self._pieces(bucket, r):
            if off > end:
                parts.append(zeros[: off - end])
            parts.append(as_bytes(self.everyone[r][i].cut(self.fulls[i]).to(self.device)))
            end = off + nbytes
        if width > end:
            parts.append(torch.zeros(width - end, dtype=torch.uint8, device=self.device))
        return torch.cat(parts) if parts else torch.zeros(width, dtype=torch.uint8, device=self.device)

    def _pieces(self, bucket: Sequence[int], r: int) -> Iterator[tuple[int, int, int]]:
        """``(tensor, offset, bytes)`` of each piece rank ``r`` needs, in its buffer's order."""
        off = 0
        sizes = self.nbytes[r]
        for i in bucket:
            nbytes = sizes[i]
            if nbytes >= 0:
                yield i, off, nbytes
                off += aligned(nbytes)

    def _bucket_width(self, bucket: Sequence[int], r: int) -> int:
        sizes = self.nbytes[r]
        return sum(aligned(n) for n in (sizes[i] for i in bucket) if n >= 0)


def scatter_from_root(
    metas: Metas,
    fulls: Sequence[torch.Tensor] | None,
    needs: Sequence[Need | None],
    device: torch.device,
    bucket_bytes: int | None = None,
    on_piece: Callable[[int, torch.Tensor], None] | None = None,
    target_for: Callable[[int], torch.Tensor | None] | None = None,
    everyone_needs: Sequence[Sequence[Need | None]] | None = None,
    group: Group | None = None,
) -> list[torch.Tensor | None]:
    """Deliver to every rank of ``group`` (default: the world) the regions it
    needs of tensors only the group's root holds.

    ``metas`` are known everywhere; ``fulls`` only on the root; ``needs`` are
    this rank's. Every rank learns every rank's needs (one all-gather of
    small objects, unless the caller already exchanged them:
    ``everyone_needs``), then :class:`Scatterer` moves the pieces.
    """
    everyone = everyone_needs if everyone_needs is not None else exchange(PackedNeeds(needs), group)
    return Scatterer(metas, fulls, everyone, device, bucket_bytes, on_piece, target_for, group).run()
