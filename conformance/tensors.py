"""Distributed values, read one way whatever their class (SPEC §1, 1.6).

A conforming implementation is judged by what its distributed values hold,
not by their class: local data, global shape, placements and mesh. torch's
``DTensor`` is one such class; a vendor's stack may have its own tensor, mesh
and placements. The suite reads every distributed value through one
:class:`TensorProtocol`, the adapter's (``Adapter.tensors``; default torch's
DTensor), and this module is the one place that knows a class: nothing else
in the suite asks ``isinstance(value, DTensor)``
(``tests/repository/test_fences.py`` holds it so).

A vendor subclasses :class:`TensorProtocol` and overrides its methods for
its own tensor type; :class:`MeshDescription` is how a mesh is described
between the suite and a stack (ranks, shape, dimension names), so that a
stack builds its own mesh from the suite's (``Adapter.mesh``).

The functions below the class are what the suite calls: they use the
protocol the rank's adapter declared (:func:`use`, set by the runner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from . import _compat

__all__ = [
    "MeshDescription",
    "TensorProtocol",
    "TorchDTensors",
    "block_start",
    "copied",
    "current",
    "describe_layout",
    "from_torch",
    "full",
    "global_shape",
    "held",
    "is_distributed",
    "like",
    "local",
    "mesh",
    "placements",
    "to_dtype",
    "use",
]


@dataclass(frozen=True)
class MeshDescription:
    """A device mesh as data: the global ranks in row-major order over
    ``shape``, a name per dimension, the device type. Two values are on the
    same mesh when their descriptions are equal. ``torch_mesh`` is torch's
    ``DeviceMesh`` where the suite built one (never compared): a stack built on
    torch's meshes may use it, any other builds its own from the rest."""

    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    device_type: str = "cpu"
    torch_mesh: Any = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def of(cls, mesh) -> "MeshDescription":
        """The description of torch's ``DeviceMesh`` ``mesh``."""
        ranks = mesh.mesh
        names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(ranks.dim())))
        return cls(tuple(ranks.flatten().tolist()), tuple(ranks.shape), names, mesh.device_type, mesh)

    def size(self, dim: int | None = None) -> int:
        if dim is None:
            return len(self.ranks)
        return self.shape[dim]

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s place on the mesh, one index per dimension; None off it."""
        if rank not in self.ranks:
            return None
        flat, out = self.ranks.index(rank), []
        for n in reversed(self.shape):
            out.append(flat % n)
            flat //= n
        return tuple(reversed(out))


class TensorProtocol:
    """How the suite reads an implementation's distributed values, and makes them.

    The default is torch's DTensor (:class:`TorchDTensors`). A stack with a
    tensor of its own overrides every method; placements are given as torch's
    placement types (``torch.distributed.tensor.Shard(dim)``, ``Replicate()``,
    ``Partial()``), the suite's common words for them, whatever the stack calls
    its own. Methods marked collective are called on every rank of the value's
    mesh alike, in the same order.
    """

    #: What reports call the distributed values of this stack.
    name = "distributed tensor"

    def is_distributed(self, value: Any) -> bool:
        """Whether ``value`` is one of the stack's distributed values."""
        raise NotImplementedError

    def local(self, value) -> torch.Tensor:
        """The part of ``value`` this rank holds, as a plain tensor (its own storage, not a copy)."""
        raise NotImplementedError

    def global_shape(self, value) -> torch.Size:
        raise NotImplementedError

    def placements(self, value) -> tuple:
        """One torch placement per mesh dimension."""
        raise NotImplementedError

    def mesh(self, value) -> MeshDescription:
        raise NotImplementedError

    def full(self, value) -> torch.Tensor:
        """The whole tensor, as a plain tensor on this rank. Collective."""
        raise NotImplementedError

    def like(self, value, local: torch.Tensor, shape: torch.Size | None = None):
        """A distributed value laid out as ``value`` (mesh, placements) holding
        ``local`` as this rank's part; ``shape``: another global shape (a value
        the suite damages on purpose). No communication."""
        raise NotImplementedError

    def from_torch(self, dtensor):
        """torch's DTensor ``dtensor`` (one the suite built: a layout's placed
        weight, a reference) as the stack's own value. Collective where the
        stack's mesh must be built."""
        raise NotImplementedError

    def held(self, value, param):
        """``value``, which an optimizer holds for ``param``, as the suite reads
        it: a stack whose optimizer keeps plain local shards of a distributed
        parameter returns ``like(param, value)`` for them, so that its state
        is judged as distributed like its parameter. Default: as it is."""
        return value

    def copy(self, value):
        """An independent copy of a distributed value (a snapshot's)."""
        return self.like(value, self.local(value).detach().clone())

    def to_dtype(self, value, dtype: torch.dtype):
        """``value`` in another dtype, laid out as it is (a value the suite damages on purpose)."""
        return self.like(value, self.local(value).to(dtype))


