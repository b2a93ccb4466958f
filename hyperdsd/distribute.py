"""Full and broadcast state dicts: which rank ends up with what.

``full_entries`` turns per-FQN entries holding DTensors into full tensors,
everywhere or only on rank 0 (``cpu_offload``). When ranks hold different
FQNs (pipeline stages), each FQN's lowest holder gathers it and rank 0
receives the rest, so rank 0 ends with everything.

``describe`` / ``deliver`` move rank 0's full tensors for a broadcast load:
every rank first sees a manifest (shapes, dtypes, and the non-tensor values)
to validate against, and only then receives its own pieces.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import _compat, collectives
from .gather import Gatherer
from .placement import DTensorLayout
from .plan import Prepared, TensorMeta
from .scatter import Need, scatter_from_rank0
from .tree import rebuild, where


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type == "cpu" else t.cpu()


def offload(value: Any) -> Any:
    """Sharded ``cpu_offload``: local pieces to CPU, DTensors stay DTensors."""

    def move(leaf: Any, _path: tuple) -> Any:
        if isinstance(leaf, DTensor):
            local = _compat.local_tensor(leaf)
            return leaf if local.device.type == "cpu" else DTensorLayout.of(leaf).wrap(local.cpu())
        return _to_cpu(leaf) if isinstance(leaf, torch.Tensor) else leaf

    return rebuild(value, move)


def full_entries(entries: dict[str, Any], *, rank0_only: bool, cpu: bool) -> tuple[dict[str, Any], dict[str, int] | None]:
    """Gather every DTensor in ``entries`` (values: tensors, or dicts of them).

    Returns the entries this rank keeps (all of them, or with ``rank0_only``
    those it is root of) and, when ranks hold different keys, the root of
    each key (None when every rank holds the same keys).
    """
    keys = list(entries)
    roots: dict[str, int] | None = None
    if rank0_only and collectives.active() and not collectives.same_everywhere(keys):
        roots = collectives.roots_of(keys)
    me = collectives.rank()

    def root_of(key: str) -> int | None:
        if not rank0_only:
            return None
        return roots[key] if roots is not None else 0

    gatherer = Gatherer(cpu=cpu)
    for key, value in entries.items():
        for sub, leaf in _tensor_leaves(value):
            if isinstance(leaf, DTensor):
                gatherer.add((key, sub), leaf, root=root_of(key))
    gathered = gatherer.run()
    kept: dict[str, Any] = {}
    for key, value in entries.items():
        root = root_of(key)
        if root is not None and root != me:
            continue
        kept[key] = _replace_leaves(value, lambda sub, leaf: gathered[(key, sub)] if isinstance(leaf, DTensor) else (_to_cpu(leaf) if cpu else leaf))
    return kept, roots


def _tensor_leaves(value: Any, sub: tuple = ()):
    if isinstance(value, torch.Tensor):
        yield sub, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensor_leaves(v, sub + (k,))


def _replace_leaves(value: Any, fn: Callable, sub: tuple = ()) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(sub, value)
    if isinstance(value, dict):
        return {k: _replace_leaves(v, fn, sub + (k,)) for k, v in value.items()}
    return value


# -- broadcast loads ---------------------------------------------------------

def describe(state_dict: Any) -> tuple[Any, list[torch.Tensor], list[str]]:
    """Rank 0's dict with each tensor replaced by a :class:`TensorMeta`."""
    fulls: list[torch.Tensor] = []
    problems: list[str] = []

    def meta(leaf: Any, path: tuple) -> Any:
        if isinstance(leaf, DTensor):
            problems.append(f"state_dict{where(path)}: a DTensor; broadcast_from_rank0 loads full tensors (get them with full_state_dict=True)")
            return None
        if isinstance(leaf, torch.Tensor):
            fulls.append(leaf)
            return TensorMeta(tuple(leaf.shape), leaf.dtype, len(fulls) - 1)
        return leaf

    return rebuild(state_dict, meta), fulls, problems


def needs_for(prepared: list[Prepared], metas: list[tuple]) -> tuple[list[Need | None], dict[int, list[Prepared]]]:
    """What this rank needs of each of rank 0's tensors, and who uses each."""
    needs: list[Need | None] = [None] * len(metas)
    users: dict[int, list[Prepared]] = {}
    for p in prepared:
        i = p.meta.index
        need = Need.of_layout(p.layout) if p.layout is not None and p.layout.simple else Need.whole(p.meta.shape)
        if needs[i] is not None and needs[i] != need:
            need = Need.whole(p.meta.shape)  # used twice with different regions: take it whole
        needs[i] = need
        users.setdefault(i, []).append(p)
    return needs, users


def deliver(needs: list[Need | None], users: dict[int, list[Prepared]], fulls: list[torch.Tensor] | None,
            metas: list[tuple], device: torch.device, everyone_needs: list | None = None) -> None:
    """Give each Prepared this rank's piece of rank 0's tensor, as it arrives.

    A piece goes straight into its destination (an existing tensor of the
    same layout) or becomes the new tensor itself, so a rank holds its own
    state plus one bucket in flight. ``metas`` lists (shape, dtype) of every
    tensor in rank 0's dict, in manifest order: the same on every rank, so is
    the bucket plan. ``needs``, ``users``: as :func:`needs_for` gives them.
    ``everyone_needs``: every rank's needs, when the caller has exchanged
    them already.
    """

    def receive(i: int, piece: torch.Tensor) -> None:
        whole = needs[i] == Need.whole(metas[i][0])
        for p in users[i]:
            mine = p.layout.local_from_full(piece) if p.layout is not None and whole else piece
            p.receive(mine)

    def target_for(i: int) -> torch.Tensor | None:
        """Where a large piece can be received in place: its one user's destination."""
        ps = users.get(i, [])
        if len(ps) != 1 or ps[0].dest is None:
            return None
        dest = ps[0].dest
        return _compat.local_tensor(dest) if isinstance(dest, DTensor) else dest

    scatter_from_rank0(metas, fulls, needs, device, on_piece=receive, target_for=target_for, everyone_needs=everyone_needs)


def manifest_metas(manifest: Any) -> list[tuple]:
    """(shape, dtype) of every TensorMeta in a manifest, by index."""
    found: dict[int, tuple] = {}

    def note(leaf: Any, _path: tuple) -> Any:
        if isinstance(leaf, TensorMeta):
            found[leaf.index] = (leaf.shape, leaf.dtype)
        return leaf

    rebuild(manifest, note)
    return [found[i] for i in range(len(found))]
