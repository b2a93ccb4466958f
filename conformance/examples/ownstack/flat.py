"""torch's flat optimizer layout: ``state.{fqn}.{key}`` and ``param_groups.{fqn}.{field}``.

One level of keys, each naming its parameter, so that a pipeline stage's
keys are its own. Groups travel as fields repeated under each of their
parameters' FQNs; a group without parameters has no FQN to carry it, so a
flat load leaves the target's empty groups as they are.
"""

from __future__ import annotations

from .common import copied
from .groups import shown_names


def flatten(nested: dict) -> dict:
    out = {}
    for fqn, entry in nested["state"].items():
        for key, value in entry.items():
            out[f"state.{fqn}.{key}"] = value
    for group in nested["param_groups"]:
        for fqn in group["params"]:
            for field, value in group.items():
                if field != "params":
                    out[f"param_groups.{fqn}.{field}"] = copied(value)
    return out


def _split(rest: str, known: set[str]):
    """(fqn, key) for ``rest`` = ``{fqn}.{key}``, the longest known FQN winning; None if none fits."""
    pos = len(rest)
    while True:
        pos = rest.rfind(".", 0, pos)
        if pos <= 0:
            return None
        if rest[:pos] in known:
            return rest[:pos], rest[pos + 1 :]


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool((a == b).all())
        )
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


def unflatten(flat: dict, targets: list[tuple[int, dict, list[str]]], strict: bool) -> dict:
    """The nested dict ``flat`` stands for, its groups those of ``targets``
    (empty ones with the target's own fields). Raises ValueError (strict) for
    keys naming no parameter and for a group whose parameters disagree."""
    if not isinstance(flat, dict):
        raise ValueError(f"ownstack: a flat optimizer state dict is a dict, got {type(flat).__name__}")
    known = {f for _, _, fqns in targets for f in fqns}
    state: dict = {}
    fields: dict = {}
    unknown = []
    for key, value in flat.items():
        where = None
        for prefix, box in (("state.", state), ("param_groups.", fields)):
            if isinstance(key, str) and key.startswith(prefix):
                where = _split(key[len(prefix) :], known)
                if where is not None:
                    box.setdefault(where[0], {})[where[1]] = value
        if where is None:
            unknown.append(key)
    problems = [f"keys that name no parameter of the optimizers: {shown_names(unknown)}"] if unknown else []
    groups = []
    for _, group, fqns in targets:
        if not fqns:
            groups.append({**{k: copied(v) for k, v in group.items() if k != "params"}, "params": []})
            continue
        present = [f for f in fqns if f in fields]
        if not present:
            continue  # the whole group is missing: the nested check names its parameters
        first = fields[present[0]]
        odd = [
            f
            for f in present[1:]
            if set(fields[f]) != set(first) or not all(_same(fields[f][k], first[k]) for k in first)
        ]
        if odd:
            problems.append(
                f"param_groups.{{fqn}} fields of {shown_names(odd)} differ from {present[0]!r}'s, in one group"
            )
        groups.append({**first, "params": present})
    if strict and problems:
        raise ValueError("ownstack: " + "; ".join(problems))
    return {"state": state, "param_groups": groups}
