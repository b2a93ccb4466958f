"""The flat layout's keys made a column at a time, and kept from one get to the next.

A flat get on a model of many small parameters writes some fourteen keys a
parameter (a key for each field of its group). Made one at a time, each an
f-string and a dict insert, they were a third of the get; here each column
of them (one name across a run of FQNs) is made in C, and
:class:`KeptFlatKeys` keeps the last dict's keys for the next get to copy.
"""

from __future__ import annotations

import operator
from itertools import chain, repeat
from typing import Any

from ...blocks import blocks

STATE, GROUPS = "state", "param_groups"  # the flat layout's two heads (see flat.py)


def group_fields(group: dict) -> list[tuple[Any, Any]]:
    """The fields a group's parameters each carry: all but its list of parameters."""
    return [(k, v) for k, v in group.items() if k != "params"]


def state_rows(state: dict) -> tuple[list, list, list] | None:
    """``state``'s FQNs, the names of every entry's values and the values, in
    order, where every entry is a dict of the same names in the same order
    whose values are leaves (AdamW's, SGD's): each entry a row of plain keys.
    None otherwise (flat.py's ``_flatten_into`` writes each)."""
    entries = list(state.values())
    if not entries:
        return [], [], []
    if set(map(type, entries)) != {dict}:
        return None
    names = list(entries[0])
    if not names:
        return None
    values: list = []
    for some in map(entries.__getitem__, blocks(len(entries))):  # (each entry read twice: see hyperdsd.blocks)
        # Consecutive entries of distinct names each: the keys all together repeat
        # ``names`` exactly when every entry holds them in that order.
        if list(chain.from_iterable(some)) != names * len(some):
            return None
        values += chain.from_iterable(map(dict.values, some))
    if any(issubclass(t, dict) or t is list for t in set(map(type, values))):
        return None  # nested state (an empty container is a leaf, but rare): a key per leaf
    return list(state), names, values


def row_keys(head: str, fqns: list, names: list) -> list[str] | None:
    """``{head}.{fqn}.{name}`` for each of ``fqns``, each of ``names`` in turn,
    made a column at a time in C: the FQNs joined by newlines, the newlines
    replaced by what comes between two keys, split again. None where that
    cannot tell the keys apart (a newline in an FQN or name) or a name is not
    a string."""
    if not fqns or not names:
        return []
    joined = "\n".join(fqns)
    if joined.count("\n") != len(fqns) - 1 or not all(type(n) is str and "\n" not in n for n in names):
        return None
    lead = head + "."
    columns = [(lead + joined.replace("\n", f".{name}\n{lead}") + f".{name}").split("\n") for name in names]
    return list(chain.from_iterable(zip(*columns)))


def rows_of(names: list, values: list, share: bool) -> tuple[list[dict], bool]:
    """``values``, rows of ``names`` one after another, as one dict a row,
    filled a column at a time; with ``share``, where every row holds the
    same values (one group's own, as a get writes them under each of its
    parameters), one dict all rows share. Returns the dicts and whether
    they are shared."""
    m = len(names)
    count = len(values) // m
    if share and all(all(map(operator.is_, values[j::m], repeat(values[j]))) for j in range(m)):
        return [dict(zip(names, values[:m]))] * count, True
    empty, nodes = dict.fromkeys(names), []
    for block in blocks(count):  # (each row made, then filled a name at a time: see hyperdsd.blocks)
        rows = list(map(dict.copy, repeat(empty, len(range(count)[block]))))
        start, stop = block.start * m, block.stop * m
        for j, name in enumerate(names):
            list(map(operator.setitem, rows, repeat(name), values[start + j : stop : m]))
        nodes += rows
    return nodes, False


