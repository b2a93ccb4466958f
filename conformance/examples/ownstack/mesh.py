"""ownstack's device mesh: ranks laid out row-major over a shape, one name per dimension.

A mesh owns its process groups: along each dimension, the ranks that share
this rank's other coordinates, and one over all its ranks. Groups are made
with ``use_local_synchronization=True`` so that only a mesh's members take
part in building it (a rank off the mesh builds nothing). Members build
their groups in one fixed order (dimension 0 first, the whole group last),
so the groups' names, which come from their ranks and from how many groups
with those ranks a rank already built, agree on every member.

Meshes are cached by description: a stack that asks again for the mesh it
already has gets the same object and issues no collective.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.distributed as dist

_MESHES: dict[tuple, "Mesh"] = {}
_LOCK = threading.Lock()


def _row_major(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The coordinate of position ``flat`` in a row-major array of ``shape``."""
    out = []
    for n in reversed(shape):
        out.append(flat % n)
        flat //= n
    return tuple(reversed(out))


def _this_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Mesh:
    """A device mesh of ownstack's own (not torch's ``DeviceMesh``).

    ``ranks`` are global ranks in row-major order over ``shape``; the mesh
    keeps one process group per dimension through this rank and one over all
    its ranks (the same object where the two have the same ranks, as on a
    1-D mesh). Build it with :meth:`from_description` to share it.
    """

    def __init__(self, ranks, shape, dim_names, device_type: str = "cpu"):
        self.ranks = tuple(int(r) for r in ranks)
        self.shape = tuple(int(n) for n in shape)
        self.dim_names = tuple(str(n) for n in dim_names)
        self.device_type = str(device_type)
        count = 1
        for n in self.shape:
            count *= n
        if count != len(self.ranks) or len(self.dim_names) != len(self.shape):
            raise ValueError(
                f"ownstack.Mesh: {len(self.ranks)} ranks do not fill shape {self.shape} with names {self.dim_names}"
            )
        self._coordinate = self._find_coordinate()
        self._groups: list[Any] = []
        self._whole: Any = None
        if self._coordinate is not None:
            self._build_groups()

    @classmethod
    def from_description(cls, desc) -> "Mesh":
        """The mesh ``desc`` describes (anything with ``ranks``, ``shape``,
        ``dim_names``, ``device_type``), built once per description: a second
        call returns the cached mesh and creates no process group."""
        key = (
            tuple(int(r) for r in desc.ranks),
            tuple(int(n) for n in desc.shape),
            tuple(str(n) for n in desc.dim_names),
            str(getattr(desc, "device_type", "cpu")),
        )
        with _LOCK:
            mesh = _MESHES.get(key)
            if mesh is None:
                mesh = _MESHES[key] = cls(*key)
        return mesh

    def _find_coordinate(self) -> tuple[int, ...] | None:
        rank = _this_rank()
        if rank not in self.ranks:
            return None
        return _row_major(self.ranks.index(rank), self.shape)

    def _ranks_along(self, dim: int) -> list[int]:
        """The ranks that share this rank's coordinate in every dimension but ``dim``."""
        out = []
        for i in range(self.shape[dim]):
            coord = list(self._coordinate)
            coord[dim] = i
            flat = 0
            for c, n in zip(coord, self.shape):
                flat = flat * n + c
            out.append(self.ranks[flat])
        return out

    def _build_groups(self) -> None:
        """One group per dimension, then the whole mesh's; none without a
        process group (a single process) or for a single rank."""
        if not (dist.is_available() and dist.is_initialized()) or len(self.ranks) == 1:
            self._groups = [None] * len(self.shape)
            return
        for dim in range(len(self.shape)):
            along = self._ranks_along(dim)
            group = dist.new_group(along, use_local_synchronization=True) if len(along) > 1 else None
            self._groups.append(group)
        if len(self.shape) == 1:
            self._whole = self._groups[0]
        else:
            self._whole = dist.new_group(list(self.ranks), use_local_synchronization=True)

    # -- what the rest of the stack asks ---------------------------------
    def size(self, dim: int | None = None) -> int:
        return len(self.ranks) if dim is None else self.shape[dim]

    def ndim(self) -> int:
        return len(self.shape)

    def coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate, one index per dimension; None off the mesh."""
        return self._coordinate

    def group(self, dim: int | str):
        """The process group along ``dim`` (an index or a name) through this
        rank; None where that dimension has one rank."""
        index = self.dim_names.index(dim) if isinstance(dim, str) else dim
        return self._groups[index]

    def whole_group(self):
        """The process group over every rank of the mesh (None for one rank)."""
        return self._whole

    def first_rank(self) -> int:
        return self.ranks[0]

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"ownstack.Mesh({dims}; ranks={list(self.ranks)}; {self.device_type})"
