"""The flat optimizer state-dict layout (PyTorch's, for MPMD checkpoints).

    state.{fqn}.{key}          -> value   (nested state keys joined by dots)
    param_groups.{fqn}.{field} -> value   (every field of the param's group)

Every key belongs to one parameter, so pipeline stages that own disjoint
parameters write disjoint keys. A group without parameters has no FQN to
carry it and is not written; on load it keeps its own values.

Unflattening matches each key to an FQN of the target model exactly (FQNs
contain dots), scanning each key once: linear in the number of keys.
"""

from __future__ import annotations

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
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_into(out, f"{prefix}.{k}", v)
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
    ``fqns``). Nested state keys are rebuilt as nested dicts.
    """
    state: dict[str, dict] = {}
    fields: dict[str, dict] = {}
    unknown: list[str] = []
    for key, value in flat.items():
        if not isinstance(key, str):
            unknown.append(repr(key))
            continue
        head, _, rest = key.partition(".")
        split = split_fqn(rest, fqns) if head in (STATE, GROUPS) else None
        if split is None:
            unknown.append(key)
            continue
        fqn, tail = split
        if head == GROUPS:
            fields.setdefault(fqn, {})[tail] = value
            continue
        node = state.setdefault(fqn, {})
        *parents, leaf = tail.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return state, fields, unknown
