"""The checks every tensor to load goes through, for models and optimizers
alike, and the :class:`~hyperdsd.state.loading.plan.Prepared` a checked value becomes.

A value's layout, shape and dtype against its target's decide a
:class:`Verdict`: whether it can load, as what layout, whether it moves
(a DTensor redistributed when the plan is applied), whether it fits the
existing tensor in place. :func:`planned` makes the plan's entry for a
checked value; :func:`fits` asks again when a plan is applied.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ... import _compat
from ..._compat import local_tensor
from ...placement import DTensorLayout, LayoutCache
from .plan import Prepared, TensorMeta


class Verdicts(dict):
    """The checks of values that depend on layouts, shapes and dtypes alone
    (:class:`Verdict`), worked out once per signature in a plan instead of
    once per value (see :func:`layout_key` and :func:`full_signature`): a plan
    of tens of thousands of small tensors has a handful of distinct ones.
    Also holds the plan's :class:`LayoutCache`."""

    def __init__(self):
        super().__init__()
        self.layouts = LayoutCache()


class Verdict(NamedTuple):
    """What the layouts alone decide of a value for a target (see :class:`Verdicts`)."""

    problem: str  # "" if the value can load
    layout: DTensorLayout | None  # the loaded value's layout; None: a plain tensor
    moves: bool  # a DTensor redistributed to ``layout`` when the plan is applied
    fits: bool  # the existing tensor has ``layout`` and the value's dtype (local shapes are compared per value)


def refused(problem: str) -> Verdict:
    return Verdict(problem, None, False, False)


def accepted(dtype: torch.dtype, layout: DTensorLayout | None, moves: bool, existing: Any) -> Verdict:
    """The verdict on a value of ``dtype`` that passed its checks, loaded as
    ``layout``, beside ``existing``, the tensor it would replace."""
    if layout is None:
        fits = isinstance(existing, torch.Tensor) and not isinstance(existing, DTensor)
    else:
        fits = isinstance(existing, DTensor) and (existing.device_mesh, tuple(existing.placements), existing.shape) == (
            layout.mesh,
            layout.placements,
            layout.shape,
        )
    return Verdict("", layout, moves, fits and existing.dtype == dtype)


def planned(verdict: Verdict, value: Any, device: torch.device, existing: Any) -> Prepared:
    """A checked ``value`` (a DTensor, a full tensor or a stand-in) as its
    verdict plans it on this rank, into ``existing`` in place where it fits."""
    layout = verdict.layout
    if verdict.moves:
        prepared = Prepared(layout, device, source_dtensor=value)
        local_shape = layout.local_shape
    elif isinstance(value, DTensor):
        prepared = Prepared(layout, device, local=_compat.dtensor_local(value))
        local_shape = prepared.local.shape
    elif isinstance(value, TensorMeta):
        prepared = Prepared(layout, device, meta=value)
        local_shape = layout.local_shape if layout is not None else value.shape
    else:  # a full tensor: this rank's piece of ``layout``
        prepared = Prepared(layout, device, local=layout.local_from_full(value) if layout is not None else value)
        local_shape = prepared.local.shape
    if verdict.fits and (_compat.dtensor_local(existing) if layout is not None else existing).shape == local_shape:
        prepared.dest = existing
    return prepared


def full_signature(value: torch.Tensor | TensorMeta) -> tuple:
    """What stands for a full value (not a DTensor) in a verdict's signature."""
    return type(value), tuple(value.shape), value.dtype


def layout_key(t: Any) -> Any:
    """What stands for ``t``'s layout in a verdict's signature: for a DTensor,
    the identity of its layout token (the tensors outlive the plan, so no
    other object takes that identity meanwhile); for a tensor, its shape and
    dtype; for anything else, None. By ``id()``, not the token itself: its
    equality compares meshes and placements, a cost per value."""
    if isinstance(t, DTensor):
        return id(_compat.layout_token(t))
    if isinstance(t, torch.Tensor):
        return tuple(t.shape), t.dtype
    return None


def is_tensorish(value: Any) -> bool:
    """A tensor, or the stand-in for one that the root holds."""
    return isinstance(value, (torch.Tensor, TensorMeta))


def kind_differs(dtype: torch.dtype, target_dtype: torch.dtype) -> bool:
    """Loading keeps the value's dtype, but not of another kind: no integers into floating point."""
    return target_dtype.is_floating_point and not (dtype.is_floating_point or dtype.is_complex)


def dtensor_problem(value: DTensor, target: torch.Tensor, whose: str) -> str:
    """Why a DTensor ``value`` cannot load into ``target`` ("" if it can); ``whose`` names the target."""
    if not isinstance(target, DTensor):
        return f"a DTensor, but {whose} is not; load it with full_state_dict=True or through DCP"
    if value.device_mesh != target.device_mesh:
        return f"on mesh {value.device_mesh}, {whose} is on {target.device_mesh}"
    return ""


def dtensor_layout(value: DTensor, target: torch.Tensor, layouts=None) -> tuple[DTensorLayout, bool]:
    """The layout a checked DTensor ``value`` loads into ``target`` with, and
    whether it moves: kept as it is laid out where that matches ``target``'s
    placements (or it is not ``target``'s shape), else redistributed to
    ``target``'s layout when the plan is applied. ``layouts``: a
    :class:`~hyperdsd.placement.LayoutCache` to share layouts through."""
    of = layouts.of if layouts is not None else DTensorLayout.of
    if tuple(value.placements) == tuple(target.placements) or value.shape != target.shape:
        return of(value), False
    return of(target), True


def fits(existing: Any, prepared: Prepared) -> bool:
    """Whether ``prepared`` can be copied into ``existing`` in place (same layout, shape and dtype)."""
    return (
        accepted(prepared.dtype, prepared.layout, False, existing).fits
        and tuple(local_tensor(existing).shape) == prepared.local_shape
    )
