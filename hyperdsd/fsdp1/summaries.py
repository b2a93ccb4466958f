"""What a rank tells the others of an FSDP1 unit's optimizer state: its summaries.

A rank holds state for its flat shard only (or for the original parameters
whose elements it holds); before the state is unflattened into rows every
rank learns what each parameter's state is (which keys are per-element
tensors, of which dtype, and the values of the rest) from the summaries all
ranks exchange. Parameters stepped alike have equal summaries, sent and
read once. No collectives, no tensors moved.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .. import _compat
from .._compat import local_tensor as _local
from ..errors import StateDictError
from ..tree import leaves, rebuild

# What a rank tells the others of one optimizer parameter's state: by key,
# ("rows", structure) for per-element state, bare or nested in containers (the
# value with a :class:`RowsAt` for each per-element tensor: a flat shard's, or
# an original parameter's piece), ("value", value) for anything else
# (``step``), ("shape", what) for state that cannot be unflattened. A 0-d
# tensor in a structure or value is a :class:`HeldValue`.
Summary = dict


@dataclass(frozen=True)
class RowsAt:
    """Stands for a per-element tensor in a summary's structure."""

    dtype: torch.dtype


@dataclass(frozen=True)
class HeldValue:
    """Stands for a 0-d tensor (a ``step``) in a summary: its value, dtype and
    device. Summaries go to every rank pickled, and torch pickles a tensor
    through a storage archive of its own: about 100 us a tensor sent and
    received, most of an FSDP1 get of many parameters."""

    value: Any  # the tensor's ``item()``: exact for every value (a NaN's payload aside)
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "HeldValue":
        return cls(tensor.item(), tensor.dtype, tensor.device)

    def tensor(self) -> torch.Tensor:
        # (scalar_tensor: half the time of torch.tensor's parsing of a Python value, bit for bit the same)
        return torch.scalar_tensor(self.value, dtype=self.dtype, device=self.device)


# One RowsAt per dtype (equal ones are interchangeable): a key made per parameter makes none.
_rows_at = functools.cache(RowsAt)


def summarize(entry: dict, per_element: int) -> Summary:
    """What of ``entry`` is per-element state (1-D of ``per_element`` elements), nested or not, and what is not."""

    def per_element_tensor(value) -> bool:
        return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == per_element

    def as_sent(v, _path):
        if per_element_tensor(v):
            return RowsAt(v.dtype)
        return HeldValue.of(v) if type(v) is torch.Tensor and v.dim() == 0 and not v.is_meta else v

    out = {}
    for key, value in entry.items():
        tensors = [v for _, v in leaves(value) if isinstance(v, torch.Tensor) and v.dim()]
        others = [v for v in tensors if not per_element_tensor(v)]
        if others:  # refused, not passed on with the shard's shapes
            shape = tuple(others[0].shape)
            out[key] = ("shape", shape if others[0] is value else f"nested, holding a tensor of shape {shape}")
        else:
            out[key] = ("rows" if tensors else "value", rebuild(value, as_sent))
    return out


def summary_key(summary: Summary) -> tuple | None:
    """What tells ``summary`` from another, hashable, for a summary of
    per-element tensors and held scalars only (None for any other): equal
    keys, equal summaries. A float goes by its bits (``-0.0`` is not ``0.0``)."""
    parts = []
    for key, (kind, detail) in summary.items():
        if type(detail) is RowsAt:
            parts.append((key, kind, detail))
        elif type(detail) is HeldValue and type(detail.value) in (int, float, bool):
            value = detail.value.hex() if type(detail.value) is float else detail.value
            parts.append((key, kind, detail.dtype, detail.device, type(detail.value), value))
        else:
            return None
    return tuple(parts)


def quick_summary_key(entry: dict, per_element: int) -> tuple | None:
    """``summary_key(summarize(entry, per_element))`` without making the
    summary, for an entry of plain tensors only (None for any other, or where
    the summary would have no key): parameters stepped alike find their
    shared summary by it."""
    parts = []
    for key, value in entry.items():
        if type(value) is not torch.Tensor:
            return None
        dim = value.dim()
        if dim == 1 and value.numel() == per_element:
            parts.append((key, "rows", _rows_at(value.dtype)))
        elif dim == 0 and not value.is_meta:
            held = value.item()
            if type(held) not in (int, float, bool):
                return None
            parts.append(
                (key, "value", value.dtype, value.device, type(held), held.hex() if type(held) is float else held)
            )
        else:
            return None
    return tuple(parts)


def per_element_paths(summary: Summary) -> list[tuple[tuple, torch.dtype]]:
    """``(path, dtype)`` of each per-element tensor a summary names: ``(key,)``, or ``(key, *where)`` nested."""
    return [
        ((key, *where), leaf.dtype)
        for key, (kind, detail) in summary.items()
        if kind == "rows"
        for where, leaf in leaves(detail)
        if isinstance(leaf, RowsAt)
    ]


def per_element(value: Any) -> bool:
    """Whether a twin state value is per-element state (a tensor not 0-d)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def entry_paths(entries: list[dict | None]) -> list[tuple[tuple, torch.dtype]]:
    """``(path, dtype)`` of each per-element (not 0-d) tensor among twin state
    ``entries`` (nested too, a DTensor's by its local tensor), sorted by path;
    a key's tensor is found once, not looked at again in every entry."""
    found: dict[tuple, torch.dtype] = {}
    present = [e for e in entries if e]
    for key in dict.fromkeys(key for e in present for key in e):
        tensor_found = False
        for e in present:
            value = e.get(key)
            if isinstance(value, torch.Tensor):  # (most state: no walk)
                if not tensor_found and value.dim() > 0:
                    found.setdefault((key,), _local(value).dtype)
                    tensor_found = True
            elif value is not None:
                for path, leaf in leaves(value, (key,)):
                    if per_element(leaf):
                        found.setdefault(path, _local(leaf).dtype)
    return sorted(found.items(), key=lambda item: str(item[0]))


def at_path(entry: Any, path: tuple, default: Any = None) -> Any:
    """The value at ``path`` in a (nested) state entry, or ``default``."""
    for part in path:
        try:
            entry = entry[part]
        except (KeyError, IndexError, TypeError):
            return default
    return entry


def merge(summaries: list[Summary | None]) -> Summary | None:
    """The first rank's summary of those that have state for a parameter (ranks
    without its elements in their shard have none under use_orig_params=True)."""
    return next(filter(None, summaries), None)


def refuse_unflattenable(summary: Summary | None, owner_of) -> None:
    """Raise for state a summary says cannot be unflattened (a tensor not per
    element); ``owner_of`` names what holds it (a unit's FQNs, or one)."""
    for key, (kind, detail) in (summary or {}).items():
        if kind == "shape":
            what = detail if isinstance(detail, str) else f"of shape {detail}"
            raise StateDictError(
                f"optimizer state {key!r} of {owner_of} (an FSDP1 unit) is {what}: only "
                "per-element and scalar state can be unflattened"
            )


def held_copies(leaves: list, copies: bool = True) -> list:
    """A new value for each of ``leaves`` (a key's values across parameters):
    tensors cloned, a holder's :class:`HeldValue` made a tensor, anything else
    as it is. Each held value is made a tensor once; with ``copies`` every
    parameter's is a clone of it, made with the tensors' clones in one call.
    Without ``copies`` (the caller copies what it hands out) tensors stay as
    they are and parameters of one held value share its one tensor."""
    made: dict[int, torch.Tensor] = {}

    def held(leaf: HeldValue) -> torch.Tensor:
        hit = made.get(id(leaf))
        return hit if hit is not None else made.setdefault(id(leaf), leaf.tensor())

    out = [held(leaf) if type(leaf) is HeldValue else leaf for leaf in leaves]
    if copies:
        tensors = [i for i, value in enumerate(out) if isinstance(value, torch.Tensor)]
        for i, copy in zip(tensors, _compat.clones([out[i] for i in tensors])):
            out[i] = copy
    return out
