"""Broadcast loads (``broadcast_from_rank0``): the root holds full state
dicts, every rank receives only its own pieces.

The root is rank 0 of the model's group (:mod:`group`): global rank 0 for a
model over the whole world, the lowest rank of its meshes for a model on
part of it. Only the group's ranks take part.

:class:`BroadcastLoad` runs the protocol around the planning that every
rank does alike:

1. :meth:`~BroadcastLoad.manifests` - the root's dicts, each tensor replaced
   by a :class:`TensorMeta` (shape, dtype, index), broadcast in one
   collective; every rank plans its load against them.
2. :meth:`~BroadcastLoad.agree_and_deliver` - one exchange carries each
   rank's problems, its answers about placeholders, the names it loads and
   the regions it needs; every rank raises alike if any rank found a
   problem (or, with ``strict``, a name no rank loads); otherwise the root's
   tensors are scattered, each piece going straight into its destination.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _compat, collectives
from .flatten import is_flat
from .group import Group
from .plan import ModelLoadPlan, OptimizerLoadPlan, Prepared, TensorMeta
from .scatter import Metas, Need, PackedNeeds, ShapeDtype, scatter_from_root
from .tree import leaves, rebuild, where


def describe(state_dict: Any) -> tuple[Any, list[torch.Tensor], list[ShapeDtype], list[str]]:
    """The root's dict with each tensor replaced by a :class:`TensorMeta`;
    the tensors; their ``(shape, dtype)`` in index order; problems."""
    fulls: list[torch.Tensor] = []
    metas: list[ShapeDtype] = []
    problems: list[str] = []
    # One object per distinct shape and per distinct (shape, dtype): pickle
    # sends a shared object once, so every rank unpickles a handful instead
    # of one per tensor.
    shared: dict[tuple, tuple] = {}

    def meta(leaf: Any, path: tuple) -> Any:
        if isinstance(leaf, DTensor):
            problems.append(f"state_dict{where(path)}: a DTensor; broadcast_from_rank0 loads full tensors (get them with full_state_dict=True)")
            return None
        if isinstance(leaf, torch.Tensor):
            fulls.append(leaf)
            shape = tuple(leaf.shape)
            shape = shared.setdefault(shape, shape)
            pair = ShapeDtype(shape, leaf.dtype)
            metas.append(shared.setdefault(pair, pair))
            return TensorMeta(shape, leaf.dtype, len(fulls) - 1)
        return leaf

    return rebuild(state_dict, meta), fulls, metas, problems


def optimizer_names(manifest: Any) -> list[str]:
    """The FQN-like names in the root's optimizer dict, in an order every rank computes alike."""
    if not isinstance(manifest, dict):
        return []
    if is_flat(manifest):
        return [k for k in manifest if isinstance(k, str)]
    names = [k for k in manifest.get("state", {}) if isinstance(k, str)]
    for g in manifest.get("param_groups", []) or []:
        if isinstance(g, dict) and isinstance(g.get("params"), (list, tuple)):
            names += [f for f in g["params"] if isinstance(f, str)]
    return list(dict.fromkeys(names))


# Who uses each of the root's tensors: mostly one Prepared, kept as itself;
# a tuple only for a tensor loaded into several places. A list per tensor
# was the largest plan object a rank held in a load of many small tensors.
Users = list  # [None | Prepared | tuple[Prepared, ...]] by the root's tensor index


def users_of(users: Users, i: int) -> tuple[Prepared, ...]:
    u = users[i]
    return () if u is None else u if type(u) is tuple else (u,)


def needs_for(prepared: list[Prepared], metas: Metas) -> tuple[list[Need | None], Users, set[int]]:
    """What this rank needs of each of the root's tensors, who uses each, and
    which arrive whole for users that cut their own region from them."""
    needs: list[Need | None] = [None] * len(metas)
    users: Users = [None] * len(metas)
    cut: set[int] = set()
    regions: dict[tuple, Need] = {}  # tensors of one layout and shape need the same region: computed once
    for p in prepared:
        i = p.meta.index
        if p.layout is not None and p.layout.simple:
            key = (p.layout.mesh, p.layout.placements, tuple(p.layout.shape))
            need = regions.get(key)
            if need is None:
                need = regions[key] = Need.of_layout(p.layout)
        else:
            key = ("whole", p.meta.shape)
            need = regions.get(key)
            if need is None:
                need = regions[key] = Need.whole(p.meta.shape)
            if p.layout is not None:
                cut.add(i)  # a layout DTensor cuts itself (strided shards)
        if needs[i] is not None and needs[i] != need:
            need = Need.whole(p.meta.shape)  # used twice with different regions: take it whole
            cut.add(i)
        needs[i] = need
        users[i] = p if users[i] is None else users_of(users, i) + (p,)
    return needs, users, cut


