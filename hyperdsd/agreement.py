"""How the ranks of a load agree, and how the data to load reaches them.

A load plans on every rank, agrees, then applies (:mod:`hyperdsd.api`).
Two agreements share one interface, so the load runs the same steps either
way:

- :class:`LocalAgreement`: every rank holds the dict it loads; one
  all-reduce tells every rank whether any found a problem.
- :class:`BroadcastAgreement` (``broadcast_from_rank0``): the root holds
  full state dicts and every rank receives only its own pieces. The root is
  rank 0 of the model's group (:mod:`.transport.group`): global rank 0 for
  a model over the whole world, the lowest rank of its meshes for a model
  on part of it. Only the group's ranks take part.

  1. :meth:`~BroadcastAgreement.manifests` - the root's dicts, each tensor
     replaced by a :class:`TensorMeta` (shape, dtype, index), broadcast in
     one collective; every rank plans its load against them.
  2. :meth:`~BroadcastAgreement.agree` - one exchange carries each rank's
     problems, its answers about placeholders, the names it loads and the
     regions it needs; every rank raises alike if any rank found a problem
     (or, with ``strict``, a name no rank loads); otherwise the root's
     tensors are scattered, each piece going straight into its destination.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _compat
from .state.flat import is_flat
from .state.load_plan import ModelLoadPlan, OptimizerLoadPlan, TensorMeta
from .state.saved_placeholders import UNKNOWN, VARIES, never_stepped_tensors, tensor_fill
from .transport import collectives
from .transport.delivery import deliver, needs_for
from .transport.group import Group
from .transport.needs import PackedNeeds, ShapeDtype
from .tree import rebuild, where

_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


class LocalAgreement:
    """Every rank loads its own dict: one all-reduce agrees, nothing is sent."""

    foreign_ok = False  # every name must be this rank's own

    def __init__(self, group: Group):
        self.group = group
        self.problems: list[str] = []

    def manifests(self, parts: dict[str, Any]) -> dict[str, Any]:
        """What every rank plans against: its own dicts."""
        return parts

    def agree(
        self,
        what: str,
        problems: list[str],
        model_plan: ModelLoadPlan | None,
        optim_plan: OptimizerLoadPlan | None,
        strict: bool,
    ) -> dict[str, bool]:
        """Raise on every rank if any rank has problems; returns the answers to
        this rank's open placeholder questions."""
        questions = optim_plan.questions if optim_plan is not None else {}
        confirm = optim_plan.confirm if optim_plan is not None else frozenset()
        return collectives.agree(problems, f"{what}: nothing was loaded", questions, self.group, confirm)


def describe(state_dict: Any) -> tuple[Any, list[torch.Tensor], list[ShapeDtype], list[str]]:
    """The root's dict with each tensor replaced by a :class:`TensorMeta`;
    the tensors; their ``(shape, dtype)`` in index order; problems.

    The tensors of optimizer entries whose ``step`` is 0 carry the one value
    they hold, if they do (``TensorMeta.fill``): every rank needs it to tell
    a saved never-stepped placeholder state from real state.
    """
    # By id(): the tensors live in ``state_dict`` for the call, and compare elementwise.
    summarise = never_stepped_tensors(state_dict.get("optim")) if isinstance(state_dict, dict) else set()
    fulls: list[torch.Tensor] = []
    metas: list[ShapeDtype] = []
    problems: list[str] = []
    # One object per distinct shape and per distinct (shape, dtype): pickle
    # sends a shared object once, so every rank unpickles a handful instead
    # of one per tensor.
    shared: dict[tuple, ShapeDtype] = {}

    def stand_in(leaf: torch.Tensor) -> TensorMeta:
        return stand_ins([leaf])[0]

    def meta(leaf: Any, path: tuple) -> Any:
        if isinstance(leaf, DTensor):
            problems.append(
                f"state_dict{where(path)}: a DTensor; broadcast_from_rank0 loads full tensors "
                "(get them with full_state_dict=True)"
            )
            return None
        return stand_in(leaf) if isinstance(leaf, torch.Tensor) else leaf

    def stand_ins(leaves: list[torch.Tensor]) -> list[TensorMeta]:
        """A stand-in for each of ``leaves`` (tensors), a column at a time: the
        index it will have in ``fulls``, its shared ``(shape, dtype)``, its fill."""
        keys = list(zip(map(_SHAPE, leaves), map(_DTYPE, leaves)))
        for shape, dtype in dict.fromkeys(keys):
            if (shape, dtype) not in shared:
                shared[(shape, dtype)] = ShapeDtype(tuple(shape), dtype)
        pairs = list(map(shared.__getitem__, keys))
        start = len(fulls)
        fulls.extend(leaves)
        metas.extend(pairs)
        fills = map(fill_of, leaves) if summarise else itertools.repeat(None)
        return TensorMeta.column(pairs, start, fills)

    def fill_of(leaf: torch.Tensor) -> Any:
        fill = tensor_fill(leaf) if id(leaf) in summarise else None
        return None if fill in (UNKNOWN, VARIES) else fill

    def walk(obj: Any, path: tuple) -> Any:
        # rebuild(obj, meta), a dict's plain tensors taken in place (most of a state dict's leaves):
        # a model's dict of tensors, or an optimizer's dict of entries of tensors, a column at a time
        if type(obj) is dict:
            values = list(obj.values())
            kinds = set(map(type, values))
            if kinds == {torch.Tensor}:
                return dict(zip(obj, stand_ins(values)))
            if kinds == {dict}:
                leaves = list(itertools.chain.from_iterable(map(dict.values, values)))
                if set(map(type, leaves)) <= {torch.Tensor}:
                    column = iter(stand_ins(leaves))
                    entries = map(
                        dict, map(zip, values, map(itertools.islice, itertools.repeat(column), map(len, values)))
                    )
                    return dict(zip(obj, entries))
            return {k: stand_in(v) if type(v) is torch.Tensor else walk(v, path + (k,)) for k, v in obj.items()}
        if type(obj) is list and set(map(type, obj)) == {str}:  # a group's FQNs
            return list(obj)
        if type(obj) is list:
            return [walk(v, path + (i,)) for i, v in enumerate(obj)]
        return rebuild(obj, meta, path)

    return walk(state_dict, ()), fulls, metas, problems


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


