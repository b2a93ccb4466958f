"""What a rank needs of the root's tensors in a broadcast load, as every rank learns it.

Every rank knows each of the root's tensors by shape and dtype
(:class:`ShapeDtype`, in manifest order) and tells the others the region it
needs of each (:class:`Need`), packed so that thousands of same-shaped
tensors cost a few bytes each (:class:`PackedNeeds`); the tensors every rank
needs alike are grouped into runs from them (:func:`alike_groups`).
:mod:`.scatter` moves the pieces.
"""

from __future__ import annotations

import functools
import math
import operator
from array import array
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from ..placement import DTensorLayout


# (shape, dtype) of each of the root's tensors, in manifest order
class ShapeDtype(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


Metas = Sequence[ShapeDtype]


@dataclass(frozen=True)
class Need:
    """What a rank needs of a full tensor: a region (slices as (start, stop)),
    or with ``is_run`` one run ``region[0]`` of its elements in order (what a
    wrapper layout's shard holds of a parameter: whole rows or not)."""

    region: tuple[tuple[int, int], ...]
    is_run: bool = False

    @classmethod
    def run(cls, start: int, stop: int) -> "Need":
        return cls(((start, stop),), is_run=True)

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

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in self.region)

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        if self.is_run:
            return full.reshape(-1)[self.slices()]
        return full[self.slices()] if self.region else full

    def cut_each(self, stacked: torch.Tensor) -> torch.Tensor:
        """This region of each of ``stacked``'s tensors (stacked on dim 0)."""
        if self.is_run:
            return stacked.reshape(len(stacked), -1)[(slice(None),) + self.slices()]
        return stacked[(slice(None),) + self.slices()]


class PackedNeeds(Sequence):
    """One rank's needs as sent to the others: each distinct region once,
    then an index per tensor. Thousands of same-shaped tensors cost a few
    bytes each on the wire and in every rank's memory, not an object each."""

    def __init__(self, needs: Sequence[Need | None]):
        table: dict[Need, int] = {}
        # Needs repeat as objects (a plan shares one per layout): each object's
        # place looked up by identity, the value hashed once per object.
        by_id: dict[int, int] = {id(None): -1}
        ids = list(map(id, needs))
        for key, need in dict(zip(ids, needs)).items():  # (each distinct object once)
            if key not in by_id:
                by_id[key] = table.setdefault(need, len(table))
        self.table = list(table)
        self.index = array("i", map(by_id.__getitem__, ids))

    @classmethod
    def of(cls, table: list[Need], index: array) -> "PackedNeeds":
        """Needs already packed: each distinct one once (``table``), and each
        tensor's place in it (-1: none)."""
        packed = cls.__new__(cls)
        packed.table, packed.index = table, index
        return packed

    def __getitem__(self, i):  # type: ignore[override]
        j = self.index[i]
        return None if j < 0 else self.table[j]

    def __len__(self) -> int:
        return len(self.index)


def alike_groups(codes: Sequence[int], columns: Sequence[array], positions: Sequence[int]) -> list[list[int]]:
    """``positions`` grouped by key, the ``j``-th one's key ``codes[j]`` and
    ``column[positions[j]]`` for each of ``columns``: each group's positions in
    order, the groups in the order of their first. ``columns``: arrays of
    ints, at least -1 (every rank's packed needs, by tensor index).

    A key per tensor tuple made and hashed in a Python loop was a tenth of a
    broadcast load of tens of thousands of small tensors; here each column
    folds into one integer key per tensor, and a stable sort groups them. The
    same inputs give the same groups on every rank."""
    if not positions:
        return []
    key = _ints(array("q", codes), torch.int64)
    bound = int(key.max()) + 1
    whole = positions == range(len(positions))
    at = None if whole else torch.tensor(list(positions), dtype=torch.int64)
    for column in columns:
        values = _ints(column, torch.int32) if column.itemsize == 4 else torch.tensor(column.tolist())
        values = (values if at is None else values[at]).to(torch.int64) + 1
        width = int(values.max()) + 1
        if bound * width >= 1 << 62:  # keys renumbered densely first, so that none overflows
            key = torch.unique(key, return_inverse=True)[1]
            bound = int(key.max()) + 1
        key = key * width + values
        bound *= width
    order = torch.argsort(key, stable=True)
    counts = torch.unique_consecutive(key[order], return_counts=True)[1].tolist()
    ordered = order.tolist()
    groups, start = [], 0
    for count in counts:
        groups.append(ordered[start : start + count])
        start += count
    groups.sort(key=operator.itemgetter(0))
    return groups if whole else [list(map(positions.__getitem__, group)) for group in groups]


def _ints(values: array, dtype: torch.dtype) -> torch.Tensor:
    # A view of the array's bytes (which it keeps alive), read only.
    return torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)