def deliver(needs: list[Need | None], users: Users, cut: set[int], fulls: list[torch.Tensor] | None,
            metas: Metas, device: torch.device, everyone_needs: list | None = None, group: Group | None = None) -> None:
    """Give each Prepared this rank's piece of the root's tensor, as it arrives.

    A piece goes straight into its destination (an existing tensor of the
    same layout) or becomes the new tensor itself, so a rank holds its own
    state plus one bucket in flight. ``metas``: the same on every rank, so
    is the bucket plan. ``needs``, ``users``, ``cut``: as :func:`needs_for`
    gives them. ``everyone_needs``: every rank's needs, when the caller has
    exchanged them already.
    """

    def receive(i: int, piece: torch.Tensor) -> None:
        u = users[i]
        if type(u) is Prepared and i not in cut:
            u.receive(piece)  # the region this one user needs
            return
        for p in users_of(users, i):
            p.receive(p.layout.local_from_full(piece) if p.layout is not None and i in cut else piece)

    def target_for(i: int) -> torch.Tensor | None:
        """Where a large piece can be received in place: its one user's destination."""
        u = users[i]
        if type(u) is not Prepared or u.dest is None:
            return None
        return _compat.local_tensor(u.dest)

    scatter_from_root(metas, fulls, needs, device, on_piece=receive, target_for=target_for, everyone_needs=everyone_needs, group=group)


class BroadcastLoad:
    """One broadcast load of a model's and/or optimizers' state dicts.

    ``parts`` maps "model" and/or "optim" to the caller's dict; only the
    root's are read, but every rank of ``group`` passes the same keys.
    """

    def __init__(self, parts: dict[str, Any], group: Group):
        self.parts = parts
        self.group = group
        self.problems: list[str] = []  # the root's: tensors it cannot broadcast
        self.fulls: list[torch.Tensor] = []
        self.metas: list[tuple] = []
        self.model_names: list[str] = []
        self.optim_names: list[str] = []

    def manifests(self) -> dict[str, Any]:
        """The root's dicts as manifests, on every rank (its tensors stay on the root)."""
        manifest, problems, metas = None, [], None
        if self.group.is_root:
            manifest, self.fulls, metas, problems = describe(self.parts)  # metas sent along: no rank walks the manifest for them
        manifest, problems, metas = collectives.broadcast_object((manifest, problems, metas), self.group)
        if self.group.is_root:
            self.problems = problems
        self.metas = metas
        model, optim = manifest.get("model"), manifest.get("optim")
        self.model_names = [k for k in model if isinstance(k, str)] if isinstance(model, dict) else []
        self.optim_names = optimizer_names(optim)
        return manifest

    def agree_and_deliver(self, what: str, problems: list[str], model_plan: ModelLoadPlan | None,
                          optim_plan: OptimizerLoadPlan | None, strict: bool) -> dict[str, bool]:
        """Raise on every rank if any rank has problems; else deliver every rank's pieces.

        Returns the answers to this rank's open placeholder questions.
        """
        questions = optim_plan.questions if optim_plan is not None else {}
        mine_model = model_plan.claimed if model_plan is not None else set()
        mine_optim = set(self.optim_names) - set(optim_plan.foreign) if optim_plan is not None else set()
        prepared = [p for plan in (model_plan, optim_plan) if plan is not None for p in plan.tensors() if p.meta is not None]
        needs, users, cut = needs_for(prepared, self.metas)
        everyone = collectives.exchange({
            "problems": problems,
            "known": {k: v for k, v in questions.items() if v is not None},
            "model": [i for i, k in enumerate(self.model_names) if k in mine_model],
            "optim": [i for i, k in enumerate(self.optim_names) if k in mine_optim],
            "needs": PackedNeeds(needs),
        }, self.group)
        by_rank = [e["problems"] for e in everyone]
        if strict:
            extra = self._unowned(everyone)
            by_rank = [p + extra for p in by_rank]
        collectives.raise_if_any(by_rank, f"{what}: nothing was loaded", self.group)
        answers = collectives.answer([k for k, v in questions.items() if v is None], [e["known"] for e in everyone])
        deliver(needs, users, cut, self.fulls if self.group.is_root else None, self.metas, _compat.collective_device(),
                everyone_needs=[e["needs"] for e in everyone], group=self.group)
        return answers

    def _unowned(self, everyone: list[dict]) -> list[str]:
        """Names in the root's dicts that no rank loads (problems under ``strict``)."""
        owned_model = {i for e in everyone for i in e["model"]}
        owned_optim = {i for e in everyone for i in e["optim"]}
        nobody = [k for i, k in enumerate(self.model_names) if i not in owned_model]
        nobody_optim = [k for i, k in enumerate(self.optim_names) if i not in owned_optim]
        extra = []
        if nobody:
            extra.append(f"model keys that no rank has (strict=True): {nobody}")
        if nobody_optim:
            extra.append(f"not parameters of any rank's model (strict=True): {nobody_optim}")
        return extra
