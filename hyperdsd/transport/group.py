"""Which ranks a call's collectives run among: the model's process group.

Every collective hyperdsd issues for a model (agreement, object exchanges,
gathers to a root, scatters from it) runs in one process group, and "rank 0"
of ``full_state_dict`` + ``cpu_offload`` and of ``broadcast_from_rank0``
means that group's first rank. The group is read off the model's DTensor
parameters (the mesh-first-rank rule):

* a model without DTensor parameters (single process, DDP, plain pipeline
  stages), or one whose meshes come from a mesh over the whole world
  (FSDP, HSDP, TP, pipeline stages sliced from a ``pp x dp`` mesh, expert
  meshes sliced from the same world mesh), uses the default group: every
  rank of the world calls, and global rank 0 is the root;
* a model whose meshes were built over a subset of the ranks (two models on
  disjoint halves of the world, each on its own ``DeviceMesh``) uses a group
  of exactly those ranks, and its lowest rank is the root: only those ranks
  call, and no collective waits for any other rank. A 1-D mesh over the
  subset lends its own group; otherwise one group per set of ranks is made
  once (by those ranks alone) and kept while the world lasts.

Meshes are compared by their root: a slice of a world mesh belongs to the
world, so pipeline stages of one ``pp x dp`` mesh stay one model.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _compat


@dataclass(frozen=True)
class Group:
    """A process group (None: the default group) and its global ranks, sorted
    (group rank i is ``ranks[i]``, as ``new_group`` orders them)."""

    pg: Any
    ranks: tuple[int, ...]

    @property
    def root(self) -> int:
        """The global rank that holds full state dicts and broadcasts them."""
        return self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def has_peers(self) -> bool:
        """Whether there is anyone to talk to (more than one rank)."""
        return self.size > 1

    @property
    def index(self) -> int:
        """This rank's position in the group."""
        return self.ranks.index(global_rank())

    @property
    def is_root(self) -> bool:
        return global_rank() == self.root


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_rank() -> int:
    return dist.get_rank() if initialized() else 0


def world() -> Group:
    """The default group: every rank of the world (one rank without a process group)."""
    return Group(None, tuple(range(dist.get_world_size() if initialized() else 1)))


def of_params(params: Iterable[Any]) -> Group:
    """The group of a model with ``params`` (see the module docstring)."""
    everyone = world()
    if not everyone.has_peers:
        return everyone
    # Tens of thousands of parameters share a handful of layouts: each mesh is
    # read off a distinct one (``device_mesh`` is a property, a call per tensor).
    params = list(params)
    dtensors = itertools.compress(params, map(isinstance, params, itertools.repeat(DTensor)))  # (asked in C)
    specs = list(map(_compat.layout_token, dtensors))
    layouts = dict(zip(map(id, specs), specs))
    roots: dict[int, Any] = {}
    for mesh in {id(s.mesh): s.mesh for s in layouts.values()}.values():
        root = _compat.root_mesh(mesh)
        roots.setdefault(id(root), root)
    ranks: set[int] = set()
    for mesh in roots.values():
        ranks.update(mesh.mesh.flatten().tolist())
    if not ranks or len(ranks) == everyone.size:
        return everyone
    members = tuple(sorted(ranks))
    for mesh in roots.values():
        if mesh.ndim == 1 and tuple(sorted(mesh.mesh.tolist())) == members:
            return Group(mesh.get_group(), members)
    return Group(_group_over(members), members)


class WorldCache:
    """A cache of what belongs to the current world: emptied when the default
    group changes (a process that re-forms its world must not keep, nor hand
    out, the old world's groups). ``weak``: it keeps no value alive."""

    def __init__(self, weak: bool = False):
        self._entries: dict = weakref.WeakValueDictionary() if weak else {}
        self._under: weakref.ref | None = None

    def current(self):
        """The entries made in the current world."""
        default = dist.group.WORLD
        if default is not None and (self._under is None or self._under() is not default):
            self._entries.clear()
            self._under = weakref.ref(default)
        return self._entries


# Groups made for sets of ranks that no 1-D mesh covers, in this world (not
# kept alive by this cache).
_made = WorldCache(weak=True)


def _group_over(ranks: tuple[int, ...]):
    made = _made.current()
    pg = made.get(ranks)
    if pg is None:
        # Only the members call: the other ranks may be busy elsewhere.
        pg = dist.new_group(list(ranks), use_local_synchronization=True)
        made[ranks] = pg
    return pg
