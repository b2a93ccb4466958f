"""Load plans: the types a planned load is made of, and how a planned tensor lands.

A load is planned before anything changes (:mod:`hyperdsd.state.model`,
:mod:`hyperdsd.state.optimizer.plan`, each value checked by :mod:`hyperdsd.state.loading.checks`): each
tensor to load becomes a :class:`Prepared` that says where it goes (a
DTensor layout or a plain tensor, a device) and where its data comes from (a
local piece, a DTensor to redistribute, or, in a broadcast load, a
:class:`TensorMeta` whose data rank 0 sends once every rank has agreed).
Applying a plan then only redistributes, copies and adopts (the functions at
the end).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch.distributed.tensor import DTensor

from ..._compat import copy_each, local_tensor
from ...placement import DTensorLayout
from ...tree import is_container, leaves


@dataclass(slots=True)
class TensorMeta:
    """Stands in for a tensor only the root holds (broadcast loads).

    Not frozen: a frozen dataclass with slots unpickles through a Python
    ``__setstate__``, which every rank ran for every tensor of the manifest.
    """

    shape: tuple
    dtype: torch.dtype
    index: int
    # The one value every element holds (:func:`~hyperdsd.state.placeholders.saved.tensor_fill`),
    # worked out on the root for the state of never-stepped entries only; None: not known.
    fill: Any = None

    def __reduce__(self):
        # The fields as arguments: pickle's generic path for a slots object
        # (copyreg, a state per object) was three times the time and twice the
        # bytes of a broadcast's manifest, on the root while the others wait.
        return (TensorMeta, (self.shape, self.dtype, self.index, self.fill))


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
    # A broadcast piece that lands elsewhere, not in this tensor (a transport
    # ``Landing``: a wrapper layout's flat shards); the plan then has nothing to apply.
    landing: Any = None

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

    def copied_into(self) -> torch.Tensor | None:
        """Where a delivered piece is to be copied, when that is an existing
        tensor (``dest``), taken as this value's data now (the caller copies);
        None when the piece must be handed to :meth:`receive`."""
        if self.landing is not None or self.dest is None:
            return None
        self.local = local_tensor(self.dest)
        return self.local

    def receive(self, piece: torch.Tensor) -> None:
        """Take a delivered piece (a view into a transfer buffer)."""
        if self.landing is not None:
            if not same_memory(self.landing.into, piece.reshape(-1)):  # received in place already
                self.landing.into.copy_(piece.reshape(-1))
        elif self.dest is not None:
            target = local_tensor(self.dest)
            if not same_memory(target, piece):  # received in place already
                target.copy_(piece)
            self.local = target
        else:
            self.local = piece.to(self.device, copy=True)
            self.owned = True


@dataclass(eq=False)
class ReceiverColumn:
    """A column of a broadcast's stand-ins, each received into the tensor it
    replaces (same layout and local shape): one object for tens of thousands
    of tensors, not a :class:`Prepared` each. Delivery lands each piece in
    ``dests``; a plan that must go value by value (a wrapper layout's twin's landing, a
    model whose tensors changed since planning) makes the receivers from it
    (:meth:`receivers`)."""

    metas: list[TensorMeta]
    layouts: list  # each one's DTensorLayout, or None for a plain tensor
    existing: list  # the tensors replaced (DTensors or plain)
    dests: list[torch.Tensor]  # their local tensors, where the pieces land
    devices: list[torch.device] | None  # each receiver's device; None: its dest's
    # where each receiver goes in its plan: the model's raw keys (``key`` None),
    # or the optimizer's ParamLoads (their entries' ``key``)
    rows: list
    key: str | None = None
    # each one's layout as a number (``layout_by_code``: the handful of layouts by number), where
    # the planner numbered them: delivery works out each layout's region once, then looks numbers up
    layout_codes: list[int] | None = None
    layout_by_code: dict[int, Any] | None = None

    def receivers(self, delivered: bool = False) -> list[Prepared]:
        """A :class:`Prepared` per tensor, as a value-by-value plan has them;
        ``delivered``: the pieces have landed (each one's ``local`` its dest)."""
        devices = self.devices if self.devices is not None else map(_DEVICE, self.dests)
        none = itertools.repeat(None)
        local = self.dests if delivered else none
        # positional (layout, device, local, meta, source_dtensor, dest), through map
        return list(map(Prepared, self.layouts, devices, local, self.metas, none, self.existing))


_DEVICE = operator.attrgetter("device")


@dataclass
class ModelLoadPlan:
    values: dict[str, Any] = field(default_factory=dict)  # raw key -> Prepared or object
    on_meta: set[str] = field(default_factory=set)  # raw keys whose target lives on meta
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    claimed: set[str] = field(default_factory=set)
    # Every value in place, into the model's tensor under its raw key (as planned
    # against); ``values`` holds the values themselves then, copied by ``copies``:
    # (destination, source) local tensors, the pairs that are not the same memory;
    # or a broadcast's receivers, each delivered into its tensor.
    in_place: bool = False
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # (the modules' registries of children, parameters and buffers then, and what they held: applying
    # checks them unchanged)
    registries: list[dict] = field(default_factory=list)
    registered: tuple[list, list] = ([], [])
    # A broadcast's stand-ins received in place, by column; ``values`` holds the stand-ins then.
    columns: list[ReceiverColumn] = field(default_factory=list)
    # Every value goes through one load_state_dict, those already in their tensors too (a
    # module's load post-hook is handed the whole load's missing and unexpected keys).
    whole: bool = False

    def tensors(self) -> list[Prepared]:
        return [v for v in self.values.values() if isinstance(v, Prepared)]

    def expand(self, delivered: bool = False) -> None:
        """Each column's receivers into ``values``, one per key (see :meth:`ReceiverColumn.receivers`)."""
        for column in self.columns:
            self.values.update(zip(column.rows, column.receivers(delivered)))
        self.columns = []


@dataclass(slots=True)
class ParamLoad:
    opt: torch.optim.Optimizer
    param: torch.Tensor
    fqn: str
    entry: dict | None  # None: the parameter ends without state
    # In place: the optimizer's own state entry (as planned against, nothing
    # changes it before the plan is applied), when every value of ``entry`` goes
    # into its tensor under the same key, no key added or dropped: applying
    # leaves the entry as it is. ``entry`` holds the values themselves then,
    # copied by the plan's ``copies``, or a broadcast's stand-ins, received by
    # the plan's ``columns``; or, ``received``, a broadcast's receivers, each
    # delivered into its tensor.
    into: dict | None = None
    received: bool = False


@dataclass
class OptimizerLoadPlan:
    params: list[ParamLoad] = field(default_factory=list)
    groups: list[tuple[dict, dict]] = field(default_factory=list)  # (the optimizer's group, fields to set)
    optimizers: tuple = ()
    claimed: set[str] = field(default_factory=set)  # source FQNs this rank loads
    # Was the placeholder state entry of each FQN loaded into? None: this rank cannot tell.
    questions: dict[str, bool | None] = field(default_factory=dict)
    # FQNs whose answer every rank's own must confirm (a saved placeholder state is
    # one only if no rank sees real state in its shard).
    confirm: set[str] = field(default_factory=set)
    # FQNs answered together (an optimizer's entries without step): state if
    # any rank sees state in any of them.
    together: list[list[str]] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)  # source FQNs this rank does not know
    # (destination, source) local tensors of the loads in place, the pairs that are not the same memory
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # A broadcast's stand-ins received in place, a column per state key of a group
    columns: list[ReceiverColumn] = field(default_factory=list)

    def expand(self) -> None:
        """Each column's receivers into its loads' entries (``received``), one per value."""
        for column in self.columns:
            for load, receiver in zip(column.rows, column.receivers()):
                if not load.received:
                    load.entry, load.received = dict(load.entry), True  # (the manifest's entry stays as it is)
                load.entry[column.key] = receiver
        self.columns = []

    def settle(self, answers: dict[str, bool]) -> None:
        """Drop the entries other ranks say nobody loaded (they stay fresh)."""
        for fqns in self.together:
            if any(answers.get(f, True) for f in fqns):
                answers = {**answers, **dict.fromkeys(fqns, True)}
        dropped = {fqn for fqn, answer in answers.items() if not answer}
        if not dropped:
            return  # (a load of stepped state asks nothing: no pass over its tens of thousands of loads)
        for load in self.params:
            if load.fqn in dropped and (self.questions.get(load.fqn, True) is None or load.fqn in self.confirm):
                load.entry = None

    def tensors(self) -> list[Prepared]:
        """Every planned tensor, nested state (dicts and lists of tensors) included."""
        entries = [load.entry for load in self.params if load.entry and (load.into is None or load.received)]
        values = list(itertools.chain.from_iterable(map(dict.values, entries)))
        if set(map(type, values)) <= {Prepared}:  # (no nested state: the entries' values as they are)
            return values
        out = []
        for load in self.params:
            if load.into is not None and not load.received:  # copies of local tensors, no planned tensor
                continue
            for v in (load.entry or {}).values():
                if isinstance(v, Prepared):
                    out.append(v)
                elif is_container(v):
                    out += [leaf for _, leaf in leaves(v) if isinstance(leaf, Prepared)]
        return out


# -- applying --------------------------------------------------------------


def redistribute(prepared: Iterable[Prepared]) -> None:
    """Move every DTensor that needs it to its planned layout (collectives, in plan order)."""
    for p in prepared:
        if p.source_dtensor is not None:
            moved = p.source_dtensor.redistribute(p.layout.mesh, p.layout.placements)
            p.local = local_tensor(moved)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same view of the same storage (copying is a no-op)."""
    # One call for storage, offset, sizes and strides: asked of each tensor
    # to load, and five property reads of each (strides a list) cost 4x that.
    return a is b or (a.is_set_to(b) and a.dtype == b.dtype)


def copy_all(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Each (destination, source) pair's source copied into its destination, all in one call."""
    dests, sources = [], []
    for dest, source in pairs:
        dests.append(dest)
        sources.append(source)
    if dests:
        copy_each(dests, sources)


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
