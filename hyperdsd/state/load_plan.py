"""Load plans: the types a planned load is made of, and the checks and
moves every planned tensor goes through, for models and optimizers alike.

A load is planned before anything changes: each tensor to load becomes a
:class:`Prepared` that says where it goes (a DTensor layout or a plain
tensor, a device) and where its data comes from (a local piece, a DTensor to
redistribute, or, in a broadcast load, a :class:`TensorMeta` whose data rank
0 sends once every rank has agreed). Applying a plan then only
redistributes, copies and adopts (the functions at the end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from .. import _compat
from .._compat import local_tensor
from ..placement import DTensorLayout, LayoutCache
from ..tree import is_container, leaves


@dataclass(slots=True)
class TensorMeta:
    """Stands in for a tensor only the root holds (broadcast loads).

    Not frozen: a frozen dataclass with slots unpickles through a Python
    ``__setstate__``, which every rank ran for every tensor of the manifest.
    """

    shape: tuple
    dtype: torch.dtype
    index: int
    # The one value every element holds (:func:`~hyperdsd.state.saved_templates.tensor_fill`),
    # worked out on the root for the state of never-stepped entries only; None: not known.
    fill: Any = None


@dataclass(slots=True)
class Prepared:
    """One tensor as it will be loaded on this rank."""

    layout: DTensorLayout | None  # DTensor layout of the result; None: a plain tensor
    device: torch.device
    local: torch.Tensor | None = None  # this rank's piece (None until a broadcast delivers it)
    meta: TensorMeta | None = None
    source_dtensor: DTensor | None = None  # a DTensor to redistribute to ``layout`` first
    dest: torch.Tensor | None = None  # an existing tensor of the same layout to copy into
    owned: bool = False  # ``local`` is ours to keep as the new tensor, no copy needed

    @property
    def local_shape(self) -> tuple:
        if self.local is not None:
            return tuple(self.local.shape)
        if self.layout is None:
            return tuple(self.meta.shape)
        return self.layout.local_shape

    @property
    def dtype(self) -> torch.dtype:
        if self.local is not None:
            return self.local.dtype
        if self.source_dtensor is not None:  # redistributed when applied; dtype kept
            return self.source_dtensor.dtype
        return self.meta.dtype

    def receive(self, piece: torch.Tensor) -> None:
        """Take a delivered piece (a view into a transfer buffer)."""
        if self.dest is not None:
            target = local_tensor(self.dest)
            if not same_memory(target, piece):  # received in place already
                target.copy_(piece)
            self.local = target
        else:
            self.local = piece.to(self.device, copy=True)
            self.owned = True


@dataclass
class ModelLoadPlan:
    values: dict[str, Any] = field(default_factory=dict)  # raw key -> Prepared or object
    on_meta: set[str] = field(default_factory=set)  # raw keys whose target lives on meta
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    claimed: set[str] = field(default_factory=set)

    def tensors(self) -> list[Prepared]:
        return [v for v in self.values.values() if isinstance(v, Prepared)]


@dataclass(slots=True)
class ParamLoad:
    opt: torch.optim.Optimizer
    param: torch.Tensor
    fqn: str
    entry: dict | None  # None: the parameter ends without state


@dataclass
class OptimizerLoadPlan:
    params: list[ParamLoad] = field(default_factory=list)
    groups: list[tuple[dict, dict]] = field(default_factory=list)  # (the optimizer's group, fields to set)
    optimizers: tuple = ()
    claimed: set[str] = field(default_factory=set)  # source FQNs this rank loads
    # Was the template entry of each FQN loaded into? None: this rank cannot tell.
    questions: dict[str, bool | None] = field(default_factory=dict)
    # FQNs whose answer every rank's own must confirm (a saved template is
    # one only if no rank sees real state in its shard).
    confirm: set[str] = field(default_factory=set)
    # FQNs answered together (an optimizer's entries without step): state if
    # any rank sees state in any of them.
    together: list[list[str]] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # source FQNs this rank does not know

    def settle(self, answers: dict[str, bool]) -> None:
        """Drop the entries other ranks say nobody loaded (they stay fresh)."""
        for fqns in self.together:
            if any(answers.get(f, True) for f in fqns):
                answers = {**answers, **dict.fromkeys(fqns, True)}
        for load in self.params:
            asked = self.questions.get(load.fqn, True) is None or load.fqn in self.confirm
            if asked and not answers.get(load.fqn, True):
                load.entry = None

    def tensors(self) -> list[Prepared]:
        """Every planned tensor, nested state (dicts and lists of tensors) included."""
        out = []
        for load in self.params:
            for v in (load.entry or {}).values():
                if isinstance(v, Prepared):
                    out.append(v)
                elif is_container(v):
                    out += [leaf for _, leaf in leaves(v) if isinstance(leaf, Prepared)]
        return out


# -- checks ----------------------------------------------------------------


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
    dtype; for anything else, None."""
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


# -- applying --------------------------------------------------------------


def redistribute(prepared: Iterable[Prepared]) -> None:
    """Move every DTensor that needs it to its planned layout (collectives, in plan order)."""
    for p in prepared:
        if p.source_dtensor is not None:
            moved = p.source_dtensor.redistribute(p.layout.mesh, p.layout.placements)
            p.local = local_tensor(moved)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same view of the same storage (copying is a no-op)."""
    if a is b:  # a piece delivered into the very tensor it loads (most of a broadcast load)
        return True
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def fits(existing: Any, prepared: Prepared) -> bool:
    """Whether ``prepared`` can be copied into ``existing`` in place (same layout, shape and dtype)."""
    return (
        accepted(prepared.dtype, prepared.layout, False, existing).fits
        and tuple(local_tensor(existing).shape) == prepared.local_shape
    )


def copy_into(existing: torch.Tensor, prepared: Prepared) -> torch.Tensor:
    """``existing`` with ``prepared``'s data written into it."""
    local = local_tensor(existing)
    if not same_memory(local, prepared.local):  # a DCP template filled in place needs no copy
        local.copy_(prepared.local)
    return existing


def materialize(prepared: Prepared) -> torch.Tensor:
    """A new tensor (DTensor where planned) holding ``prepared``'s data on its device."""
    if prepared.owned and prepared.local.device == prepared.device:
        local = prepared.local  # delivered for us alone: adopt it
    else:
        local = torch.empty_like(prepared.local, device=prepared.device)
        local.copy_(prepared.local)
    return prepared.layout.wrap(local) if prepared.layout is not None else local
