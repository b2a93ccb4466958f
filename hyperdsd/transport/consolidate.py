"""Full and offloaded state dicts: which rank ends up with what on get.

``full_model`` and ``full_optimizer`` turn DTensors into full tensors,
everywhere or, with ``cpu_offload``, only on the root (the others get
``{}``): the first rank of the model's group (:mod:`hyperdsd.transport.group`), global rank 0
for a model over the whole world. When ranks hold different FQNs (pipeline
stages), each FQN's lowest holder gathers it and the root receives the rest,
so the root ends with everything. ``offload`` moves a sharded state dict to
CPU. Loads from the root are :mod:`hyperdsd.agreement`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _compat
from ..placement import DTensorLayout
from ..tree import is_container, leaves, rebuild
from . import collectives
from .gather import Gatherer
from .group import Group


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def offload(value: Any) -> Any:
    """Sharded ``cpu_offload``: local pieces to CPU, DTensors stay DTensors."""

    def move(leaf: Any, _path: tuple) -> Any:
        if isinstance(leaf, DTensor):
            local = _compat.local_tensor(leaf)
            return leaf if local.device.type == "cpu" else DTensorLayout.of(leaf).wrap(local.cpu())
        return _to_cpu(leaf) if isinstance(leaf, torch.Tensor) else leaf

    return rebuild(value, move)


def full_entries(
    entries: dict[str, Any], group: Group, *, root_only: bool, cpu: bool, rounds: list | None = None
) -> tuple[dict[str, Any], dict[str, int] | None]:
    """Gather every DTensor in ``entries`` (values: tensors, or containers of them).

    Returns the entries this rank keeps (all of them, or with ``root_only``
    those it is root of) and, when the ranks of ``group`` hold different
    keys, the root of each key (None when every rank holds the same keys).
    ``rounds`` (a wrapper layout's twin's, the same on every rank): ``(keys, fill)``
    pairs, taken one after the other before the rest is gathered:
    ``fill(entries, root_of)`` gathers those keys' entries itself, each to
    ``root_of(key)`` (None: to every rank), and gives them full (None where
    this rank keeps nothing); what DTensors they still hold are gathered
    with the rest.
    """
    keys = list(entries)
    roots: dict[str, int] | None = None
    if root_only and group.has_peers and not collectives.same_everywhere(keys, group):
        roots = collectives.roots_of(keys, group)
    me = collectives.rank()

    def root_of(key: str) -> int | None:
        if not root_only:
            return None
        return roots[key] if roots is not None else group.root

    values = dict(entries) if rounds else entries
    for round_keys, fill in rounds or ():
        part = {k: entries[k] for k in round_keys if k in entries}
        if part:
            values.update(fill(part, root_of))
    gatherer = Gatherer(cpu=cpu)
    fixed = roots is None  # every key's root the same: asked once
    root = (group.root if root_only else None) if fixed else None
    for key, value in values.items():
        if not fixed:
            root = root_of(key)
        if type(value) is DTensor:  # (a model's entry, or a state dict's flat layout: no walk)
            gatherer.add((key, ()), value, root=root)
        elif type(value) is dict and not any(map(is_container, value.values())):  # AdamW's entries
            for name, leaf in value.items():
                if isinstance(leaf, DTensor):
                    gatherer.add((key, (name,)), leaf, root=root)
        else:
            for sub, leaf in leaves(value):
                if isinstance(leaf, DTensor):
                    gatherer.add((key, sub), leaf, root=root)
    gathered = gatherer.run()
    kept: dict[str, Any] = {}
    for key, value in values.items():
        if not fixed:
            root = root_of(key)
        if root is not None and root != me:
            continue
        kept[key] = _full(key, value, gathered, cpu)
    return kept, roots


def _full(key: str, value: Any, gathered: dict, cpu: bool) -> Any:
    """``value`` with each DTensor replaced by its full tensor (gathered under
    (``key``, its path)), and, with ``cpu``, each other tensor on the CPU."""
    if type(value) is DTensor:
        return gathered[(key, ())]
    if type(value) is dict and not any(map(is_container, value.values())):
        return {
            name: gathered[(key, (name,))] if isinstance(leaf, DTensor) else _kept(leaf, cpu)
            for name, leaf in value.items()
        }

    def full(leaf: Any, sub: tuple) -> Any:
        return gathered[(key, sub)] if isinstance(leaf, DTensor) else _kept(leaf, cpu)

    return rebuild(value, full)


def _kept(leaf: Any, cpu: bool) -> Any:
    return _to_cpu(leaf) if cpu and isinstance(leaf, torch.Tensor) else leaf


def full_model(sd: dict[str, Any], group: Group, *, cpu: bool, rounds: list | None = None) -> dict[str, Any]:
    """The model's full state dict: on every rank, or with ``cpu`` on the root only."""
    root_only = cpu and group.has_peers
    kept, roots = full_entries(sd, group, root_only=root_only, cpu=cpu, rounds=rounds)
    if root_only and roots is not None:
        received = collectives.send_to_root(kept if not group.is_root else None, group)
        if not group.is_root:
            return {}
        for part in received[1:]:
            kept.update(part or {})
    return kept if not root_only or group.is_root else {}


def full_optimizer(nested: dict, group: Group, *, cpu: bool, rounds: list | None = None) -> dict:
    """The optimizers' full state dict (nested): on every rank, or with ``cpu`` on the root only."""
    root_only = cpu and group.has_peers
    state, groups = nested["state"], nested["param_groups"]
    if not root_only:
        kept, _ = full_entries(state, group, root_only=False, cpu=cpu, rounds=rounds)
        return {"state": kept, "param_groups": groups}
    # Roots are decided over every FQN this rank knows, stateless ones included.
    names = list(dict.fromkeys([*state, *(f for g in groups for f in g["params"])]))
    entries = {name: state.get(name) for name in names}
    kept, roots = full_entries(entries, group, root_only=True, cpu=True, rounds=rounds)
    mine = {"state": {k: v for k, v in kept.items() if v is not None}, "param_groups": []}
    if roots is None:
        mine["param_groups"] = groups if group.is_root else []
        return mine if group.is_root else {}
    rooted = set(kept)
    mine["param_groups"] = [g for g in groups if any(f in rooted for f in g["params"]) or (not g["params"] and rooted)]
    received = collectives.send_to_root(mine if not group.is_root else None, group)
    if not group.is_root:
        return {}
    for part in received[1:]:
        if part:
            mine["state"].update(part["state"])
            mine["param_groups"].extend(part["param_groups"])
    return mine
