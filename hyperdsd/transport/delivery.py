"""Pieces of the root's tensors handed to whoever on this rank receives them.

In a broadcast load every rank plans against the root's manifest; each
planned tensor is a *receiver* (:class:`Receiver`): it knows which of the
root's tensors it takes (``meta.index``), its layout, and where the data can
land. :func:`needs_for` turns this rank's receivers into the regions it
needs of each root tensor; :func:`deliver` runs the scatter
(:mod:`.scatter`) and hands each arriving piece to its receivers, so a rank
holds its own state plus one bucket in flight.
"""

from __future__ import annotations

import itertools
import operator
from array import array
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from .. import _compat
from ..placement import DTensorLayout
from ..tree import has_none
from .group import Group
from .needs import Metas, Need, PackedNeeds
from .scatter import scatter_from_root


@dataclass(frozen=True)
class Landing:
    """Where a receiver's piece goes instead of its tensor: the run ``need``
    of the root's tensor's elements, written into ``into`` (a view of another
    tensor: what a wrapper layout's shard holds of a parameter). ``need``
    None: this rank needs none of it."""

    need: Need | None
    into: torch.Tensor | None


class Receiver(Protocol):
    """What delivery needs of a planned tensor (``hyperdsd.state.loading.plan.Prepared`` is one)."""

    meta: Any  # its root tensor's index and shape (``.index``, ``.shape``)
    layout: DTensorLayout | None  # its DTensor layout, or None for a plain tensor
    dest: torch.Tensor | None  # an existing tensor a large piece can land in, if any
    landing: Landing | None  # where its piece goes instead, if elsewhere
    local: torch.Tensor | None  # its data once delivered (``copied_into`` sets it)

    def receive(self, piece: torch.Tensor) -> None: ...

    def copied_into(self) -> torch.Tensor | None: ...


class ColumnOfReceivers(Protocol):
    """Receivers by column (``hyperdsd.state.loading.plan.ReceiverColumn`` is one):
    each of ``metas``' pieces lands in the local tensor beside it in ``dests``."""

    metas: list  # its root tensors' stand-ins (``.index``, ``.shape``)
    layouts: list  # each one's DTensor layout, or None for a plain tensor
    dests: list[torch.Tensor]  # where each one's piece lands: of its region's shape (as planned)
    # optionally, ``layouts`` as numbers into a handful (the same layout object for one number)
    layout_codes: list[int] | None
    layout_by_code: dict[int, Any] | None

    def receivers(self) -> list[Receiver]: ...


# Who uses each of the root's tensors: mostly one receiver, kept as itself;
# a tuple only for a tensor loaded into several places. A list per tensor
# was the largest plan object a rank held in a load of many small tensors.
Users = list  # [None | Receiver | tuple[Receiver, ...]] by the root's tensor index


def users_of(users: Users, i: int) -> tuple[Receiver, ...]:
    u = users[i]
    return () if u is None else u if type(u) is tuple else (u,)


def needs_for(
    prepared: list[Receiver], metas: Metas, columns: Sequence[ColumnOfReceivers] = ()
) -> tuple[Sequence[Need | None], Users, set[int], list | None]:
    """What this rank needs of each of the root's tensors (a list, or packed
    already: :class:`~.needs.PackedNeeds`), who uses each, which arrive whole
    for users that cut their own region from them, and, where every tensor is
    received by ``columns``, the local tensor each piece lands in by the
    root's index (else None)."""
    if columns and not prepared:
        found = _columns_once(columns, len(metas))
        if found is not None:
            return found
    prepared = [*prepared, *itertools.chain.from_iterable(column.receivers() for column in columns)]
    needs: list[Need | None] = [None] * len(metas)
    users: Users = [None] * len(metas)
    cut: set[int] = set()
    # Tensors of one layout and shape need the same region: computed once, by
    # the layout object first (a plan shares one per distinct layout), then by value.
    by_layout: dict[int, tuple[Need, bool]] = {}
    regions: dict[tuple, Need] = {}
    if _each_once(prepared, needs, users, regions):
        return needs, users, cut, None
    for p in prepared:
        i = p.meta.index
        if p.landing is not None:  # the one user of its root tensor (see Landing)
            if p.landing.need is not None:
                needs[i], users[i] = p.landing.need, p
            continue
        layout = p.layout
        found = by_layout.get(id(layout)) if layout is not None else None
        if found is None:
            found = _region(layout, p.meta.shape, regions)
            if layout is not None:
                by_layout[id(layout)] = found
        need, cuts = found
        if cuts:
            cut.add(i)  # a layout DTensor cuts itself (strided shards)
        if needs[i] is not None and needs[i] != need:
            need = Need.whole(p.meta.shape)  # used twice with different regions: take it whole
            cut.add(i)
        needs[i] = need
        users[i] = p if users[i] is None else users_of(users, i) + (p,)
    return needs, users, cut, None