class TorchDTensors(TensorProtocol):
    """torch's ``DTensor``: the default, and what every adapter written before 1.6 gets."""

    name = "DTensor"

    def __init__(self):
        from torch.distributed.tensor import DTensor

        self._cls = DTensor

    def is_distributed(self, value) -> bool:
        return isinstance(value, self._cls)

    def local(self, value) -> torch.Tensor:
        return _compat.local(value)

    def global_shape(self, value) -> torch.Size:
        return value.shape

    def placements(self, value) -> tuple:
        return tuple(value.placements)

    def mesh(self, value) -> MeshDescription:
        return _torch_mesh_description(value.device_mesh)

    def full(self, value) -> torch.Tensor:
        return value.full_tensor()

    def like(self, value, local, shape=None):
        if shape is None:
            return _compat.dtensor_like(value, local)
        return self._cls.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=shape, stride=_contiguous(shape)
        )

    def from_torch(self, dtensor):
        return dtensor

    def to_dtype(self, value, dtype: torch.dtype):
        return value.to(dtype)

    def copy(self, value):
        if type(value) is self._cls:
            return _compat.dtensor_like(value, _compat.local(value).detach().clone())
        return value.detach().clone()  # a subclass copies itself


# Descriptions of torch's meshes by the mesh object (held, so that its id stays its own): a
# many-key comparison reads a mesh per value, and a rank builds few meshes.
_DESCRIBED: dict[int, tuple[Any, MeshDescription]] = {}


def _torch_mesh_description(mesh) -> MeshDescription:
    hit = _DESCRIBED.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        hit = _DESCRIBED[id(mesh)] = (mesh, MeshDescription.of(mesh))
    return hit[1]


def _contiguous(shape) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))


# -- the rank's protocol, and what the suite calls ---------------------------

_CURRENT: list[TensorProtocol] = []


def use(protocol: TensorProtocol | None) -> None:
    """Read distributed values with ``protocol`` on this rank from now on (the runner sets the adapter's)."""
    _CURRENT[:] = [protocol] if protocol is not None else []


def current() -> TensorProtocol:
    if not _CURRENT:
        _CURRENT.append(TorchDTensors())
    return _CURRENT[0]


def is_distributed(value) -> bool:
    return current().is_distributed(value)


def local(value) -> torch.Tensor:
    """``value``'s local part where it is distributed, else ``value`` itself."""
    protocol = current()
    return protocol.local(value) if protocol.is_distributed(value) else value


def global_shape(value) -> torch.Size:
    protocol = current()
    return protocol.global_shape(value) if protocol.is_distributed(value) else value.shape


def placements(value) -> tuple:
    return current().placements(value)


def mesh(value) -> MeshDescription:
    return current().mesh(value)


def full(value) -> torch.Tensor:
    """``value`` whole (collective where it is distributed)."""
    protocol = current()
    return protocol.full(value) if protocol.is_distributed(value) else value


def like(value, local: torch.Tensor, shape=None):
    """``local`` laid out as ``value`` where that is distributed, else ``local`` itself."""
    protocol = current()
    return protocol.like(value, local, shape) if protocol.is_distributed(value) else local


def held(value, param):
    return current().held(value, param)


def from_torch(dtensor):
    return current().from_torch(dtensor)


def copied(t: torch.Tensor) -> torch.Tensor:
    """``t.detach().clone()``, a distributed value's by its protocol."""
    protocol = current()
    return protocol.copy(t) if protocol.is_distributed(t) else t.detach().clone()


def to_dtype(value, dtype: torch.dtype):
    """``value`` in ``dtype``, a distributed value's by its protocol."""
    protocol = current()
    return protocol.to_dtype(value, dtype) if protocol.is_distributed(value) else value.to(dtype)


def describe_layout(value) -> str:
    """``placements=(Shard(dim=0),) local=(2, 8) cpu``: how a report names a distributed value's layout."""
    part = local(value)
    return f"{part.device} placements={placements(value)} local={tuple(part.shape)}"


def block_start(value, rank: int) -> tuple[int, ...] | None:
    """Where ``value``'s local part starts in its global tensor (one offset per
    dim), where that part is one block of it (placements Shard and Replicate,
    each tensor dim sharded once at most, chunks as ``torch.chunk`` cuts them);
    None otherwise (a strided shard, a partial value). The suite gathers many
    small values at once with it (one object exchange, not a collective each)."""
    from torch.distributed.tensor import Replicate, Shard

    where = placements(value)
    if any(type(p) not in (Shard, Replicate) for p in where):
        return None
    dims = [p.dim for p in where if type(p) is Shard]
    if len(dims) != len(set(dims)):
        return None
    on = mesh(value)
    shape, local_shape = global_shape(value), local(value).shape
    coordinate = on.coordinate(rank)
    if coordinate is None:
        return None
    start = [0] * len(shape)
    for mesh_dim, p in enumerate(where):
        if type(p) is Shard:
            size, parts = shape[p.dim], on.size(mesh_dim)
            chunk = -(-size // parts)
            start[p.dim] = min(coordinate[mesh_dim] * chunk, size)
            if local_shape[p.dim] != min(chunk, size - start[p.dim]):
                return None
    return tuple(start)
