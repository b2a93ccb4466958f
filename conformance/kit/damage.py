"""State damaged on purpose: what a strict set must refuse (OPT-ATOM, OPT-PART-6, SCALE-2, REPEAT-1)."""

from __future__ import annotations

import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader

from .. import tensors
from ..judging.oracle import check
from ..running.case_context import NotApplicable

# A parameter no model of the suite has.
GHOST = "ghost.weight"


def wrong_shape(value):
    """The same kind of tensor with one more row: the wrong shape."""
    if tensors.is_distributed(value):
        local = tensors.local(value)
        bigger = torch.zeros((local.shape[0] + 1, *local.shape[1:]), dtype=local.dtype)
        rows = tensors.global_shape(value)
        shape = torch.Size((rows[0] + tensors.mesh(value).size(), *rows[1:]))
        return tensors.like(value, bigger, shape)
    return torch.zeros((value.shape[0] + 1, *value.shape[1:]), dtype=value.dtype)


def drop_from_metadata(c, path: str, keys: list[str]) -> None:
    """Rewrite a DCP checkpoint's metadata without ``keys`` (rank 0), as a
    checkpoint with partly missing state would read. A stack's own checkpoint
    (``Adapter.save_checkpoint``) has a format the suite cannot damage: the
    case is not applicable there."""
    if c.adapter.save_checkpoint is not None:
        raise NotApplicable(
            f"{c.adapter.name} saves with its own checkpoint functions, whose files the suite cannot damage "
            "(it rewrites DCP's metadata); its dicts in memory are damaged by this clause's other cases"
        )
    if c.rank == 0:
        metadata = FileSystemReader(path).read_metadata()
        absent = [k for k in keys if k not in metadata.state_dict_metadata]
        check(not absent, f"setup error: the checkpoint has no {absent}")
        for key in keys:
            del metadata.state_dict_metadata[key]
        with open(os.path.join(path, ".metadata"), "wb") as f:  # DCP's metadata file, a pickled Metadata
            pickle.dump(metadata, f)
    c.barrier()


def drop_from_dict(saved, fqn: str, key: str) -> None:
    """Take ``state[fqn][key]`` out of a state dict kept in memory (nested or
    flat), where this rank holds it (``full_cpu``: the root alone)."""
    osd = saved.optim
    if f"state.{fqn}.{key}" in osd:
        del osd[f"state.{fqn}.{key}"]
    elif fqn in osd.get("state", {}):
        del osd["state"][fqn][key]
