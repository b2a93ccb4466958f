"""DCP's local save and load plans, built in bulk.

DCP plans each DTensor of a state dict on its own: its local shard's shape
and offset from its mesh and placements, then the write item or the read
items that cover it (with the resharding sweep over the saved chunks). A
model of many same-shaped parameters asks the same questions tens of
thousands of times. Here DCP answers once per kind of DTensor (global shape,
mesh, placements; for a load, the saved chunks too) and its answer is
reused for every DTensor of that kind, with the key's own name. Every other
value goes through DCP's own planning. The plans are those DCP would make.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import (
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from . import _compat

__all__ = ["SavePlanner", "local_load_plan", "local_save_plan"]


def _plain_dtensor(obj: Any) -> bool:
    """A DTensor whose local tensor is a plain tensor and that holds no partial values: DCP plans it by its
    geometry alone."""
    return (
        type(obj) is DTensor
        and type(_compat.local_tensor(obj)) is torch.Tensor
        and not any(p.is_partial() for p in obj.placements)
    )


def local_save_plan(state_dict: dict[str, Any], is_coordinator: bool) -> SavePlan:
    """``create_default_local_save_plan(state_dict, is_coordinator)``, DTensors planned once per kind."""
    items: list[WriteItem] = []
    rest: dict[str, Any] = {}
    made: dict[tuple, WriteItem | None] = {}
    grad = torch.is_grad_enabled()
    for fqn, obj in state_dict.items():
        if not _plain_dtensor(obj):
            rest[fqn] = obj
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
    if rest:
        items += create_default_local_save_plan(rest, is_coordinator).items
    return SavePlan(items)


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """``create_default_local_load_plan(state_dict, metadata, strict)``, DTensors planned once per kind."""
    items: list[ReadItem] = []
    rest: dict[str, Any] = {}
    made: dict[tuple, list[ReadItem]] = {}
    saved = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if not (isinstance(md, TensorStorageMetadata) and _plain_dtensor(obj) and md.size == obj.size()):
            rest[fqn] = obj  # DCP plans it, or raises as it does
            continue
        if obj.device_mesh.get_coordinate() is None:
            continue  # outside the DTensor's mesh: nothing to read (as DCP)
        kind = (obj.shape, obj.device_mesh, obj.placements, tuple((c.offsets, c.sizes) for c in md.chunks))
        template = made.get(kind)
        if template is None:
            template = made[kind] = create_read_items_for_chunk_list(fqn, md, obj.__create_chunk_list__())
        for t in template:
            items.append(
                ReadItem(
                    type=t.type,
                    dest_index=MetadataIndex(fqn, t.dest_index.offset, t.dest_index.index),
                    dest_offsets=t.dest_offsets,
                    storage_index=MetadataIndex(fqn, t.storage_index.offset, t.storage_index.index),
                    storage_offsets=t.storage_offsets,
                    lengths=t.lengths,
                )
            )
    if rest:
        items += create_default_local_load_plan(rest, metadata, strict).items
    return LoadPlan(items)


def local_shard(state_dict: dict[str, Any], index: MetadataIndex) -> torch.Tensor | None:
    """The tensor DCP's ``find_state_dict_object`` finds for a plain DTensor's key (its local tensor, without
    going through autograd as ``to_local()`` does); None for anything else."""
    obj = state_dict.get(index.fqn)
    return _compat.local_tensor(obj) if _plain_dtensor(obj) else None


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, its local plan built by :func:`local_save_plan`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        found = local_shard(self.state_dict, index)
        return found if found is not None else super().lookup_object(index)

    def create_local_plan(self) -> SavePlan:
        if getattr(self, "_enable_plan_caching", False):
            return super().create_local_plan()
        plan = local_save_plan(self.state_dict, self.is_coordinator)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan
