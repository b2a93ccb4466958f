"""FSDP1 (``FullyShardedDataParallel``) in hyperdsd's canonical layout, on one rank.

FSDP1 flattens the parameters of each unit into one FlatParameter and shards
that: a rank holds one contiguous run of the unit's concatenated, padded
parameters, which may begin and end mid-row. hyperdsd's canonical sharded
layout is FSDP2's: each parameter a DTensor sharded by rows, ``Shard(0)``
over the unit's group (``Replicate, Shard(0)`` for HYBRID_SHARD on a 2-D
mesh). A *twin* holds an FSDP1 model and its optimizers in that layout: a
plain module tree of DTensor parameters under canonical FQNs (the model's
own buffers and unmanaged parameters registered as they are), and
optimizers of the same class whose groups and state are the twin's. Every
get, set and check of hyperdsd then runs on the twin unchanged, and a set
writes what it loaded back into the flat shards.

Here: the geometry of one unit (:class:`UnitLayout`: which elements each
rank holds in either layout) and the twin's rows and optimizers, made from
pieces that :mod:`hyperdsd.fsdp1.unit_moves` moved (the twin's module tree:
:mod:`hyperdsd.fsdp1.twin_tree`). No collectives.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from .. import _compat
from ..placement import DTensorLayout, _contiguous_stride
from ..transport.group import WorldCache
from .summaries import at_path
from .unit_geometry import Geometry, IndexPlan, geometry, index_plan

# Row layouts by (mesh, global shape), in this world (a layout holds its mesh).
_layouts = WorldCache()


def _row_layout(mesh, shape: torch.Size) -> DTensorLayout:
    """A parameter's canonical layout: sharded by rows on the mesh's last dim (a 0-d one replicated)."""
    placements = [Replicate()] * mesh.ndim
    if len(shape):
        placements[-1] = Shard(0)
    return DTensorLayout(mesh, tuple(placements), shape, _contiguous_stride(shape))


@dataclass
class UnitLayout:
    """One FSDP1 unit: its flat shards and its parameters' rows.

    Positions are element offsets into the unit's padded unsharded flat
    parameter; shard rank ``r`` holds ``[r * shard, (r + 1) * shard)``, and in
    the canonical layout rows ``chunk_bounds(shape[0], size, r)`` of each
    parameter (all of a 0-d one, replicated).
    """

    unit: _compat.Fsdp1Unit
    fqns: list[str]  # canonical FQN of each original parameter
    aliases: list[tuple[str, int]]  # canonical FQN of each tied name, and the parameter it ties
    mesh: Any
    size: int  # ranks the flat parameter is sharded over
    index: int  # this rank's place among them
    layouts: list[DTensorLayout] = field(default_factory=list)
    _specs: dict = field(default_factory=dict, repr=False)  # by dtype: each parameter's DTensor spec

    def __post_init__(self):
        # One layout per mesh and shape, kept from call to call: the parameters of
        # a shape, in every unit, share it and the specs it keeps (as FSDP2's do).
        made = _layouts.current()
        for shape in self.unit.shapes:
            hit = made.get((id(self.mesh), shape))
            if hit is None or hit[0] is not self.mesh:
                hit = made[(id(self.mesh), shape)] = (self.mesh, _row_layout(self.mesh, shape))
            self.layouts.append(hit[1])

    def specs(self, dtype: torch.dtype) -> list:
        """Each parameter's DTensor spec for rows of ``dtype`` (listed once a unit and dtype)."""
        hit = self._specs.get(dtype)
        if hit is None:
            hit = self._specs[dtype] = [layout.spec(dtype) for layout in self.layouts]
        return hit

    @functools.cached_property
    def shard(self) -> int:
        """Elements of each rank's flat shard, padding included."""
        return self.unit.local.numel()

    @functools.cached_property
    def unpadded(self) -> int:
        """Elements of this rank's flat shard that belong to a parameter (the rest pads the last shards)."""
        total = max((off + math.prod(shape) for off, shape in zip(self.unit.offsets, self.unit.shapes)), default=0)
        return max(0, min(self.shard, total - self.index * self.shard))

    @functools.cached_property
    def own_spans(self) -> dict[int, tuple[int, int]]:
        """``i -> (start, stop)``: the flat positions of parameter ``i`` this rank's flat shard holds (if any)."""
        base = self.index * self.shard  # (FSDP1's own account of its shard, as :attr:`here`)
        return {i: (base + start, base + start + numel) for i, start, numel in self.here}

    @functools.cached_property
    def here(self) -> tuple[tuple[int, int, int], ...]:
        """``(i, start, numel)`` of each parameter with elements in this rank's
        flat shard, by position, as FSDP1 accounts for them. Under
        use_orig_params=True these are the parameters this rank steps, whose
        state it holds: at many small parameters, a few of the unit's."""
        spans = [(i, w[0], w[1]) for i, w in enumerate(self.unit.in_shard) if w is not None and w[1]]
        return tuple(sorted(spans, key=lambda span: span[1]))

    @functools.cached_property
    def _geometry(self) -> Geometry:
        return geometry(tuple(map(tuple, self.unit.shapes)), tuple(self.unit.offsets), self.shard, self.size)

    def starts(self, rank: int) -> tuple[int, ...]:
        """Where each parameter's rows on shard rank ``rank`` start, as positions in the flat parameter."""
        return self._geometry.starts[rank]

    def local_shape(self, i: int) -> tuple[int, ...]:
        return self._geometry.shapes[self.index][i]

    def index_plan(self) -> IndexPlan | None:
        """This rank's moves between its flat shard and its rows as index
        tensors, where the unit's pieces are many and small (None: moved
        piece by piece); see :func:`hyperdsd.fsdp1.unit_geometry.index_plan`."""
        return index_plan(self._geometry, self.index)

    def requires_grad(self) -> list[bool]:
        """Whether each parameter requires grad: its own (use_orig_params=True), else the flat parameter's."""
        if self.unit.params is not None:
            return [p.requires_grad for p in self.unit.params]
        return [self.unit.flat_param.requires_grad] * len(self.fqns)

    def local_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of this rank's rows of each parameter."""
        return self._geometry.shapes[self.index]

    def pieces(self, holder: int, owner: int) -> tuple[tuple[int, int, int], ...]:
        """``(i, start, stop)``: what shard rank ``holder``'s flat shard holds of
        the rows of shard rank ``owner``, parameter by parameter, in order."""
        return self._geometry.pieces[holder][owner]

    def held(self, holder: int, run: list[int]) -> list[tuple[int, int, int]]:
        """``(i, start, stop)``: what shard rank ``holder``'s flat shard holds of
        each of the parameters ``run``, in order."""
        spans = ((i, self.unit.offsets[i], self.unit.offsets[i] + math.prod(self.unit.shapes[i])) for i in run)
        return self._within(holder, spans)

    def _within(self, holder: int, spans) -> list[tuple[int, int, int]]:
        """The parts of flat ``spans`` ``(i, start, stop)`` that shard rank ``holder``'s flat shard holds."""
        lo, hi = holder * self.shard, (holder + 1) * self.shard
        return [(i, max(a, lo), min(b, hi)) for i, a, b in spans if max(a, lo) < min(b, hi)]


