"""ownstack's own checkpoint format: one file per rank, loaded into any layout.

``save`` writes, on every rank, one file (``torch.save``) listing each leaf
of the state dict by its path: for a SplitTensor its block and where the
block starts in the global tensor (and the global shape), for any other
value the value itself (rank 0's copy is the one a load reads). Rank 0 also
writes a small index with the number of files. ``load`` reads every file and
fills the given template in place, as ``torch.distributed.checkpoint.load``
does: a SplitTensor gets its block assembled from whatever blocks the files
hold (so a checkpoint written by 4 ranks loads into 2 and back), a tensor is
copied into, a non-tensor replaced. Entries the checkpoint has and a
template dict lacks are added (a tensor whole, assembled from its blocks):
a freshly built optimizer's template has no state, and the set that follows
cuts what it needs. Template entries the checkpoint lacks are an error
naming them, before anything changes.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .tensor import SplitTensor, block_of

FORMAT = 1


def _where(process_group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _leaves(tree, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, leaf) of every leaf; dicts and lists are walked, everything else
    (tuples too) is a leaf. A list index is written ``(i,)``, a dict key as
    it is, so that a load can rebuild either kind of container."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, path + ((i,),))
    else:
        yield path, tree


def _record(leaf) -> tuple:
    if isinstance(leaf, SplitTensor):
        offsets, _ = block_of(leaf.shape, leaf.mesh.shape, leaf.placements, leaf.mesh.coordinate())
        return ("split", leaf._local.detach().cpu(), tuple(offsets), tuple(leaf.shape))
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.detach().cpu(), None, None)
    return ("value", leaf, None, None)


def save(state_dict: dict, *, checkpoint_id, process_group=None) -> None:
    """Write this rank's file under the directory ``checkpoint_id``; returns after every rank wrote."""
    rank, size = _where(process_group)
    folder = os.fspath(checkpoint_id)
    os.makedirs(folder, exist_ok=True)
    records = [(list(path), *_record(leaf)) for path, leaf in _leaves(state_dict)]
    torch.save(records, os.path.join(folder, f"rank{rank}.pt"))
    if rank == 0:
        torch.save({"format": FORMAT, "ranks": size}, os.path.join(folder, "index.pt"))
    if size > 1:
        dist.barrier(group=process_group)


def _read(folder: str) -> dict[tuple, list[tuple]]:
    """Every file's records by path, file 0's first."""
    index = torch.load(os.path.join(folder, "index.pt"), weights_only=True)
    if index.get("format") != FORMAT:
        raise ValueError(f"ownstack.checkpoint: {folder} is not a checkpoint of format {FORMAT}: {index}")
    by_path: dict[tuple, list[tuple]] = {}
    for i in range(index["ranks"]):
        for path, *record in torch.load(os.path.join(folder, f"rank{i}.pt"), weights_only=True):
            by_path.setdefault(tuple(path), []).append(tuple(record))
    return by_path


def _name(path: tuple) -> str:
    return ".".join(str(p[0] if isinstance(p, tuple) else p) for p in path)


def _region(records, path, shape, offsets, sizes, dtype) -> torch.Tensor:
    """The part of the global tensor at ``offsets`` of ``sizes``, from whatever blocks ``records`` hold."""
    out = torch.empty(sizes, dtype=dtype)
    filled = torch.zeros(sizes, dtype=torch.bool)
    for kind, data, start, whole in records:
        if kind == "tensor":
            start, whole = (0,) * data.dim(), tuple(data.shape)
        elif kind != "split":
            raise ValueError(f"ownstack.checkpoint: {_name(path)} holds a {type(data).__name__}, not a tensor")
        if tuple(whole) != tuple(shape):
            raise ValueError(
                f"ownstack.checkpoint: {_name(path)} has shape {tuple(whole)}, the template {tuple(shape)}"
            )
        src, dst, mask = data, out, filled
        for d, (a, n, b, m) in enumerate(zip(start, data.shape, offsets, sizes)):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                break
            src, dst, mask = (
                src.narrow(d, lo - a, hi - lo),
                dst.narrow(d, lo - b, hi - lo),
                mask.narrow(d, lo - b, hi - lo),
            )
        else:
            dst.copy_(src)
            mask.fill_(True)
    if not bool(filled.all()):
        raise ValueError(f"ownstack.checkpoint: the files do not cover {_name(path)}'s block at {tuple(offsets)}")
    return out


def _whole(records, path):
    kind, data, _, shape = records[0]
    if kind == "split":
        return _region(records, path, shape, (0,) * len(shape), tuple(shape), data.dtype)
    return data


def _fill(parent, key, leaf, records, path) -> None:
    """Put the checkpoint's value for ``path`` into the template's ``parent[key]``."""
    if isinstance(leaf, SplitTensor):
        offsets, sizes = block_of(leaf.shape, leaf.mesh.shape, leaf.placements, leaf.mesh.coordinate())
        leaf._local.copy_(_region(records, path, leaf.shape, offsets, sizes, leaf.dtype))
    elif isinstance(leaf, torch.Tensor) and records[0][0] != "value":
        value = _whole(records, path)
        if value.shape != leaf.shape:
            raise ValueError(
                f"ownstack.checkpoint: {_name(path)} has shape {tuple(value.shape)}, the template {tuple(leaf.shape)}"
            )
        leaf.copy_(value)
    else:
        _put(parent, key, _whole(records, path))


def _step(node, part, following, create: bool):
    """``node``'s child at ``part`` (a dict key, or ``(i,)`` into a list); a
    missing dict entry or the next list item is made when ``create``."""
    if isinstance(part, tuple) and isinstance(node, list):
        if part[0] < len(node):
            return node[part[0]]
        if create and part[0] == len(node):
            node.append([] if isinstance(following, tuple) else {})
            return node[-1]
        return None
    if isinstance(node, dict) and not isinstance(part, tuple):
        if part not in node and create:
            node[part] = [] if isinstance(following, tuple) else {}
        return node.get(part)
    return None


def _container(template, path: tuple, create: bool):
    """The dict or list that holds ``path``'s leaf (None where the template has no place for it)."""
    node = template
    for part, following in zip(path[:-1], path[1:]):
        node = _step(node, part, following, create)
        if node is None:
            return None
    last = path[-1]
    if (
        isinstance(node, list)
        and isinstance(last, tuple)
        and (last[0] < len(node) or (create and last[0] == len(node)))
    ):
        return node
    if isinstance(node, dict) and not isinstance(last, tuple):
        return node
    return None


def _put(parent, part, value) -> None:
    if isinstance(part, tuple):
        if part[0] == len(parent):
            parent.append(value)
        else:
            parent[part[0]] = value
    else:
        parent[part] = value


def load(state_dict: dict, *, checkpoint_id, process_group=None) -> None:
    """Fill the template ``state_dict`` in place from the checkpoint under ``checkpoint_id``."""
    by_path = _read(os.fspath(checkpoint_id))
    wanted = list(_leaves(state_dict))
    missing = [_name(p) for p, _ in wanted if p not in by_path]
    have = {p for p, _ in wanted}
    extra = [p for p in by_path if p not in have]
    misplaced = [_name(p) for p in extra if _runs_through_list(state_dict, p)]
    if missing or misplaced:
        raise ValueError(
            f"ownstack.checkpoint: {os.fspath(checkpoint_id)} lacks entries the template has: {missing[:12]}"
            f"{' ...' if len(missing) > 12 else ''}; entries of the checkpoint with no place in the template "
            f"(a list of the template's of another length): {misplaced[:12]}"
        )
    for path, leaf in wanted:
        _fill(_container(state_dict, path, create=False), path[-1], leaf, by_path[path], path)
    for path in extra:
        parent = _container(state_dict, path, create=True)
        if parent is None:
            raise ValueError(
                f"ownstack.checkpoint: {_name(path)} has no place in the template (another kind of container)"
            )
        _put(parent, path[-1], _whole(by_path[path], path))


def _runs_through_list(template, path: tuple) -> bool:
    """Whether ``path`` would lengthen a list the template has (a load does not change a list's length)."""
    node = template
    for part in path:
        if isinstance(node, list):
            return not (isinstance(part, tuple) and part[0] < len(node))
        if not isinstance(node, dict) or isinstance(part, tuple) or part not in node:
            return False
        node = node[part]
    return False
