"""The load planner: DCP's default load planner, knowing what optimizer state
may be absent (lazy) and what may not, its local plans built in bulk (DTensors
planned once per kind, as the save planner plans them)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    FileSystemReader,
)
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import StateDictError
from .load_template import add_saved_state, judge, optimizer_entries, unexpected
from .save_planner import local_shard, plain_dtensor

_SHOWN = 10  # unexpected keys named in an error; the rest are counted


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, knowing what optimizer state may be absent.

    Pass it to ``dcp.load`` when the state dict holds optimizer state from
    ``get_optimizer_state_dict`` (nested or flat, under any key; a
    ``Stateful`` that returns one works too). Per parameter:

    - state wholly absent from the checkpoint, where the template holds
      placeholders (a never-stepped optimizer's): lazy state; the parameter
      never had a gradient when the checkpoint was saved. It is left out of
      the load, and ``set`` leaves the parameter without state.
    - state in the checkpoint for a parameter the optimizer lists but holds
      no state for (a stepped optimizer's frozen parameter, or one without a
      gradient so far): the template gets an entry for it, full tensors of
      the saved shapes on the CPU, and ``set`` loads it like any other (a
      never-stepped template saved before the first step: no state).
    - state partly absent (``exp_avg`` there, ``exp_avg_sq`` or ``step`` not):
      corruption; :class:`StateDictError` names the FQN and the keys. For a
      parameter a stepped optimizer holds no state for, the template cannot
      say which keys are due: ``set`` refuses a partial entry after the read.
      :func:`load` gives such parameters placeholder state in its template,
      so it refuses one before anything is read.

    Everything else stays required, as with DCP's default planner: the
    model, a stepped optimizer's state, the param groups. With ``strict``
    (the default), entries the checkpoint holds under the state dict's
    top-level keys that no rank asks for are an error too (a checkpoint of
    another model, or with more param groups). ``strict=False`` skips
    missing and unexpected entries as ``allow_partial_load=True`` does;
    partly absent state is still refused.
    """

    def __init__(self, *, strict: bool = True):
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.asked: set[str] = set()
        self.tops: set[str] = set()
        # Keep the read items on their rank: the plans exchanged carry none, and
        # finish_plan puts them back. Only for readers whose global and local
        # planning do not look at the items (see _plain_plans).
        self.local_items = False
        self._items: list | None = None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if self.flatten_state_dict:
            for key, (path, value) in add_saved_state(self.original_state_dict, metadata).items():
                self.state_dict[key] = value
                self.mappings[key] = path
        self.asked = set(self.state_dict)
        self.tops = {str(path[0]) for path in self.mappings.values()} if self.mappings else set(self.state_dict)
        entries = optimizer_entries(self.original_state_dict, self.state_dict, self.mappings)
        drop, problems = judge(entries, metadata.state_dict_metadata, strict=self.strict)
        if problems:
            raise StateDictError("the checkpoint's optimizer state cannot be loaded:\n  " + "\n  ".join(problems))
        for key in drop:
            del self.state_dict[key]

    def create_local_plan(self):
        if self.flatten_state_dict and not set(self.metadata.state_dict_metadata) - set(self.state_dict):
            plan = local_load_plan(self.state_dict, self.metadata, not self.allow_partial_load)
        else:  # keys of the checkpoint no rank asks for: DCP's default planner tells an old checkpoint
            plan = super().create_local_plan()
        if self.local_items:
            self._items = plan.items
            plan = dataclasses.replace(plan, items=[])
        if not self.strict:
            return plan
        # Every rank's keys go to the coordinator, which alone can tell a key
        # no rank asks for (pipeline stages each ask for their own).
        return dataclasses.replace(plan, planner_data=(sorted(self.asked), sorted(self.tops)))

    def create_global_plan(self, global_plan):
        plans = super().create_global_plan(global_plan)
        if not self.strict:
            return plans
        asked: set[str] = set()
        tops: set[str] = set()
        for plan in plans:
            keys, names = plan.planner_data or ((), ())
            asked.update(keys)
            tops.update(names)
        extra = unexpected(asked, tops, self.metadata.state_dict_metadata)
        if extra:
            more = f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else ""
            raise StateDictError(
                "the checkpoint holds entries that no rank's state dict has "
                "(strict=True; another model's checkpoint?): "
                f"{extra[:_SHOWN]}{more}"
            )
        return [dataclasses.replace(plan, planner_data=None) for plan in plans]

    def lookup_tensor(self, index):
        found = local_shard(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)

    def finish_plan(self, new_plan):
        plan = super().finish_plan(new_plan)
        if self._items is not None:
            plan = dataclasses.replace(plan, items=self._items)
        return plan


def _plain_plans(reader) -> bool:
    """Whether ``reader`` plans as DCP's file-system reader does: it leaves plans as they are."""
    cls = type(reader)
    return (
        isinstance(reader, FileSystemReader)
        and cls.prepare_local_plan is FileSystemReader.prepare_local_plan
        and cls.prepare_global_plan is FileSystemReader.prepare_global_plan
    )


def local_load_plan(state_dict: dict[str, Any], metadata: Metadata, strict: bool) -> LoadPlan:
    """``create_default_local_load_plan(state_dict, metadata, strict)``, DTensors planned once per kind."""
    items: list[ReadItem] = []
    rest: dict[str, Any] = {}
    made: dict[tuple, list[ReadItem]] = {}
    saved = metadata.state_dict_metadata
    for fqn, obj in state_dict.items():
        md = saved.get(fqn)
        if not (isinstance(md, TensorStorageMetadata) and plain_dtensor(obj) and md.size == obj.size()):
            rest[fqn] = obj  # DCP plans it, or raises as it does
            continue
        if obj.device_mesh.get_coordinate() is None:
            continue  # outside the DTensor's mesh: nothing to read (as DCP)
        kind = (obj.shape, obj.device_mesh, obj.placements, tuple((c.offsets, c.sizes) for c in md.chunks))
        of_kind = made.get(kind)
        if of_kind is None:
            of_kind = made[kind] = create_read_items_for_chunk_list(fqn, md, obj.__create_chunk_list__())
        for t in of_kind:
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
