"""Pieces of tensors only the root holds, delivered to the ranks that need them.

Every rank knows each tensor's shape and dtype (a manifest) and what region
of it each rank needs (:class:`~.needs.Need`, exchanged as :class:`~.needs.PackedNeeds`).
:class:`Scatterer` then moves the pieces from the root (the first rank of
the model's group, see :mod:`hyperdsd.transport.group`): a large tensor that
every rank needs an equal run of whole rows of moves in one scatter, straight
into each rank's destination; a large tensor of which ranks need runs of
elements (what a wrapper layout's shards hold of a parameter, uneven) goes point to point, each run
straight from the full tensor to where it lands; the rest travel packed in
bounded byte buckets, one uneven all-to-all from the root per bucket, so that each rank
receives its own pieces and nothing more (a scatter sends every rank as
many bytes as the widest rank's pieces: on uneven shards, a rank with a
small share received several times it). Pieces are aligned to their dtype's
size only. The bucket plan is computed alike on every rank from what every
rank knows, so no rank waits on a collective another does not issue.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .collectives import BUCKET_BYTES, DIRECT_BYTES, as_bytes, exchange, from_bytes
from .group import Group, world
from .needs import Metas, Need, PackedNeeds, alike_groups

# Tensors up to this size are packed in runs with the others of their shape
# (stacked: a copy of the run on the root while it packs).
_STACKED_BYTES = 64 << 10


# Tensors whose pieces are packed one after the other, and the bytes of
# each one's piece on every rank (-1: the rank needs none)
Run = tuple[list[int], tuple[int, ...]]


class Scatterer:
    """Every rank's needs of the root's tensors, delivered one collective per bucket.

    Build it alike on every rank of ``group`` (``fulls`` only on its root;
    ``everyone``: needs by group rank) and call
    :meth:`run`. With ``on_piece``, each piece is handed over as a view into
    the bucket as it arrives (copy what you keep), so a rank holds its own
    state plus one bucket; without it, pieces are returned. ``on_run``,
    beside it, takes a run's pieces at once, stacked (one view of the
    bucket), in the order of the tensors it names. ``target_for`` names where
    a large piece may be received in place.
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
        on_run: Callable[[Sequence[int], torch.Tensor], None] | None = None,
    ):
        self.group = group or world()
        self.on_run = on_run
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
        self._sizes: list[int] = []  # bytes of each tensor, see run
        self._objects: list[int] = []  # id() of each tensor's meta, see run
        self._distinct: dict[int, Any] = {}  # each distinct meta object by its id

    def _nbytes(self, i: int) -> int:
        """Bytes of the root's tensor ``i``."""
        return self._sizes[i]

    def run(self) -> list[torch.Tensor | None]:
        # Bytes of each tensor: worked out once per distinct (shape, dtype) object (the manifest shares them).
        self._objects = objects = list(map(id, self.metas))
        self._distinct = dict(zip(objects, self.metas))
        of_object = {k: math.prod(m.shape) * m.dtype.itemsize for k, m in self._distinct.items()}
        self._sizes = list(map(of_object.__getitem__, objects))
        # Only a large tensor can move on its own: most of a model of many small tensors are not.
        big = self.world > 1 and max(of_object.values(), default=0) >= DIRECT_BYTES
        large = [i for i, n in enumerate(self._sizes) if n >= DIRECT_BYTES] if big else []
        direct = [i for i in large if self._direct(i)]
        for i in direct:
            self._scatter_one(i)
        runs = [i for i in large if self._runs_apart(i)]
        self._send_runs(runs)
        skip = set(direct) | set(runs)
        # A range, not a list, when nothing went direct (tens of thousands of small tensors).
        rest = [i for i in range(len(self.metas)) if i not in skip] if skip else range(len(self.metas))
        bucket: list[Run] = []
        used = [0] * self.world
        for members, sizes in self._runs(rest):
            steps = [n if n > 0 else 0 for n in sizes]
            itemsize = self.metas[members[0]].dtype.itemsize
            while members:
                # As many of the run's tensors as fit what the bucket has left
                # on every rank; one at least in an empty bucket.
                starts = [_align(u, itemsize) if step else u for u, step in zip(used, steps)]
                room = min(((self.limit - u) // step for u, step in zip(starts, steps) if step), default=len(members))
                take = min(len(members), room) if room > 0 or bucket else 1
                if take <= 0:
                    self._scatter_bucket(bucket)
                    bucket, used = [], [0] * self.world
                    continue
                bucket.append((members if take == len(members) else members[:take], sizes))
                used = [u + take * step for u, step in zip(starts, steps)]
                members = members[take:] if take < len(members) else []
        if bucket:
            self._scatter_bucket(bucket)
        return self.out

    def _runs(self, indices: Sequence[int]) -> list[Run]:
        """The tensors in the order their pieces are packed, as runs cut alike.

        Small tensors of one shape and dtype of which every rank needs the
        same region form a run: the root cuts it for each rank in one
        operation, and the bucket plan is made per run. Any other tensor is
        a run of its own. Every rank computes the same runs: from the same
        metas and needs, by value, in index order.
        """
        packed = all(isinstance(e, PackedNeeds) for e in self.everyone)
        # each distinct (shape, dtype) by a number: by value (never by object identity: the
        # root's own objects are other than the copies the other ranks received), asked once per object
        by_value: dict[tuple, int] = {}
        sizes = self._sizes
        whole = indices == range(len(self.metas))  # (every tensor, in order: the lists as they are)
        if whole:  # (as run() found them)
            objects, distinct = self._objects, self._distinct
        else:
            metas = list(map(self.metas.__getitem__, indices))
            objects = list(map(id, metas))
            distinct = dict(zip(objects, metas))
        codes = {k: by_value.setdefault(tuple(m), len(by_value)) for k, m in distinct.items()}
        if packed and max(sizes if whole else map(sizes.__getitem__, indices), default=0) <= _STACKED_BYTES:
            # (every tensor small: the tensors of each key found a column at a time, in torch)
            groups = alike_groups(map(codes.__getitem__, objects), [e.index for e in self.everyone], indices)
            return [self._run(members) for members in groups]
        # each tensor's needs, rank by rank: what every rank packed (a region's number), or the regions
        per_rank = list(zip(*(e.index for e in self.everyone))) if packed else None
        keys = (
            ("alone", i)
            if sizes[i] > _STACKED_BYTES
            else (codes[id(self.metas[i])], per_rank[i] if packed else tuple([e[i] for e in self.everyone]))
            for i in indices
        )
        runs: dict[Any, list[int]] = {}
        for i, key in zip(indices, keys):
            members = runs.get(key)
            if members is None:
                runs[key] = [i]
            else:
                members.append(i)
        return [self._run(members) for members in runs.values()]

    def _run(self, members: list[int]) -> Run:
        """``members`` (tensors every rank needs alike) with the bytes of each rank's piece of each."""
        first = members[0]
        itemsize = self.metas[first].dtype.itemsize
        return members, tuple(-1 if (need := e[first]) is None else need.numel() * itemsize for e in self.everyone)

    def _direct(self, i: int) -> bool:
        """Every rank needs an equal run of whole rows of tensor ``i``, and it is large."""
        shape, dtype = self.metas[i]
        if self._nbytes(i) < DIRECT_BYTES:
            return False  # no piece can be large: most tensors of a model with many parameters
        sizes = set()
        for needs in self.everyone:
            need = needs[i]
            if need is None or need.is_run or not need.region:
                return False
            if any(need.region[d] != (0, shape[d]) for d in range(1, len(shape))):
                return False
            sizes.add(need.numel())
        return len(sizes) == 1 and sizes.pop() * dtype.itemsize >= DIRECT_BYTES

    def _runs_apart(self, i: int) -> bool:
        """Every rank that needs tensor ``i`` needs a run of its elements (a
        flat shard's part), and it is large: the runs go point to point."""
        if self._nbytes(i) < DIRECT_BYTES:
            return False
        needs = [e[i] for e in self.everyone]
        return any(n is not None for n in needs) and all(n is None or n.is_run for n in needs)

    def _send_runs(self, indices: list[int]) -> None:
        """Large tensors' runs (:meth:`_runs_apart`): the root sends each rank its
        run straight from the full tensor, received where it lands (no packing,
        no bucket); a rank holds no more than its runs. The root waits for its
        sends whenever a bucket's bytes are in flight (a run of a tensor that
        is not contiguous is a copy)."""
        if not indices:
            return
        pg, root = self.group.pg, self.group.root
        works, received, in_flight = [], [], 0
        for i in indices:
            need = self.everyone[self.me][i]
            if self.me == 0:
                if in_flight >= self.limit:
                    for work in works:
                        work.wait()
                    works, in_flight = [], 0
                for r in range(1, self.world):
                    theirs = self.everyone[r][i]
                    if theirs is not None and theirs.size:
                        piece = theirs.cut(self.fulls[i]).to(self.device).contiguous()
                        works.append(dist.isend(piece, dst=self.group.ranks[r], group=pg, tag=i))
                        in_flight += piece.nbytes
                if need is not None:
                    self._deliver(i, need.cut(self.fulls[i]).to(self.device), view=True)
            elif need is not None and need.size:
                recv = self._receive_into(i, need)
                works.append(dist.irecv(recv, src=root, group=pg, tag=i))
                received.append((i, recv))
        for work in works:
            work.wait()
        for i, recv in received:
            self._deliver(i, recv, view=False)

    def _deliver(self, i: int, piece: torch.Tensor, *, view: bool) -> None:
        if self.on_piece is not None:
            self.on_piece(i, piece)
        else:
            self.out[i] = piece.clone() if view else piece

    def _scatter_one(self, i: int) -> None:
        """One large tensor: the root's rows go straight into each rank's destination."""
        recv = self._receive_into(i, self.everyone[self.me][i])
        sends = None
        if self.me == 0:
            sends = [self.everyone[r][i].cut(self.fulls[i]).to(self.device) for r in range(self.world)]
        dist.scatter(recv, sends, src=self.group.root, group=self.group.pg)
        self._deliver(i, recv, view=False)

    def _receive_into(self, i: int, need: Need) -> torch.Tensor:
        """Where this rank receives its piece of tensor ``i``: where it lands
        (``target_for``) if that fits, else a new tensor."""
        shape, dtype = need.shape(), self.metas[i].dtype
        target = self.target_for(i) if self.target_for is not None else None
        usable = target is not None and target.is_contiguous() and list(target.shape) == shape and target.dtype == dtype
        return target if usable else torch.empty(shape, dtype=dtype, device=self.device)

    def _layout(self, bucket: list[Run], r: int) -> tuple[list[int], int]:
        """Where each run's pieces start in rank ``r``'s buffer, and its width.

        Pieces follow one another, each run starting at a multiple of its
        dtype's size (all a view of the bytes as that dtype needs); pieces of
        one run (one dtype) lie back to back, with no padding between them.
        """
        starts, off = [], 0
        for members, sizes in bucket:
            n = sizes[r]
            if n > 0:
                off = _align(off, self.metas[members[0]].dtype.itemsize)
            starts.append(off)
            off += len(members) * max(n, 0)
        return starts, off

    def _scatter_bucket(self, bucket: list[Run]) -> None:
        """One bucket: each rank receives exactly its own pieces (an uneven
        all-to-all from the root), never padding up to another rank's width."""
        layouts = [self._layout(bucket, r) for r in range(self.world)]
        widths = [w for _, w in layouts]
        if not any(widths):
            return
        recv = torch.empty(widths[self.me], dtype=torch.uint8, device=self.device)
        if self.me == 0:
            sends = self._pack(bucket, layouts)
            if self.world > 1:
                dist.all_to_all_single(
                    recv,
                    sends,
                    output_split_sizes=[widths[0]] + [0] * (self.world - 1),
                    input_split_sizes=widths,
                    group=self.group.pg,
                )
            else:
                recv = sends
        else:
            dist.all_to_all_single(
                recv,
                torch.empty(0, dtype=torch.uint8, device=self.device),
                output_split_sizes=[widths[self.me]] + [0] * (self.world - 1),
                input_split_sizes=[0] * self.world,
                group=self.group.pg,
            )
        starts = layouts[self.me][0]
        for (members, sizes), off in zip(bucket, starts):
            n = sizes[self.me]
            if n < 0:
                continue
            shape = self.everyone[self.me][members[0]].shape()
            if self.on_run is not None and n > 0:
                self.on_run(
                    members,
                    from_bytes(
                        recv[off : off + len(members) * n], self.metas[members[0]].dtype, [len(members), *shape]
                    ),
                )
                continue
            for i in members:
                self._deliver(i, from_bytes(recv[off : off + n], self.metas[i].dtype, shape), view=True)
                off += n

    def _pack(self, bucket: list[Run], layouts: list[tuple[list[int], int]]) -> torch.Tensor:
        """Every rank's buffer, one after the other: its pieces at their offsets.

        A run of small tensors is stacked once and each rank's region cut
        from the stack in one operation: packing tensor by tensor (a cut, a
        view and a copy per tensor and rank) was most of a broadcast load of
        a model with many small parameters, all of it on the root.
        """
        out = torch.zeros(sum(w for _, w in layouts), dtype=torch.uint8, device=self.device)
        bases = [0] * self.world
        for r in range(1, self.world):
            bases[r] = bases[r - 1] + layouts[r - 1][1]
        for j, (members, sizes) in enumerate(bucket):
            first, k = members[0], len(members)
            stacked = None
            for r, n in enumerate(sizes):
                if n <= 0:
                    continue
                at = bases[r] + layouts[r][0][j]
                need = self.everyone[r][first]
                dest = out[at : at + k * n].view(k, n)
                if k == 1:
                    dest.copy_(as_bytes(need.cut(self.fulls[first])).view(1, n))
                else:
                    if stacked is None:
                        stacked = _stack(list(map(self.fulls.__getitem__, members)))
                    dest.copy_(as_bytes(need.cut_each(stacked)).view(k, n))
        return out


def _align(offset: int, itemsize: int) -> int:
    return -(-offset // itemsize) * itemsize


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    try:
        return torch.stack(tensors)
    except RuntimeError:  # on several devices: stacked where they can all be read
        return torch.stack([t.cpu() for t in tensors])


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
    on_run: Callable[[Sequence[int], torch.Tensor], None] | None = None,
) -> list[torch.Tensor | None]:
    """Deliver to every rank of ``group`` (default: the world) the regions it
    needs of tensors only the group's root holds.

    ``metas`` are known everywhere; ``fulls`` only on the root; ``needs`` are
    this rank's. Every rank learns every rank's needs (one all-gather of
    small objects, unless the caller already exchanged them:
    ``everyone_needs``), then :class:`Scatterer` moves the pieces.
    """
    everyone = everyone_needs if everyone_needs is not None else exchange(PackedNeeds(needs), group)
    return Scatterer(metas, fulls, everyone, device, bucket_bytes, on_piece, target_for, group, on_run).run()