class BroadcastAgreement:
    """One broadcast load of a model's and/or optimizers' state dicts."""

    foreign_ok = True  # the root's dict names what other ranks (pipeline stages) load

    def __init__(self, group: Group):
        self.group = group
        self.problems: list[str] = []  # the root's: tensors it cannot broadcast
        self.fulls: list[torch.Tensor] = []
        self.metas: list[ShapeDtype] = []
        self.model_names: list[str] = []
        self.optim_names: list[str] = []

    def manifests(self, parts: dict[str, Any]) -> dict[str, Any]:
        """The root's dicts as manifests, on every rank (its tensors stay on the root).

        ``parts`` maps "model" and/or "optim" to the caller's dict; only the
        root's are read, but every rank of the group passes the same keys.
        """
        manifest, problems, metas = None, [], None
        if self.group.is_root:
            # metas sent along: no rank walks the manifest for them
            manifest, self.fulls, metas, problems = describe(parts)
        manifest, problems, metas = collectives.broadcast_object((manifest, problems, metas), self.group)
        if self.group.is_root:
            self.problems = problems
        self.metas = metas
        model, optim = manifest.get("model"), manifest.get("optim")
        self.model_names = [k for k in model if isinstance(k, str)] if isinstance(model, dict) else []
        self.optim_names = optimizer_names(optim)
        return manifest

    def agree(
        self,
        what: str,
        problems: list[str],
        model_plan: ModelLoadPlan | None,
        optim_plan: OptimizerLoadPlan | None,
        strict: bool,
    ) -> dict[str, bool]:
        """Raise on every rank if any rank has problems; else deliver every rank's pieces.

        Returns the answers to this rank's open placeholder questions.
        """
        questions = optim_plan.questions if optim_plan is not None else {}
        mine_model = model_plan.claimed if model_plan is not None else set()
        mine_optim = set(self.optim_names) - set(optim_plan.foreign) if optim_plan is not None else set()
        prepared = [
            p for plan in (model_plan, optim_plan) if plan is not None for p in plan.tensors() if p.meta is not None
        ]
        needs, users, cut = needs_for(prepared, self.metas)
        everyone = collectives.exchange(
            {
                "problems": problems,
                "known": {k: v for k, v in questions.items() if v is not None},
                "model": [i for i, k in enumerate(self.model_names) if k in mine_model],
                "optim": [i for i, k in enumerate(self.optim_names) if k in mine_optim],
                "needs": PackedNeeds(needs),
            },
            self.group,
        )
        by_rank = [e["problems"] for e in everyone]
        if strict:
            extra = self._unowned(everyone)
            by_rank = [p + extra for p in by_rank]
        collectives.raise_if_any(by_rank, f"{what}: nothing was loaded", self.group)
        confirm = optim_plan.confirm if optim_plan is not None else frozenset()
        answers = collectives.answer(collectives.open_questions(questions, confirm), [e["known"] for e in everyone])
        deliver(
            needs,
            users,
            cut,
            self.fulls if self.group.is_root else None,
            self.metas,
            _compat.collective_device(),
            everyone_needs=[e["needs"] for e in everyone],
            group=self.group,
        )
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
