"""Sending the root's full dict to the other ranks (``broadcast_from_rank0``).

The root sends the dict's structure first (keys, shapes, dtypes, every
non-tensor value), then its tensors one at a time, in the structure's order.
A tensor that lands in a SplitTensor is scattered: each rank receives its
own block only (padded to the longest block), so that no rank ever holds
more than its share plus one tensor in flight. Every other tensor is
broadcast whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .tensor import SplitTensor, block_of, cut


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in the structure the root sent."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _hollow(tree, found: list) -> Any:
    """``tree`` with each tensor replaced by a :class:`_Slot`; the tensors in ``found``."""
    if isinstance(tree, SplitTensor):  # not a full tensor: arrives as a value no load accepts
        return f"<a SplitTensor of shape {tuple(tree.shape)}: broadcast_from_rank0 sends full tensors>"
    if isinstance(tree, torch.Tensor):
        found.append(tree)
        return _Slot(len(found) - 1, tuple(tree.shape), tree.dtype)
    if isinstance(tree, dict):
        return {k: _hollow(v, found) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_hollow(v, found) for v in tree)
    return tree


def _scatter_block(full, target: SplitTensor, dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
    """This rank's block of the root's ``full`` (of ``dtype``), laid out as ``target``; only that block travels.
    It lands where ``target``'s block lives (on ``device`` for a block still on the meta device)."""
    mesh = target.mesh
    if target._local.device.type != "meta":
        device = target._local.device
    blocks = []
    for rank in sorted(mesh.ranks):  # the group's order
        coord = _coordinate(mesh, rank)
        _, sizes = block_of(target.shape, mesh.shape, target.placements, coord)
        blocks.append(sizes)
    longest = max(_numel(s) for s in blocks)
    me = sorted(mesh.ranks).index(dist.get_rank())
    received = torch.empty(max(longest, 1), dtype=dtype, device=device)
    pieces = None
    if dist.get_rank() == src:
        pieces = []
        for rank in sorted(mesh.ranks):
            offsets, sizes = block_of(full.shape, mesh.shape, target.placements, _coordinate(mesh, rank))
            block = full
            for d, (start, length) in enumerate(zip(offsets, sizes)):
                block = block.narrow(d, start, length)
            flat = torch.zeros(max(longest, 1), dtype=dtype, device=device)
            flat[: block.numel()].copy_(block.reshape(-1))
            pieces.append(flat)
    dist.scatter(received, pieces, src=src, group=mesh.whole_group())
    return received[: _numel(blocks[me])].reshape(blocks[me]).clone()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _coordinate(mesh, rank: int) -> tuple[int, ...]:
    flat, out = mesh.ranks.index(rank), []
    for n in reversed(mesh.shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def send_from_root(
    tree,
    *,
    src: int,
    group,
    device: torch.device,
    target_of: Callable[[tuple, _Slot], SplitTensor | None],
):
    """The root's ``tree`` on every rank (others pass anything, ``{}``).

    ``target_of(path, slot)`` names the SplitTensor a tensor will be loaded
    into, or None: a tensor of that SplitTensor's global shape arrives as a
    SplitTensor laid out like it, holding this rank's block; any other
    tensor arrives whole, on ``device``. Collective over ``group``."""
    found: list = []
    box = [_hollow(tree, found) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return _fill(box[0], (), found, src, group, device, target_of)


def _fill(skeleton, path, found, src, group, device, target_of):
    if isinstance(skeleton, _Slot):
        mine = found[skeleton.index] if dist.get_rank() == src else None
        target = target_of(path, skeleton)
        if target is not None and tuple(target.shape) == skeleton.shape and target.mesh.size() > 1:
            block = _scatter_block(mine, target, skeleton.dtype, src, device)
            return SplitTensor(block, target.mesh, target.placements, target.shape)
        if mine is not None:
            buffer = mine.detach().to(device).clone()
        else:
            buffer = torch.empty(skeleton.shape, dtype=skeleton.dtype, device=device)
        dist.broadcast(buffer, src=src, group=group)
        if target is not None and tuple(target.shape) == skeleton.shape:
            return SplitTensor(
                cut(buffer, target.mesh, target.placements), target.mesh, target.placements, target.shape
            )
        return buffer
    if isinstance(skeleton, dict):
        return {k: _fill(v, path + (k,), found, src, group, device, target_of) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(
            _fill(v, path + (i,), found, src, group, device, target_of) for i, v in enumerate(skeleton)
        )
    return skeleton
