"""ownstack's distributed tensor: a wrapper holding this rank's block, its placements and its mesh.

:class:`SplitTensor` is not torch's DTensor, nor a subclass of it. It
behaves as the vendor stacks it stands in for behave: it describes a global
tensor (shape, dtype, device) while holding only this rank's block
(``_local``), and torch operations on it are refused except for the few
that parameters, ``state_dict()`` and autograd need to handle a tensor
without computing with it (detach, alias). Inside :func:`local_ops` every
operation runs on the local blocks instead: the optimizer's step and its
``load_state_dict`` work there, and what they create (``zeros_like(p)``,
``grad.clone()``) is plain local blocks, not SplitTensors.

Blocks are cut as ``torch.chunk`` cuts: ``ceil(size / parts)`` rows each,
so trailing blocks may be short or empty (3 rows on 4 ranks: 1, 1, 1, 0).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import _compat

aten = torch.ops.aten


@dataclass(frozen=True)
class Shard:
    """The tensor is cut along tensor dimension ``dim`` over a mesh dimension."""

    dim: int


@dataclass(frozen=True)
class Replicate:
    """Every rank of a mesh dimension holds the same block."""


# -- the dispatch context ----------------------------------------------------
# A process-wide depth, not a thread-local one: autograd may run a backward
# on a thread of its own (one per accelerator), and the stack's own backward
# enters the context there.
_DEPTH = [0]
_DEPTH_LOCK = threading.Lock()


@contextlib.contextmanager
def local_ops():
    """Run torch operations on SplitTensors' local blocks (re-entrant).

    In-place and ``out=`` operations return the SplitTensor they changed;
    every other operation returns plain local tensors."""
    with _DEPTH_LOCK:
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _DEPTH_LOCK:
            _DEPTH[0] -= 1


def in_local_ops() -> bool:
    return _DEPTH[0] > 0


# -- where a block lies -------------------------------------------------------


def chunk_span(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of block ``index`` of ``parts`` along a dimension of ``size``."""
    chunk = -(-size // parts) if size else 0
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


def block_of(shape, mesh_shape, placements, coordinate, upto: int | None = None):
    """(offsets, sizes) of the block at ``coordinate`` of a tensor of global
    ``shape``; ``upto``: only the first ``upto`` mesh dimensions cut it."""
    offsets, sizes = [0] * len(shape), list(shape)
    for mdim, place in enumerate(placements[:upto]):
        if isinstance(place, Shard):
            start, length = chunk_span(sizes[place.dim], mesh_shape[mdim], coordinate[mdim])
            offsets[place.dim] += start
            sizes[place.dim] = length
    return tuple(offsets), tuple(sizes)


def cut(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """This rank's block of ``full`` (its own storage); no communication."""
    offsets, sizes = block_of(full.shape, mesh.shape, placements, mesh.coordinate())
    block = full
    for d, (start, length) in enumerate(zip(offsets, sizes)):
        if length != full.shape[d]:
            block = block.narrow(d, start, length)
    return block.clone(memory_format=torch.contiguous_format)


def _check_placements(mesh, placements) -> tuple:
    placements = tuple(placements)
    if len(placements) != mesh.ndim() or not all(isinstance(p, (Shard, Replicate)) for p in placements):
        raise ValueError(f"ownstack: placements {placements} do not fit {mesh} (one Shard or Replicate per dim)")
    return placements


class SplitTensor(torch.Tensor):
    """A global tensor of which this rank holds one block (``_local``).

    ``mesh``: the :class:`~.mesh.Mesh` it lies on; ``placements``: one
    :class:`Shard` or :class:`Replicate` per mesh dimension."""

    _local: torch.Tensor

    @staticmethod
    def __new__(cls, local: torch.Tensor, mesh, placements, shape, requires_grad: bool = False):
        self = _compat.wrapper_subclass(
            cls, torch.Size(shape), dtype=local.dtype, device=local.device, requires_grad=requires_grad
        )
        self._local = local
        self.mesh = mesh
        self.placements = tuple(placements)
        return self

    def __init__(self, *args, **kwargs):  # everything happens in __new__
        super().__init__()

    __torch_function__ = _compat.NO_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _ANYWHERE.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if not in_local_ops():
            raise RuntimeError(
                f"SplitTensor: aten.{func.__name__} is refused outside ownstack.local_ops() "
                "(a SplitTensor computes only on its local block, inside that context)"
            )
        return _run_locally(func, args, kwargs)

    # -- the public API ------------------------------------------------------
    @classmethod
    def from_local(cls, local: torch.Tensor, mesh, placements, shape=None) -> "SplitTensor":
        """``local`` as this rank's block; ``shape``: the global shape (default:
        every block as large as this one, as when shards are even)."""
        placements = _check_placements(mesh, placements)
        if shape is None:
            shape = list(local.shape)
            for mdim, place in enumerate(placements):
                if isinstance(place, Shard):
                    shape[place.dim] *= mesh.size(mdim)
        return cls(local, mesh, placements, shape)

    def to_local(self) -> torch.Tensor:
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor on every rank of the mesh: gathers over each mesh
        dimension it is sharded on, the last first. Collective."""
        out = self._local
        mesh, coord = self.mesh, self.mesh.coordinate()
        for mdim in reversed(range(len(self.placements))):
            place = self.placements[mdim]
            if not isinstance(place, Shard) or mesh.size(mdim) == 1:
                continue
            _, region = block_of(self.shape, mesh.shape, self.placements, coord, upto=mdim)
            spans = [chunk_span(region[place.dim], mesh.size(mdim), i) for i in range(mesh.size(mdim))]
            out = _gather_along(out, place.dim, [n for _, n in spans], mesh.group(mdim))
        return out.clone() if out is self._local else out

    def __repr__(self) -> str:
        return (
            f"SplitTensor(shape={tuple(self.shape)}, dtype={self.dtype}, local={tuple(self._local.shape)}, "
            f"placements={self.placements}, mesh={self.mesh})"
        )

    def __deepcopy__(self, memo):
        out = SplitTensor(copy.deepcopy(self._local, memo), self.mesh, self.placements, self.shape)
        if isinstance(self, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        memo[id(self)] = out
        return out


def _gather_along(t: torch.Tensor, dim: int, lengths: list[int], group) -> torch.Tensor:
    """Concatenate every peer's block along ``dim`` (peers' lengths known):
    padded to the longest so that every rank sends the same size."""
    longest = max(lengths)
    if longest == 0:
        shape = list(t.shape)
        shape[dim] = 0
        return t.new_empty(shape)
    shape = list(t.shape)
    shape[dim] = longest
    padded = t.new_zeros(shape)
    padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    pieces = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(pieces, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, lengths)], dim=dim)


def distribute(full: torch.Tensor, mesh, placements) -> SplitTensor:
    """``full`` (the same on every rank) as a SplitTensor: each rank cuts its own block, no communication."""
    placements = _check_placements(mesh, placements)
    if mesh.coordinate() is None:
        raise ValueError(f"ownstack.distribute: this rank is not on {mesh}")
    return SplitTensor(cut(full.detach(), mesh, placements), mesh, placements, full.shape)


# -- how operations run ------------------------------------------------------


def _same_layout(make):
    def handler(t, *args, **kwargs):
        return SplitTensor(make(t._local, *args, **kwargs), t.mesh, t.placements, t.shape)

    return handler


# What works anywhere: handling a tensor without computing with it.
_ANYWHERE = {
    aten.detach.default: _same_layout(aten.detach.default),
    aten.alias.default: _same_layout(aten.alias.default),
}


def _unwrap(x):
    return x._local if isinstance(x, SplitTensor) else x


def tree_map(fn, tree):
    """``fn`` on every leaf of ``tree`` (lists, tuples and dicts rebuilt): an operation's arguments and results."""
    if isinstance(tree, list):
        return [tree_map(fn, x) for x in tree]
    if isinstance(tree, tuple):
        return tuple(tree_map(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def _run_locally(func, args, kwargs):
    """``func`` on local blocks; what it wrote into a SplitTensor's block comes back as that SplitTensor."""
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    written = {}
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, SplitTensor):
                written[id(t._local)] = t
    if not written:
        return out
    return tree_map(lambda x: written.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)
