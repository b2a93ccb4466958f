"""A twin parameter's optimizer state entry, made from every rank's summary
of it (:mod:`.summaries`): its per-element state the twin's rows, the rest
this rank's own values where it has them, else the holders'."""

from __future__ import annotations

import torch

from ..tree import rebuild
from .summaries import HeldValue, RowsAt, at_path, held_copies, summary_key
from .units import UnitLayout


def twin_entries(u: UnitLayout, merged: list, targets: list, placed: dict, copies: bool = True) -> list:
    """Each of the unit's twin parameters' state entry (None: no state): its
    per-element state the DTensors ``placed`` (by path, by parameter), the
    rest this rank's values where it has them (a flat parameter's, shared by
    all its parameters), else the holders' (in the summary). Entries of one
    summary holding nothing nested are made a key at a time, across the
    parameters, their 0-d values copied in one call."""
    n = len(u.fqns)
    entries: list = [None] * n
    alike: dict[int, tuple[dict, list, list]] = {}  # summary id -> (summary, parameters, their own state)
    if u.unit.params is None:  # a flat parameter: one summary and one entry of its own, for every parameter
        summary, (_, p, opt) = merged[0], targets[0]
        if summary is None:
            return entries
        own = opt.state.get(p) or {}
        if summary_key(summary) is None:  # (nested, or values other than tensors: the general way)
            return [twin_entry(summary, own, lambda path, i=i: placed[path][i], copies) for i in range(n)]
        alike[id(summary)] = (summary, range(n), [own] * n)
    stepped = {i for i, _, _ in u.here} if u.unit.params is not None else ()
    for i, summary in enumerate(merged if u.unit.params is not None else ()):
        if summary is None:
            continue
        _, p, opt = targets[i]
        own = (opt.state.get(p) or {}) if i in stepped else {}  # a rank that never steps it: the holders' values
        group = alike.get(id(summary))
        if group is None:
            if summary_key(summary) is None:  # (nested, or values other than tensors: the general way)
                entries[i] = twin_entry(summary, own, lambda path, i=i: placed[path][i], copies)
                continue
            group = alike[id(summary)] = (summary, [], [])
        group[1].append(i)
        group[2].append(own)
    for summary, ids, owns in alike.values():
        keys, columns = [], []
        for key, (kind, detail) in summary.items():
            if kind == "shape":
                continue
            keys.append(key)
            if type(detail) is RowsAt:
                column = placed[(key,)]
                columns.append(column if len(ids) == n else [column[i] for i in ids])
            else:
                columns.append(held_copies([own.get(key, detail) for own in owns], copies))
        for i, values in zip(ids, zip(*columns)):
            entries[i] = dict(zip(keys, values))
    return entries


def twin_entry(summary: dict, own: dict, rows_at, copies: bool = True) -> dict:
    """A twin parameter's state entry: per-element state (nested too) as the
    twin's rows, ``rows_at(path)``; the rest this rank's own values where it
    has them, else the holders' (``summary``'s)."""

    def value(leaf, path):
        if isinstance(leaf, RowsAt):
            return rows_at(path)
        leaf = at_path(own, path, leaf)
        if isinstance(leaf, HeldValue):
            return leaf.tensor()
        return leaf.clone() if copies and isinstance(leaf, torch.Tensor) else leaf

    entry = {}
    for key, (kind, detail) in summary.items():
        if kind == "shape":
            continue
        if type(detail) is RowsAt or type(detail) is HeldValue:  # (most state: no walk)
            entry[key] = value(detail, (key,))
        else:
            entry[key] = rebuild(detail, value, (key,))
    return entry
