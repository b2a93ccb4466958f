"""The save planner: DCP's save plans, built in bulk.

DCP plans each DTensor of a state dict on its own: its local shard's shape
and offset from its mesh and placements, then the write item that covers
it. A model of many same-shaped parameters asks the same questions tens of
thousands of times. Here DCP answers once per kind of DTensor (global shape,
mesh, placements) and its answer is reused for every DTensor of that kind,
with the key's own name. Every other value goes through DCP's own planning.
The plans are those DCP would make (the load planner's local plans are
built alike: :mod:`.load_planner`).

The coordinator's global save plan (DCP's ``dedup_save_plans``,
``create_default_global_save_plan`` and ``_validate_global_plan``) is made
in one pass over every rank's items, keyed by plain tuples rather than
``MetadataIndex`` objects, and checked once per layout of chunks (a tensor's
size and its chunks' offsets and sizes) rather than once per key: the same
global plans and the same metadata, item for item.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import (
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .. import _compat

__all__ = ["SavePlanner", "global_save_plan", "local_save_plan", "local_shard", "plain_dtensor"]


def plain_dtensor(obj: Any) -> bool:
    """A DTensor whose local tensor is a plain tensor and that holds no partial values: DCP plans it by its
    geometry alone."""
    return (
        type(obj) is DTensor
        and type(_compat.local_tensor(obj)) is torch.Tensor
        and not any(p.is_partial() for p in obj.placements)
    )


def local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """``create_default_local_save_plan(state_dict, is_coordinator)``, DTensors planned once per kind; the
    items in DCP's order (the state dict's)."""
    items: list[WriteItem | str] = []  # a key DCP plans stands for its items until they are made
    rest: dict[str, Any] = {}
    made: dict[tuple, WriteItem | None] = {}
    grad = torch.is_grad_enabled()
    for fqn, obj in state_dict.items():
        if not plain_dtensor(obj):
            rest[fqn] = obj
            items.append(fqn)
            continue
        local = _compat.local_tensor(obj)
        kind = (obj.shape, obj.device_mesh, obj.placements, local.dtype, local.layout, obj.requires_grad, grad)
        if kind not in made:
            mine = create_default_local_save_plan({fqn: obj}, is_coordinator).items
            # One item, as DCP makes for a DTensor this rank holds a shard of
            # (none where it is outside the mesh); pinned memory is the one
            # property of the local tensor itself: left to DCP.
            made[kind] = mine[0] if len(mine) == 1 and not local.is_pinned() else None
            if made[kind] is None:
                items += mine
                continue
        elif local.is_pinned() or made[kind] is None:
            items += create_default_local_save_plan({fqn: obj}, is_coordinator).items
            continue
        first = made[kind]
        items.append(
            WriteItem(index=MetadataIndex(fqn, first.index.offset), type=first.type, tensor_data=first.tensor_data)
        )
    if not rest:
        return SavePlan(items)
    theirs: dict[str, list[WriteItem]] = {}
    for item in create_default_local_save_plan(rest, is_coordinator).items:
        theirs.setdefault(item.index.fqn, []).append(item)
    if not theirs.keys() <= rest.keys():  # items not named by their key: DCP's plan as it is
        return create_default_local_save_plan(state_dict, is_coordinator)
    ordered: list[WriteItem] = []
    for item in items:
        if type(item) is str:
            ordered += theirs.get(item, ())
        else:
            ordered.append(item)
    return SavePlan(ordered)


def local_shard(state_dict: dict[str, Any], index: MetadataIndex) -> torch.Tensor | None:
    """The tensor DCP's ``find_state_dict_object`` finds for a plain DTensor's key (its local tensor, without
    going through autograd as ``to_local()`` does); None for anything else."""
    obj = state_dict.get(index.fqn)
    return _compat.local_tensor(obj) if plain_dtensor(obj) else None


# DCP's own check of a global plan: a list of errors (torch 2.12 on) or a bool (before); None where absent.
_validate_global_plan = _compat.dcp_global_plan_check()


def _copyable(cls: type) -> bool:
    """Whether ``dataclasses.replace`` of an instance of ``cls`` is a copy of its ``__dict__``, the replaced
    fields set: every field passed to ``__init__`` and kept as passed (``MetadataIndex`` makes its offset a
    ``torch.Size``, which an index's offset already is), no ``__post_init__``, no slots."""
    return (
        dataclasses.is_dataclass(cls)
        and all(f.init for f in dataclasses.fields(cls))
        and not hasattr(cls, "__post_init__")
        and not hasattr(cls, "__slots__")
    )


_COPYABLE = _copyable(WriteItem) and _copyable(MetadataIndex)


def global_save_plan(
    all_plans: list[SavePlan], save_to_lowest_rank: bool = False, flatten_state_dict: bool = True
) -> tuple[list[SavePlan], Metadata] | None:
    """What ``DefaultSavePlanner.create_global_plan`` makes of ``all_plans`` (without plan caching): the
    plans of ``dedup_save_plans(all_plans, save_to_lowest_rank)`` with the index hints of
    ``create_default_global_save_plan``, and its metadata, the ranks' mappings merged into it as DCP merges
    them. None where DCP would raise (a plan it refuses, overlapping or missing chunks): DCP's own planner
    then says why.

    Indices are keyed by ``(fqn, offset)``, what a ``MetadataIndex`` hashes and compares. An index in
    several plans goes to the plan DCP picks, by the same rule over the same set of plan indices (built
    in the same order, so iterated in the same order), visiting the indices in DCP's order. DCP's check
    runs once per layout of chunks, on the first key of that layout, since it looks at nothing else."""
    if _validate_global_plan is None:
        return None
    keys = [[(item.index.fqn, item.index.offset) for item in plan.items] for plan in all_plans]
    dropped = _deduplicated(all_plans, keys, save_to_lowest_rank)
    made = _hinted_plans(all_plans, keys, dropped)
    if made is None:
        return None
    global_plan, md = made
    metadata = Metadata(md)
    if flatten_state_dict:
        # dict(ChainMap(*mappings)): keys in the order of the reversed list, values from the first plan with each
        merged: dict = {}
        for plan in reversed(global_plan):
            if type(plan.planner_data) is not dict:
                return None
            merged.update(plan.planner_data)
        metadata = dataclasses.replace(metadata, planner_data=merged)
    return (global_plan, metadata) if _valid(global_plan, md) else None


def _deduplicated(all_plans: list[SavePlan], keys: list[list[tuple]], save_to_lowest_rank: bool) -> list[set]:
    """dedup_save_plans: per plan, the indices it leaves to another. Each index's plans (the first, and the
    set DCP builds where it is in several), in the order the indices first appear; the last item with an
    index counts its storage size."""
    owner: dict[tuple, int] = {}
    shared: dict[tuple, set[int]] = {}
    last: dict[tuple, WriteItem] = {}
    for p, (plan, mine) in enumerate(zip(all_plans, keys)):
        for key in owner.keys() & mine:
            plans = shared.get(key)
            if plans is None:
                plans = shared[key] = set()
                plans.add(owner[key])
            plans.add(p)
        owner.update(dict.fromkeys(mine, p))  # keys keep their first place; a shared key's value goes unused
        last.update(zip(mine, plan.items))
    dropped: list[set[tuple]] = [set() for _ in all_plans]
    if not shared:
        return dropped
    sizes = [0] * len(all_plans)
    storage: dict[tuple, int | None] = {}
    for key, chosen in owner.items():
        plans = shared.get(key)
        if plans is not None:
            chosen = min(plans) if save_to_lowest_rank else min(plans, key=sizes.__getitem__)
            for p in plans:
                if p != chosen:
                    dropped[p].add(key)
        if save_to_lowest_rank:
            continue
        item = last[key]
        data = item.tensor_data
        if data is None:
            sizes[chosen] += 1
            continue
        kind = (data.size, data.properties.dtype)
        nbytes = storage.get(kind, -1)
        if nbytes == -1:
            nbytes = storage[kind] = item.tensor_storage_size()
        sizes[chosen] += nbytes or 1
    return dropped


def _hinted_plans(
    all_plans: list[SavePlan], keys: list[list[tuple]], dropped: list[set]
) -> tuple[list[SavePlan], dict[str, Any]] | None:
    """create_default_global_save_plan over the items kept, with index hints (each item and its index
    copied, as dataclasses.replace does, where that is what it does): the plans and the metadata's
    entries; None where DCP would refuse them."""
    copy = _COPYABLE
    new = object.__new__
    shard, byte_io = WriteItemType.SHARD, WriteItemType.BYTE_IO
    md: dict[str, Any] = {}
    global_plan = []
    for plan, mine, drop in zip(all_plans, keys, dropped):
        items: list[WriteItem] = []
        append = items.append
        for item, key in zip(plan.items, mine):
            if drop and key in drop:
                continue
            fqn = key[0]
            kind = item.type
            if kind != shard and fqn in md:
                return None  # DCP: AssertionError
            if kind == byte_io:
                md[fqn] = BytesStorageMetadata()
                append(item)
                continue
            data = item.tensor_data
            if data is None or data.chunk is None:
                return None  # DCP: AssertionError
            tensor_md = md.get(fqn)
            if tensor_md is None:
                tensor_md = md[fqn] = TensorStorageMetadata(properties=data.properties, size=data.size, chunks=[])
            elif type(tensor_md) is not TensorStorageMetadata:
                return None  # DCP: bytes and tensor items under one key
            chunks = tensor_md.chunks
            if copy and type(item) is WriteItem and type(item.index) is MetadataIndex:
                index = new(MetadataIndex)
                fields = index.__dict__
                fields.update(item.index.__dict__)
                fields["index"] = len(chunks)
                hinted = new(WriteItem)
                fields = hinted.__dict__
                fields.update(item.__dict__)
                fields["index"] = index
            else:
                hinted = dataclasses.replace(item, index=dataclasses.replace(item.index, index=len(chunks)))
            append(hinted)
            chunks.append(data.chunk)
        global_plan.append(dataclasses.replace(plan, items=items))
    return global_plan, md


def _valid(global_plan: list[SavePlan], md: dict[str, Any]) -> bool:
    """_validate_global_plan, once per layout: it looks at a key's size and its chunks' offsets and sizes."""
    first: dict[tuple, str] = {}
    for fqn, value in md.items():
        if type(value) is TensorStorageMetadata:
            layout = (tuple(value.size), tuple((tuple(c.offsets), tuple(c.sizes)) for c in value.chunks))
        else:
            layout = ()
        first.setdefault(layout, fqn)
    for fqn in first.values():
        verdict = _validate_global_plan(global_plan, Metadata({fqn: md[fqn]}))
        if verdict is not True and verdict != []:
            return False
    return True


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, its local plan built by :func:`local_save_plan` and its global plan by
    :func:`global_save_plan`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = local_shard(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)

    def create_local_plan(self) -> SavePlan:
        if _compat.dcp_plan_caching(self):
            return super().create_local_plan()
        plan = local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        made = None
        if not _compat.dcp_plan_caching(self):
            made = global_save_plan(all_plans, self.dedup_save_to_lowest_rank, self.flatten_state_dict)
        if made is None:  # DCP's own, which raises where the plans are refused
            return super().create_global_plan(all_plans)
        self.global_plan, self.metadata = made
        return made
