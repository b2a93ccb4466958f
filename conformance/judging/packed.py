"""Many small tensors as one buffer and an index, for what the suite itself
sends between ranks and writes to files (SPEC SCALE, 1.5).

Pickling a tensor (``torch.save``, an object collective) costs tens of
microseconds of Python for each one, unpickling it more under
``weights_only``: for the thousands of a many-key model's state, seconds.
Their bytes one after another in one tensor, and where each starts with
its dtype and shape, pickle as two objects.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import nested

_ALIGN = 16  # each tensor's bytes start where a view as any dtype may
_SLOT = "\0tensor "  # how a packed tree's skeleton marks the place of its n-th tensor


def blob(tensors: list[torch.Tensor]) -> dict:
    """``{"blob": uint8 tensor, "index": [(start, size, dtype name, shape), ...]}`` of plain CPU copies' bytes."""
    pieces, index, at = [], [], 0
    for t in tensors:
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8)
        pad = -at % _ALIGN
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
            at += pad
        pieces.append(raw)
        index.append((at, raw.numel(), str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        at += raw.numel()
    return {"blob": torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8), "index": index}


def unblob(packed: dict) -> list[torch.Tensor]:
    """The tensors of :func:`blob`, as views of its one buffer."""
    data = packed["blob"]
    return [data[at : at + size].view(getattr(torch, dtype)).view(shape) for at, size, dtype, shape in packed["index"]]


def pack(tree: Any) -> dict:
    """``tree`` (dicts and lists of tensors and plain values) with its plain
    tensors in one :func:`blob`; DTensors and other subclasses stay in place."""
    tensors: list[torch.Tensor] = []

    def slot(leaf, _path):
        if type(leaf) in (torch.Tensor, torch.nn.Parameter):
            tensors.append(leaf)
            return f"{_SLOT}{len(tensors) - 1}"
        return leaf

    return {"skeleton": nested.rebuild(tree, slot), **blob(tensors)}


def unpack(packed: dict) -> Any:
    tensors = unblob(packed)

    def fill(leaf, _path):
        if isinstance(leaf, str) and leaf.startswith(_SLOT):
            return tensors[int(leaf[len(_SLOT) :])]
        return leaf

    return nested.rebuild(packed["skeleton"], fill)