_META, _LAYOUT = operator.attrgetter("meta"), operator.attrgetter("layout")
_LANDING, _DEST = operator.attrgetter("landing"), operator.attrgetter("dest")
_INDEX, _SHAPE = operator.attrgetter("index"), operator.attrgetter("shape")


def _each_once(prepared: list[Receiver], needs: list, users: Users, regions: dict[tuple, Need]) -> bool:
    """:func:`needs_for`'s work a column at a time, where it is simple: each
    of the root's tensors has one receiver, none lands elsewhere, and no
    layout cuts its own region. Fills ``needs`` and ``users`` and returns True
    then; else changes nothing and returns False."""
    if any(map(_LANDING, prepared)):
        return False
    metas = list(map(_META, prepared))
    indices = list(map(_INDEX, metas))
    if len(set(indices)) != len(indices):
        return False
    layouts = list(map(_LAYOUT, prepared))
    # each distinct (layout object, shape) once: tens of thousands of receivers share a handful
    keys = list(zip(map(id, layouts), map(_SHAPE, metas)))
    distinct = dict(zip(keys, zip(layouts, map(_SHAPE, metas))))
    found = {key: _region(layout, shape, regions) for key, (layout, shape) in distinct.items()}
    if any(cuts for _, cuts in found.values()):
        return False
    need_of = {key: need for key, (need, _) in found.items()}
    list(map(needs.__setitem__, indices, map(need_of.__getitem__, keys)))
    list(map(users.__setitem__, indices, prepared))
    return True


def _columns_once(columns: Sequence[ColumnOfReceivers], n: int) -> tuple[PackedNeeds, Users, set[int], list] | None:
    """:func:`needs_for` where every receiver is a column's: each of the root's
    tensors lands in one tensor (the ``dests`` returned), no layout cuts its
    own region; None otherwise. The needs come packed, as the ranks send them."""
    # the needs packed as they are found (each distinct one numbered once), as the ranks exchange them
    table: dict[Need, int] = {}
    places = array("i", [-1]) * n
    dests: list = [None] * n
    regions: dict[tuple, Need] = {}
    taken = 0
    for column in columns:
        indices = list(map(_INDEX, column.metas))
        # Each distinct layout object, or shape of a plain tensor, asked once: tens of thousands of
        # receivers share a handful. A layout says the region alone (the shape is the layout's).
        layouts = column.layouts
        distinct = None
        if column.layout_codes is not None and not has_none(list(column.layout_by_code.values())):
            keys, distinct = column.layout_codes, column.layout_by_code  # (numbered by the planner)
        elif not has_none(layouts):
            keys = list(map(id, layouts))
            distinct = dict(zip(keys, layouts))
        if distinct is not None:
            if not all(layout.simple for layout in distinct.values()):
                return None  # (a layout that cuts its own region)
            need_of = {key: _region(layout, None, regions)[0] for key, layout in distinct.items()}
        elif not any(layouts):
            keys = list(map(_SHAPE, column.metas))
            need_of = {shape: _region(None, shape, regions)[0] for shape in dict.fromkeys(keys)}
        else:
            keys = list(zip(map(id, layouts), map(_SHAPE, column.metas)))
            found = {key: _region(key_layout, key[1], regions) for key, key_layout in dict(zip(keys, layouts)).items()}
            if any(cuts for _, cuts in found.values()):
                return None
            need_of = {key: need for key, (need, _) in found.items()}
        code_of = {key: table.setdefault(need, len(table)) for key, need in need_of.items()}
        list(map(places.__setitem__, indices, map(code_of.__getitem__, keys)))
        list(map(dests.__setitem__, indices, column.dests))
        taken += len(indices)
    if len(dests) - sum(map(operator.is_, dests, itertools.repeat(None))) != taken:
        return None  # (a root tensor received twice: fewer filled than taken)
    return PackedNeeds.of(list(table), places), [None] * n, set(), dests


