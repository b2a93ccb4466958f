"""The flat optimizer state-dict layout (PyTorch's, for MPMD checkpoints).

    state.{fqn}.{key}          -> value   (every state value)
    param_groups.{fqn}.{field} -> value   (every field of the param's group)

Every key belongs to one parameter, so pipeline stages that own disjoint
parameters write disjoint keys. A group without parameters has no FQN to
carry it and is not written; on load it keeps its own values.

Nested state (custom optimizers keep dicts and lists of tensors per
parameter) is written one leaf per key:

    state.{fqn}.{key}.{sub}        dict entries: keys joined by dots, as
                                   PyTorch writes them
    state.{fqn}.{key}.{sub}[{i}]   list items: the index in brackets,
                                   appended to the list's own key
    state.{fqn}.{key}.{sub}[{i}][{j}]  lists of lists, and so on

Lists need a mark of their own: written as another dot-joined segment, an
index could not be told from a dict key that is a number ("0"), and the
list would come back as a dict. A bracketed index cannot be a segment of
PyTorch's layout (no FQN or state key ends in one), so dict keys keep
PyTorch's spelling and a checkpoint without lists is exactly PyTorch's.
Each tensor of a list gets a key of its own, as any state tensor does, so
DCP saves and reshards it like the others. Tuples are records, not
collections that grow: one value, as group fields such as ``betas`` are.
An empty dict or list is written as itself. Nested keys must be strings
without dots or a trailing ``[n]`` (others come back as strings).

Unflattening matches each key to an FQN of the target model exactly (FQNs
contain dots), scanning each key once: linear in the number of keys.
"""

from __future__ import annotations

import operator
import re
from itertools import repeat
from typing import Any

from .flat_keys import GROUPS, STATE, KeptFlatKeys, group_fields, row_keys, rows_of, state_rows


def is_flat(osd: Any) -> bool:
    return isinstance(osd, dict) and STATE not in osd and GROUPS not in osd


def flatten(nested: dict, kept: KeptFlatKeys | None = None) -> dict:
    """``nested`` in the flat layout; through ``kept`` (the keys of the
    last one made for the same optimizers) where it is given and fits."""
    rows = state_rows(nested[STATE])
    out = kept.flatten(nested, rows) if kept is not None and rows is not None else None
    if out is not None:
        return out
    out = {}
    if rows is not None and (keys := row_keys(STATE, rows[0], rows[1])) is not None:
        out.update(zip(keys, rows[2]))
    else:
        for fqn, entry in nested[STATE].items():
            _flatten_into(out, f"{STATE}.{fqn}", entry)
    for group in nested[GROUPS]:
        fields = group_fields(group)
        keys = row_keys(GROUPS, group["params"], [k for k, _ in fields])
        if keys is not None:
            out.update(zip(keys, [v for _, v in fields] * len(group["params"])))
            continue
        for fqn in group["params"]:
            for k, v in fields:
                out[f"{GROUPS}.{fqn}.{k}"] = v
    return out


def _flatten_into(out: dict, prefix: str, value: Any) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten_into(out, f"{prefix}.{k}", v)
    elif type(value) is list and value:
        for i, v in enumerate(value):
            _flatten_into(out, f"{prefix}[{i}]", v)
    else:
        out[prefix] = value


def split_fqn(rest: str, fqns) -> tuple[str, str] | None:
    """``rest`` = ``{fqn}.{tail}`` for exactly one FQN of the model."""
    head, _, tail = rest.rpartition(".")
    if head in fqns:  # the common case: a plain state key or group field
        return head, tail
    i = rest.find(".")
    while i != -1:
        if rest[:i] in fqns:
            return rest[:i], rest[i + 1 :]
        i = rest.find(".", i + 1)
    return None


