"""Where each rank's piece of a DTensor lies in the full tensor.

Shard and Replicate placements are computed here directly (torch.chunk
semantics, the rule DTensor uses), which lets a rank cut its shard out of a
full tensor, or assemble a full tensor from every rank's piece, without a
collective per tensor. Anything else (strided or partial placements) falls
back to DTensor's own collectives.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _compat


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece ``index`` when ``length`` is split like torch.chunk."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def is_simple(placements) -> bool:
    """Only Replicate and plain Shard, and no tensor dim sharded twice."""
    dims = []
    for p in placements:
        if type(p) is Shard:
            dims.append(p.dim)
        elif type(p) is not Replicate:
            return False
    return len(dims) == len(set(dims))


@dataclass(frozen=True)
class DTensorLayout:
    """How a DTensor (parameter or state) is laid out: mesh, placements,
    global shape and stride, enough to rebuild it around a local tensor."""

    mesh: object
    placements: tuple
    shape: torch.Size
    stride: tuple

    @classmethod
    def of(cls, t: DTensor) -> "DTensorLayout":
        return cls(t.device_mesh, tuple(t.placements), t.shape, t.stride())

    @functools.cached_property
    def simple(self) -> bool:  # (asked of each tensor a broadcast delivers)
        return is_simple(self.placements)

    def slices_for(self, coordinate) -> tuple[slice, ...]:
        """The region of the full tensor held at mesh ``coordinate``."""
        region = [slice(0, n) for n in self.shape]
        for mesh_dim, p in enumerate(self.placements):
            if type(p) is Shard:
                d = p.dim
                start, stop = chunk_bounds(
                    region[d].stop - region[d].start, self.mesh.size(mesh_dim), coordinate[mesh_dim]
                )
                base = region[d].start
                region[d] = slice(base + start, base + stop)
        return tuple(region)

    # This rank's region, computed once per layout (plans share layouts: LayoutCache).
    @functools.cached_property
    def _local_region(self) -> tuple[slice, ...]:
        return self.slices_for(self.mesh.get_coordinate())

    def local_slices(self) -> tuple[slice, ...]:
        return self._local_region

    @functools.cached_property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self._local_region)

    def local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full``: a view for Shard/Replicate layouts;
        for others (strided shards of FSDP over TP) DTensor cuts it, locally."""
        if self.simple:
            return full[self.local_slices()]
        return _compat.distribute_locally(full, self.mesh, self.placements).to_local()

    def wrap(self, local: torch.Tensor) -> DTensor:
        """A DTensor of this layout around ``local`` (its data, not a copy), as
        ``DTensor.from_local(..., run_check=False, shape=, stride=)`` makes it,
        moved to the mesh's device type as that moves it, and requiring grad
        where ``local`` does with grad mode on; but built directly, a leaf with
        no autograd edge back to ``local`` and ``local`` itself inside, not a
        view of it: from_local's autograd function cost about 30 us a tensor,
        most of a twin's get of many parameters. (No caller hands it a tensor
        that requires grad but a twin's pieces, which it detaches.)"""
        if not self._member:  # (a rank outside the mesh: from_local's empty local)
            return DTensor.from_local(
                local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
            )
        device_type = self.mesh.device_type
        if device_type != local.device.type and not local.is_meta:
            local = local.to(device_type)
        spec = self.spec(local.dtype)
        return DTensor.__new__(DTensor, local, spec, requires_grad=local.requires_grad and torch.is_grad_enabled())

    def spec(self, dtype: torch.dtype):
        """The spec of this layout's DTensors of ``dtype``, one kept per dtype."""
        spec = self._specs.get(dtype)
        if spec is None:
            spec = self._specs[dtype] = _compat.dtensor_spec(self.mesh, self.placements, self.shape, self.stride, dtype)
        return spec

    # One spec per dtype, shared by the DTensors a layout wraps (as FSDP2's parameters share theirs).
    @functools.cached_property
    def _specs(self) -> dict:
        return {}

    @functools.cached_property
    def _member(self) -> bool:
        return self.mesh.get_coordinate() is not None


class LayoutCache:
    """One :class:`DTensorLayout` per distinct layout among a plan's tensors.

    A plan of tens of thousands of small tensors has a handful of distinct
    layouts; an object (two, for state) per tensor was a fifth of what a
    rank holds while it plans a load. Keyed by the tensor's ``id`` first
    (the tensors outlive the plan), then by value.
    """

    def __init__(self):
        self._by_tensor: dict[tuple[int, bool], DTensorLayout] = {}
        # By the fields' tuple, not the dataclass: its hash and constructor
        # run Python code, once per tensor; a new layout is made once per value.
        self._distinct: dict[tuple, DTensorLayout] = {}
        self._strides: dict[torch.Size, tuple] = {}

    def of(self, t: DTensor, contiguous: bool = False) -> DTensorLayout:
        """``DTensorLayout.of(t)``; with ``contiguous``, with a contiguous stride."""
        key = (id(t), contiguous)
        layout = self._by_tensor.get(key)
        if layout is None:
            shape = t.shape
            if contiguous:
                stride = self._strides.get(shape)
                if stride is None:
                    stride = self._strides[shape] = _contiguous_stride(shape)
            else:
                stride = t.stride()
            fields = (t.device_mesh, tuple(t.placements), shape, stride)
            layout = self._distinct.get(fields)
            if layout is None:
                layout = self._distinct[fields] = DTensorLayout(*fields)
            self._by_tensor[key] = layout
        return layout


def _contiguous_stride(shape) -> tuple:
    """torch's stride for a contiguous tensor of ``shape`` (empty dims count as 1)."""
    return tuple(math.prod(max(n, 1) for n in shape[d + 1 :]) for d in range(len(shape)))
