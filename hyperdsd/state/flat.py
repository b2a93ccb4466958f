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

import re
from typing import Any

STATE, GROUPS = "state", "param_groups"


def is_flat(osd: Any) -> bool:
    return isinstance(osd, dict) and STATE not in osd and GROUPS not in osd


def flatten(nested: dict) -> dict:
    out: dict[str, Any] = {}
    for fqn, entry in nested[STATE].items():
        _flatten_into(out, f"{STATE}.{fqn}", entry)
    for group in nested[GROUPS]:
        fields = [(k, v) for k, v in group.items() if k != "params"]
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


def unflatten(flat: dict, fqns) -> tuple[dict[str, dict], dict[str, dict], list[str]]:
    """Split a flat dict by FQN.

    Returns (state by FQN, group fields by FQN, keys that match no FQN of
    ``fqns``). Nested state keys are rebuilt as nested dicts and lists.
    """
    state: dict[str, dict] = {}
    fields: dict[str, dict] = {}
    unknown: list[str] = []
    with_lists: set[str] = set()
    # A parameter's keys come one after another, most of them ``{head}.{fqn}.{name}``:
    # the last such prefix and the dict it fills take them without a search.
    last_prefix, last_node = None, None
    for key, value in flat.items():
        if not isinstance(key, str):
            unknown.append(repr(key))
            continue
        prefix, _, name = key.rpartition(".")
        if prefix == last_prefix and not name.endswith("]"):
            last_node[name] = value
            continue
        head, _, rest = key.partition(".")
        split = split_fqn(rest, fqns) if head in (STATE, GROUPS) else None
        if split is None:
            unknown.append(key)
            continue
        fqn, tail = split
        node = (fields if head == GROUPS else state).setdefault(fqn, {})
        plain = "." not in tail  # then ``prefix`` is ``{head}.{fqn}``
        last_prefix, last_node = (prefix, node) if plain else (None, None)
        if head == GROUPS or (plain and not tail.endswith("]")):  # a group field's name is kept whole
            node[tail] = value
            continue
        path = _path(tail) if tail.endswith("]") or "]." in tail else tail.split(".")
        if len(path) > len(tail.split(".")):
            with_lists.add(fqn)
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    for fqn in with_lists:
        state[fqn] = _lists(state[fqn])
    return state, fields, unknown


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