def unflatten(flat: dict, fqns) -> tuple[dict[str, dict], dict[str, dict], list[str], list[str]]:
    """Split a flat dict by FQN.

    Returns (state by FQN, group fields by FQN, keys that match no FQN of
    ``fqns``, problems). Nested state keys are rebuilt as nested dicts and
    lists. A key whose state path runs through or onto a value another key
    gave (``state.w.m`` and ``state.w.m.x``) is not read: the first key read
    stays, the other is a problem.
    """
    return _Unflattening(fqns).run(list(flat), list(flat.values()))


class _Unflattening:
    """One pass over a flat dict's keys, in order.

    A parameter's keys come one after another, and the parameters of a group
    (or of a uniform state) have the same names in the same order. Once one
    such row of plain keys ``{head}.{fqn}.{name}`` is read key by key, the
    rows after it are checked and taken a column at a time, whole, in C:
    each key equal to the one the row's pattern predicts. Whatever does not
    follow the pattern is read key by key.
    """

    def __init__(self, fqns) -> None:
        self.fqns = fqns
        self.state: dict[str, dict] = {}
        self.fields: dict[str, dict] = {}
        self.unknown: list[str] = []
        self.clashes: list[str] = []
        self.with_lists: set[str] = set()
        self.shared: set[str] = set()  # FQNs whose group fields are a dict other rows share
        # The current row: its prefix ``{head}.{fqn}``, the dict it fills, its
        # head and the names read so far (None once a key of it is not plain).
        self.prefix: str | None = None
        self.node: dict | None = None
        self.head = ""
        self.names: list[str] | None = None

    def run(self, keys: list, values: list) -> tuple[dict[str, dict], dict[str, dict], list[str], list[str]]:
        i = 0
        while i < len(keys):
            key = keys[i]
            if not isinstance(key, str):
                self.unknown.append(repr(key))
                self.prefix = self.names = None
                i += 1
                continue
            prefix, _, name = key.rpartition(".")
            if prefix == self.prefix and not name.endswith("]") and name not in self.node:
                self.node[name] = values[i]
                if self.names is not None:
                    self.names.append(name)
                i += 1
                continue
            if self.names and key.endswith(self.names[0]) and (taken := self._rows(keys, values, i)):
                i += taken
                continue
            head, _, fqn = prefix.partition(".")
            if (head == STATE or head == GROUPS) and fqn in self.fqns and not name.endswith("]"):
                # a row starts (``_add``'s common case, inline: most keys where rows are short)
                node = self._node(self.fields, fqn) if head == GROUPS else self.state.get(fqn)
                if node is None:
                    node = self.state[fqn] = {}
                if name not in node:
                    node[name] = values[i]
                    self.prefix, self.node, self.head, self.names = prefix, node, head, [name]
                    i += 1
                    continue
            self._add(key, values[i])
            i += 1
        for fqn in self.with_lists:
            self.state[fqn] = _lists(self.state[fqn])
        return self.state, self.fields, self.unknown, self.clashes

    def _add(self, key: str, value: Any) -> None:
        """A key that starts a row, or belongs to none."""
        self.prefix = self.names = None
        head, _, rest = key.partition(".")
        split = split_fqn(rest, self.fqns) if head in (STATE, GROUPS) else None
        if split is None:
            self.unknown.append(key)
            return
        fqn, tail = split
        node = self._node(self.fields if head == GROUPS else self.state, fqn)
        if "." not in tail:  # then the key is ``{head}.{fqn}.{tail}``: a row starts
            self.prefix, self.node, self.head = f"{head}.{fqn}", node, head
            self.names = [tail] if not tail.endswith("]") else None
        if head == GROUPS:  # a group field's name is kept whole
            node[tail] = value
            return
        path = _path(tail) if tail.endswith("]") or "]." in tail else tail.split(".")
        for depth, part in enumerate(path[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                return self._clash(key, fqn, path[: depth + 1])
        if path[-1] in node:
            return self._clash(key, fqn, path)
        node[path[-1]] = value
        if len(path) > len(tail.split(".")):
            self.with_lists.add(fqn)

    def _clash(self, key: str, fqn: str, path: list) -> None:
        where = "".join(f"[{p}]" if type(p) is int else f".{p}" for p in path)[1:]
        self.clashes.append(f"{key!r}: the state {where!r} of {fqn!r} is a value and nested state at once")

    def _rows(self, keys: list, values: list, i: int) -> int:
        """How many keys from ``i`` on make whole rows like the last one, taken.

        Chunks of rows gallop: one row first, then twice as many after each
        chunk that matches, never more than the FQNs the head has not had (a
        row takes one; as a get writes them, the last chunk ends the block
        exactly). A chunk that does not match is halved and growth stops. So
        a pattern that breaks at once costs one row's check, and finding
        where a longer one stops at most four times the rows it took.
        """
        names, head = self.names, self.head
        self.prefix = self.names = None
        m = len(names)
        target = self.fields if head == GROUPS else self.state
        limit, done, chunk, growing = (len(keys) - i) // m, 0, 1, True
        while (count := min(chunk, limit - done, len(self.fqns) - len(target))) > 0:
            start = i + done * m
            fqns = self._matching(keys, start, count, head, names, target)
            if fqns is None:
                if count == 1:
                    break
                chunk, growing = count // 2, False
                continue
            self._fill(head, names, fqns, values[start : start + count * m])
            done += count
            chunk = 2 * count if growing else count
        return done * m

    def _matching(self, keys: list, start: int, count: int, head: str, names: list[str], target: dict) -> list | None:
        """The FQNs of the ``count`` rows from ``keys[start]`` if each of
        their keys is ``{head}.{fqn}.{name}`` for each of ``names`` in turn,
        with ``fqn`` an FQN that ``target`` does not have yet, each once;
        else None.

        Each column is compared at once: its keys joined by newlines against
        the predicted keys joined the same way. The joined strings are equal,
        and hold no newline but the separators, exactly when every key is the
        one predicted.
        """
        m, lead, stop = len(names), head + ".", start + count * len(names)
        try:
            fqns = list(map(operator.getitem, keys[start:stop:m], repeat(slice(len(lead), -len(names[0]) - 1))))
            known = all(map(self.fqns.__contains__, fqns))
            if not known or not target.keys().isdisjoint(fqns) or len(set(fqns)) < count:
                return None
            for j, name in enumerate(names):
                joined = "\n".join(keys[start + j : stop : m])
                if joined.count("\n") != count - 1 or joined != lead + f".{name}\n{lead}".join(fqns) + f".{name}":
                    return None
        except TypeError:  # a key that is not a string
            return None
        return fqns

    def _fill(self, head: str, names: list[str], fqns: list[str], values: list) -> None:
        # A get writes one group's own values under each of its parameters: then
        # the rows share one dict, copied before anything is added to one (_node).
        nodes, shared = rows_of(names, values, head == GROUPS)
        if shared:
            self.shared.update(fqns)
        (self.fields if head == GROUPS else self.state).update(zip(fqns, nodes))

    def _node(self, target: dict, fqn: str) -> dict:
        """The dict ``fqn``'s keys go into: its own, never one rows share."""
        node = target.get(fqn)
        if node is None:
            node = target[fqn] = {}
        elif fqn in self.shared and target is self.fields:
            node = target[fqn] = dict(node)
            self.shared.discard(fqn)
        return node


_INDEX = re.compile(r"\[(\d+)\]$")


def _path(tail: str) -> list:
    """``a.b[0][1].c`` -> ``["a", "b", 0, 1, "c"]``: list indices as ints."""
    path: list = []
    for segment in tail.split("."):
        indices = []
        while (m := _INDEX.search(segment)) and m.start() > 0:
            indices.append(int(m.group(1)))
            segment = segment[: m.start()]
        path.append(segment)
        path += reversed(indices)
    return path


def _lists(node: Any) -> Any:
    """Dicts whose keys are the indices 0..n-1 (ints, from brackets) as lists."""
    if not isinstance(node, dict):
        return node
    node = {k: _lists(v) for k, v in node.items()}
    if node and all(type(k) is int for k in node) and sorted(node) == list(range(len(node))):
        return [node[i] for i in range(len(node))]
    return node