def _region(layout: DTensorLayout | None, shape, regions: dict[tuple, Need]) -> tuple[Need, bool]:
    """What a receiver of ``layout`` (None: a plain tensor) needs of a root tensor
    of ``shape``, and whether it cuts its own region from the whole tensor."""
    if layout is not None and layout.simple:
        key = (layout.mesh, layout.placements, tuple(layout.shape))
        need = regions.get(key)
        if need is None:
            need = regions[key] = Need.of_layout(layout)
        return need, False
    key = ("whole", shape)
    need = regions.get(key)
    if need is None:
        need = regions[key] = Need.whole(shape)
    return need, layout is not None


def _copied_into_each(receivers: list) -> list[torch.Tensor] | None:
    """``copied_into()`` of each of ``receivers`` where every one is a single
    receiver that copies into an existing tensor: the tensors, in order, each
    taken as its receiver's data as ``copied_into`` does; None otherwise
    (nothing is changed)."""
    if tuple in set(map(type, receivers)) or any(map(_LANDING, receivers)):
        return None
    dests = list(map(_DEST, receivers))
    if has_none(dests):
        return None
    targets = _compat.local_tensors(dests)
    for receiver, target in zip(receivers, targets):
        receiver.local = target
    return targets


def deliver(
    needs: list[Need | None],
    users: Users,
    cut: set[int],
    fulls: list[torch.Tensor] | None,
    metas: Metas,
    device: torch.device,
    everyone_needs: list | None = None,
    group: Group | None = None,
    dests: list | None = None,
) -> None:
    """Give each receiver this rank's piece of the root's tensor, as it arrives.

    A piece goes straight into its destination (an existing tensor of the
    same layout) or becomes the new tensor itself, so a rank holds its own
    state plus one bucket in flight. ``metas``: the same on every rank, so
    is the bucket plan. ``needs``, ``users``, ``cut``: as :func:`needs_for`
    gives them. ``everyone_needs``: every rank's needs, when the caller has
    exchanged them already. ``dests``: where each piece lands, by the root's
    index, when :func:`needs_for` gives them (every receiver a column's).
    """
    if dests is not None:
        _deliver_into(dests, needs, fulls, metas, device, everyone_needs, group)
        return

    def receive(i: int, piece: torch.Tensor) -> None:
        u = users[i]
        if type(u) is not tuple and i not in cut:
            u.receive(piece)  # the region this one user needs
            return
        for p in users_of(users, i):
            p.receive(p.layout.local_from_full(piece) if p.layout is not None and i in cut else piece)

    def receive_run(members: Sequence[int], block: torch.Tensor) -> None:
        """A run's pieces, stacked in ``members``' order: those whose one receiver
        copies its piece into an existing tensor copied in one call, the others
        handed over one by one."""
        found = _copied_into_each(list(map(users.__getitem__, members))) if not cut else None
        if found is not None:  # (every piece copied into an existing tensor: a column at a time)
            _compat.copy_each_of_run(found, block)
            return
        pieces = block.unbind(0)
        dests = []
        for i, piece in zip(members, pieces):
            u = users[i]
            target = u.copied_into() if type(u) is not tuple and i not in cut else None
            if target is None:
                receive(i, piece)
            else:
                dests.append((target, piece))
        if dests:
            _compat.copy_each([d for d, _ in dests], [p for _, p in dests])

    def target_for(i: int) -> torch.Tensor | None:
        """Where a large piece can be received in place: its one user's destination."""
        u = users[i]
        if u is None or type(u) is tuple:
            return None
        if u.landing is not None:
            return u.landing.into
        return None if u.dest is None else _compat.local_tensor(u.dest)

    scatter_from_root(
        metas,
        fulls,
        needs,
        device,
        on_piece=receive,
        target_for=target_for,
        everyone_needs=everyone_needs,
        group=group,
        on_run=receive_run,
    )


def _deliver_into(
    dests: list, needs: list, fulls: list | None, metas: Metas, device: torch.device, everyone_needs, group
) -> None:
    """:func:`deliver` where each piece lands in the tensor ``dests`` names."""

    def receive(i: int, piece: torch.Tensor) -> None:
        if piece is not dests[i]:  # (a large piece may have been received in place)
            dests[i].copy_(piece)

    def receive_run(members: Sequence[int], block: torch.Tensor) -> None:
        # (a column's planning checked that each dest has its need's shape, as each piece has)
        _compat.copy_each_of_run(list(map(dests.__getitem__, members)), block, shaped=True)

    scatter_from_root(
        metas,
        fulls,
        needs,
        device,
        on_piece=receive,
        target_for=dests.__getitem__,
        everyone_needs=everyone_needs,
        group=group,
        on_run=receive_run,
    )
