"""Loads that land in the tensors they replace, checked a column at a time.

Loading a state dict into the model or optimizer it came from (a sharded
set, or a resume whose DCP template was filled in place) puts each value
into the tensor it replaces: same layout, dtype and local shape. Tens of
thousands of small tensors share a handful of layouts, so what decides each
verdict (:mod:`hyperdsd.state.loading.checks`) is computed for a whole column of values (one
state key across an optimizer group's parameters, or a model's tensors of
one class) with ``map`` and ``zip``, not statement by statement per value,
and each distinct signature is judged once. Whatever does not land in place
(another class, a layout that moves, a problem to word) is left to the
callers' value-by-value planning, which the verdicts here agree with.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.distributed.tensor import DTensor

from ... import _compat
from ...tree import has_none
from .checks import Verdict, Verdicts
from .plan import ReceiverColumn, TensorMeta

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_IS_META = operator.attrgetter("is_meta")

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (destination, source) local tensors


_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def layout_keys(tensors: Sequence[Any]) -> tuple[list, type] | None:
    """:func:`~hyperdsd.state.loading.checks.layout_key` of each of ``tensors`` and their kind
    (DTensor, or Tensor for plain tensors and parameters), where all are of
    one kind, exactly; None otherwise."""
    classes = set(map(type, tensors))
    if classes == {DTensor}:
        return list(map(id, map(_compat.layout_token, tensors))), DTensor
    if classes <= _PLAIN:
        return list(zip(map(tuple, map(_SHAPE, tensors)), map(_DTYPE, tensors))), torch.Tensor
    return None


def signature_keys(values: Sequence[Any]) -> tuple[list, type] | None:
    """What stands for each of ``values`` in a verdict's signature, as the
    value-by-value checks have it (``layout_key`` of a DTensor,
    ``full_signature`` of a plain tensor or a stand-in), and their kind;
    None where they are not all of one kind."""
    if set(map(type, values)) == {TensorMeta}:  # a broadcast's stand-ins
        return list(zip(itertools.repeat(TensorMeta), map(_SHAPE, values), map(_DTYPE, values))), TensorMeta
    found = layout_keys(values)
    if found is None or found[1] is DTensor:
        return found
    return [(cls, *key) for cls, key in zip(map(type, values), found[0])], torch.Tensor


class ColumnVerdicts(NamedTuple):
    """A column's verdicts (:func:`verdicts_of`)."""

    by_first: dict[int, Verdict]  # each distinct signature's, by the index of its first value
    firsts: list[int]  # each value's signature, as the index of the first value with it


def verdicts_of(signatures: list[tuple], verdicts: Verdicts, judge: Callable[[int], Verdict]) -> ColumnVerdicts | None:
    """The verdict of each distinct signature, each judged once (``judge(i)``:
    of the ``i``-th value, the first with that signature) or taken from
    ``verdicts``; None where one is not a value loaded in place, as is."""
    # Each signature hashed once (the tuples are made per value, and hash their
    # parts every time): later passes look values up by their first's index.
    first_of: dict[tuple, int] = {}
    firsts = list(map(first_of.setdefault, signatures, itertools.count()))
    by_first = {}
    for signature, first in first_of.items():
        verdict = verdicts.get(signature)
        if verdict is None:
            verdict = verdicts[signature] = judge(first)
        if verdict.problem or verdict.moves or not verdict.fits:
            return None
        by_first[first] = verdict
    return ColumnVerdicts(by_first, firsts)


def column_copies(values: Sequence[Any], cls: type, existing: Sequence[Any], verdicts: ColumnVerdicts) -> Pairs | None:
    """(destination, source) local tensors for ``values`` (all of kind
    ``cls``) landing in ``existing``'s tensors, one to one, their verdicts
    ``verdicts`` (accepted, in place): the pairs that are not the same memory
    already. None where a value would not land as it is: a full tensor cut
    for a DTensor first, or local shapes that differ."""
    wrapped = cls is DTensor
    if any((verdict.layout is not None) != wrapped for verdict in verdicts.by_first.values()):
        return None  # (a full tensor planned into a DTensor is cut first)
    sources = list(map(_compat.dtensor_local, values)) if wrapped else list(values)
    dests = list(map(_compat.dtensor_local, existing)) if wrapped else list(existing)
    if any(map(_IS_META, dests)):
        return None  # (a model built on the meta device is assigned its values, not copied into)
    # The verdicts say the dtypes match: the same storage, offset, sizes and strides is the same memory
    # (asked only of distinct objects: an optimizer's state read back is its own tensors).
    same = list(map(operator.is_, sources, dests))
    if not all(same):
        same = [alike or dest.is_set_to(source) for alike, source, dest in zip(same, sources, dests)]
    if all(same):
        return []
    pairs = [(dest, source) for dest, source, alike in zip(dests, sources, same) if not alike]
    if not all(map(operator.eq, map(_SHAPE, (d for d, _ in pairs)), map(_SHAPE, (s for _, s in pairs)))):
        return None
    return pairs


def column_receivers(
    values: Sequence[TensorMeta],
    existing: Sequence[Any],
    verdicts: ColumnVerdicts,
    devices: list[torch.device] | None,
    rows: list,
    key: str | None = None,
) -> ReceiverColumn | None:
    """A broadcast's stand-ins ``values``, each planned to be received into
    ``existing``'s tensor (their verdicts ``verdicts``, accepted in place),
    as one column (``devices``, ``rows``, ``key``: as the column keeps them):
    None where a local shape is not that tensor's (the caller plans anew)."""
    # (a column shares a handful of signatures and layouts: each asked once, of each signature's first
    # value, and looked up for the rest by its number, in C)
    firsts = verdicts.firsts
    layout_of = {first: verdict.layout for first, verdict in verdicts.by_first.items()}
    layouts = list(map(layout_of.__getitem__, firsts))
    distinct = list(layout_of.values())  # (each value's layout is one of them, and each is some value's)
    if not any(distinct):  # plain tensors (a step, say)
        wants, dests = list(map(_SHAPE, values)), list(existing)
    elif has_none(distinct):
        wants = [m.shape if layout is None else layout.local_shape for m, layout in zip(values, layouts)]
        dests = [e if layout is None else _compat.dtensor_local(e) for e, layout in zip(existing, layouts)]
    else:
        local_shape = {first: layout.local_shape for first, layout in layout_of.items()}
        dests = list(map(_compat.dtensor_local, existing))
        # every local tensor asked, not one per signature: a DTensor made with ``run_check=False``
        # may hold a local tensor of another shape than its spec's, and a copy out= would resize it
        wants = list(map(local_shape.__getitem__, firsts))
    # (a torch.Size equals the tuple of its sizes, and every shape wanted is a tuple: stand-ins'
    # and layouts' shapes are; compared as they are, no tuple made per tensor)
    if any(map(_IS_META, dests)) or list(map(_SHAPE, dests)) != wants:
        return None  # (a model built on the meta device is assigned its values)
    return ReceiverColumn(list(values), layouts, list(existing), dests, devices, rows, key, firsts, layout_of)