class KeptFlatKeys:
    """The keys of the last flat dict made for one model's optimizers, for the
    next get to copy.

    On a model of many small parameters the flat dict has some fourteen keys
    a parameter (a key for each field of its group), and making them, with the
    dict around them, was a third of a flat get. Copying a dict of the same
    keys is a copy of its table; then only the state values are put in, and a
    group field's values where the field is not the object it was (a
    scheduler's new ``lr``). The kept keys are used only where the keys would be
    the same: the same FQNs, state names, group fields and parameters, in the
    same order, checked every call. Kept with the model's index
    (:mod:`hyperdsd.state.keys.index_cache`), so it goes with the model.
    """

    def __init__(self) -> None:
        self._kept: _FlatKeys | None = None

    def flatten(self, nested: dict, rows: tuple[list, list, list]) -> dict | None:
        """``flatten(nested)``, its state's ``rows`` read (``state_rows``); None
        where the keys cannot be made so (see ``_FlatKeys.of``)."""
        fqns, names, values = rows
        fields = list(map(group_fields, nested[GROUPS]))
        groups = [([k for k, _ in f], g["params"]) for f, g in zip(fields, nested[GROUPS])]
        kept = self._kept
        if kept is None or not kept.fits(fqns, names, groups):
            kept = self._kept = _FlatKeys.of(fqns, names, groups, fields)
        if kept.flat is None:
            return None
        out = kept.flat.copy()
        out.update(zip(kept.state_keys, values))
        for row, keys, old in zip(fields, kept.group_keys, kept.group_values):
            for j, (_, value) in enumerate(row):
                if value is not old[j]:
                    out.update(zip(keys[j :: len(row)], repeat(value)))
        return out

    def read(self, flat: dict) -> tuple[dict[str, dict], dict[str, dict]] | None:
        """What ``unflatten`` reads of ``flat``, the state and the group
        fields by FQN (no key unknown, none clashing), where ``flat``'s keys
        are the last dict's made here, in the same order, and no name could
        be read as nested (a dot, a trailing bracket); None otherwise."""
        kept = self._kept
        if kept is None or not kept.readable or len(flat) != len(kept.flat) or list(flat) != list(kept.flat):
            return None
        values = list(flat.values())
        at = len(kept.state_keys)
        state = dict(zip(kept.fqns, rows_of(kept.names, values[:at], False)[0])) if at else {}
        fields: dict[str, dict] = {}
        for keys, (names, params) in zip(kept.group_keys, kept.groups):
            if keys:
                fields.update(zip(params, rows_of(names, values[at : at + len(keys)], True)[0]))
                at += len(keys)
        return state, fields


class _FlatKeys:
    """A flat dict's keys in order (state values None, group fields as first
    read), and what they were made from."""

    def __init__(self, fqns, names, groups, state_keys, group_keys, group_values, flat) -> None:
        self.fqns, self.names, self.groups = fqns, names, groups
        self.state_keys, self.group_keys, self.group_values, self.flat = state_keys, group_keys, group_values, flat
        # Read back only where unflatten would read each key as the row it was
        # made in: no name it would read as nested, no parameter in two groups.
        every = chain(names, chain.from_iterable(field_names for field_names, _ in groups))
        params = list(chain.from_iterable(params for field_names, params in groups if field_names))
        self.readable = (
            flat is not None
            and all(type(n) is str and "." not in n and n[-1:] != "]" for n in every)
            and len(set(params)) == len(params)
        )

    @classmethod
    def of(cls, fqns: list, names: list, groups: list, fields: list) -> _FlatKeys:
        """Its ``flat`` None where the keys cannot be made in C or two of them
        are the same (the later value is kept: a changed field could not be
        put in where it belongs): then, while the keys are these, every call
        flattens plainly."""
        state_keys = row_keys(STATE, fqns, names)
        group_keys = [row_keys(GROUPS, params, field_names) for field_names, params in groups]
        group_values = [[v for _, v in row] for row in fields]
        flat = None
        if state_keys is not None and None not in group_keys:
            flat = dict.fromkeys(state_keys)
            for keys, row, (_, params) in zip(group_keys, group_values, groups):
                flat.update(zip(keys, row * len(params)))
            if len(flat) != len(state_keys) + sum(map(len, group_keys)):
                flat = None
        return cls(fqns, names, groups, state_keys, group_keys, group_values, flat)

    def fits(self, fqns: list, names: list, groups: list) -> bool:
        return fqns == self.fqns and names == self.names and groups == self.groups