def canonical_names(index, raw_prefix: str, unit: _compat.Fsdp1Unit) -> tuple[list[str], list[tuple[str, int]]]:
    """Canonical FQNs of a unit's parameters and of its tied names; ``raw_prefix``
    is the FSDP1 module's own raw path (ending in a dot, or empty). Kept
    with a kept index (its modules as they were: the same names)."""
    kept = index.kept_for_wrapper
    key = ("fsdp1-names", raw_prefix, unit.names, unit.shared)
    hit = kept.get(key) if kept is not None else None
    if hit is None:
        base = f"{raw_prefix}{_compat.FSDP1_WRAPPED}."
        fqns = [index.canonical_key(base + name) for name in unit.names]
        aliases = [(index.canonical_key(base + name), i) for name, i in unit.shared]
        hit = (fqns, aliases)
        if kept is not None:
            kept[key] = hit
    return list(hit[0]), list(hit[1])


# -- the twin's rows -----------------------------------------------------------


def blank_rows(asked: list[tuple[UnitLayout, torch.dtype]], hollow: bool) -> list[list[torch.Tensor]]:
    """For each ``(unit, dtype)`` asked, rows of each of the unit's parameters
    not read now: ``hollow``, stand-ins of one element's memory (a full get's,
    which gathers from the flat shards instead, and the parameters' of a load
    of optimizer state alone, which reads none), else empty, to be filled (a
    load's): views of one tensor per shape for all of them, cut by one
    ``unbind`` each, since a load's twin rows are its own and never returned."""
    if hollow:
        kept: dict[tuple, torch.Tensor] = {}
        return [[stand_in(kept, dtype, u.unit.local.device, shape) for shape in u.local_shapes()] for u, dtype in asked]
    out: list = [None] * len(asked)
    by_kind: dict[tuple, list[int]] = defaultdict(list)  # (local shapes, dtype, device) -> the asks of it
    for n, (u, dtype) in enumerate(asked):
        by_kind[(u.local_shapes(), dtype, u.unit.local.device)].append(n)
    for (shapes, dtype, device), asks in by_kind.items():
        at: dict[tuple, list[int]] = defaultdict(list)  # each shape's parameters
        for i, shape in enumerate(shapes):
            at[shape].append(i)
        rows = [[None] * len(shapes) for _ in asks]
        for shape, ids in at.items():
            pieces = torch.empty((len(asks) * len(ids), *shape), dtype=dtype, device=device).unbind(0)
            for r, row in enumerate(rows):
                for c, i in enumerate(ids, r * len(ids)):
                    row[i] = pieces[c]
        for n, row in zip(asks, rows):
            out[n] = row
    return out


def stand_in(kept: dict, dtype: torch.dtype, device, shape: tuple) -> torch.Tensor:
    """A stand-in of one element's memory, expanded to ``shape``, one per kind
    in ``kept``: a twin's value that nothing reads or writes (a full get
    gathers from the flat shards, a broadcast load lands in them)."""
    key = (dtype, device, tuple(shape))
    hit = kept.get(key)
    if hit is None:
        hit = kept[key] = torch.zeros((), dtype=dtype, device=device).expand(shape)
    return hit


# -- the twin optimizers -------------------------------------------------------


def twin_optimizer(opt: torch.optim.Optimizer, expand: dict[int, list], names: dict[int, str]) -> torch.optim.Optimizer:
    """An optimizer of ``opt``'s class whose groups hold the twin's
    parameters (``expand``: id of each of ``opt``'s parameters -> its twins,
    ``names``: id of a twin -> its FQN), with the same fields and empty
    state. ``opt`` is not changed; its hooks are shared."""
    twin = object.__new__(type(opt))
    vars(twin).update(vars(opt))
    groups = []
    for group in opt.param_groups:
        params = [t for p in group["params"] for t in expand.get(id(p), (p,))]
        mine = {**group, "params": params}
        if "param_names" in group:
            mine["param_names"] = [names.get(id(t), n) for t, n in zip(params, _param_names(group, params))]
        groups.append(mine)
    twin.param_groups = groups
    twin.state = defaultdict(dict)
    return twin


def _param_names(group: dict, params: list) -> list[str]:
    names = list(group.get("param_names") or [])
    return names if len(names) == len(params) else [""] * len(params)


def shard_state(u: UnitLayout, targets: list, path: tuple, dtype) -> torch.Tensor:
    """This rank's flat shard of the state at ``path``: the flat parameter's own, or
    assembled from the original parameters' pieces (zeros where none)."""
    device = u.unit.local.device
    if u.unit.params is None:
        _, p, opt = targets[0]
        value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
        return value if value is not None else torch.zeros(u.shard, dtype=dtype, device=device)
    # The pieces in order, zeros between and after them: one concatenation.
    pieces, at, zeros = [], 0, torch.zeros(u.shard, dtype=dtype, device=device)
    key = path[0] if len(path) == 1 else None
    for j, start, numel in u.here:
        _, p, opt = targets[j]
        entry = opt.state.get(p) if opt is not None else None
        value = (entry.get(key) if key is not None else at_path(entry, path)) if entry else None
        if value is not None and value.numel() != numel:  # (a value that does not fit: refused there)
            return _shard_by_piece(u, targets, path, zeros)
        pieces += [zeros[: start - at]] if start > at else []
        pieces.append(zeros[:numel] if value is None else value)
        at = start + numel
    if not pieces:
        return zeros
    joined = _compat.joined_flat(pieces + [zeros[: u.shard - at]])  # (flattened in the call)
    return joined if joined.dtype == dtype else joined.to(dtype)


def _shard_by_piece(u: UnitLayout, targets: list, path: tuple, shard: torch.Tensor) -> torch.Tensor:
    """:func:`shard_state` of original parameters, a piece at a time into ``shard`` (zeros)."""
    for j, p, opt in targets:
        value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
        where = u.unit.in_shard[j]
        if value is not None and where is not None and where[1]:
            shard[where[0] : where[0] + where[1]] = value.reshape(-1)
    return shard
