"""Collectives for small things, and the byte buckets that large ones use.

* :func:`agree` - every rank learns whether any rank found a problem, so all
  raise together instead of some waiting forever in a later collective.
* who holds what: :func:`same_everywhere`, :func:`roots_of`, and object
  exchanges (:func:`exchange`, :func:`send_to_root`, :func:`broadcast_object`).
* byte buckets: tensors packed at aligned offsets of one uint8 buffer, so
  that :mod:`hyperdsd.transport.gather` and :mod:`hyperdsd.transport.scatter` move many tensors per collective.

Each collective runs in a :class:`~hyperdsd.group.Group`: the world unless
the caller passes the model's group; "root" is that group's first rank.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .. import _compat
from ..errors import StateDictError
from .group import Group, global_rank, world

_ALIGN = 16
# Bucket size in bytes: one bucket is what a collective moves at once, and
# the most a rank holds beyond its own state while a transfer is in flight.
BUCKET_BYTES = int(float(os.environ.get("HYPERDSD_BUCKET_MB", "64")) * 2**20)
# Pieces at least this large, evenly split along dim 0, move on their own,
# straight between the shards and the full tensor: no packing, no copies.
DIRECT_BYTES = 1 << 20


def active(group: Group | None = None) -> bool:
    """Whether ``group`` (default: the world) has anyone else to talk to."""
    return (group or world()).has_peers


def rank() -> int:
    """This rank's global rank."""
    return global_rank()


# -- agreement -------------------------------------------------------------


def agree(
    problems: list[str],
    what: str,
    questions: dict[str, bool | None] | None = None,
    group: Group | None = None,
    confirm: set[str] | frozenset = frozenset(),
) -> dict[str, bool]:
    """Raise :class:`StateDictError` on every rank of ``group`` if any has problems.

    One all-reduce of two flags when all is well; messages travel only when
    something is wrong. ``questions`` (name -> this rank's answer, or None
    where it cannot tell) are answered by the other ranks in the same step:
    the answer is True if any rank answered True. Returns the answers to this
    rank's open questions, and to those in ``confirm`` (answered here, but
    only for this rank's part: every rank's answer counts). ``group``
    defaults to the world.
    """
    group = group or world()
    questions = questions or {}
    open_ = open_questions(questions, confirm)
    if not group.has_peers:
        if problems:
            raise StateDictError(_format(what, {global_rank(): problems}))
        return answer(open_, [{k: v for k, v in questions.items() if v is not None}])
    flags = torch.tensor([1 if problems else 0, 1 if open_ else 0], dtype=torch.int32)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group.pg)
    answers: dict[str, bool] = {}
    if flags[1]:
        known = exchange({k: v for k, v in questions.items() if v is not None}, group)
        answers = answer(open_, known)
    if flags[0]:
        raise_if_any(exchange(problems, group), what, group)
    return answers


def exchange(obj: Any, group: Group | None = None) -> list[Any]:
    """Every rank's ``obj``, on every rank of ``group``, by group rank (one all-gather of objects)."""
    group = group or world()
    if not group.has_peers:
        return [obj]
    everyone: list[Any] = [None] * group.size
    dist.all_gather_object(everyone, obj, group=group.pg)
    return everyone


def open_questions(questions: dict[str, bool | None], confirm=frozenset()) -> list[str]:
    """The questions other ranks answer: those this rank cannot tell, and those ``confirm`` names."""
    return [k for k, v in questions.items() if v is None or k in confirm]


def answer(open_questions, known_by_rank: list[dict[str, bool]]) -> dict[str, bool]:
    """True where any rank knows the answer is True; nobody knowing means nothing was there."""
    known: dict[str, bool] = {}
    for part in known_by_rank:
        for k, v in part.items():
            known[k] = known.get(k, False) or v
    return {k: known.get(k, True) for k in open_questions}


def raise_if_any(problems_by_rank: list[list[str]], what: str, group: Group | None = None) -> None:
    """Raise if any rank has problems; ``problems_by_rank`` is by rank of ``group`` (default: the world)."""
    if any(problems_by_rank):
        ranks = group.ranks if group is not None else range(len(problems_by_rank))
        raise StateDictError(_format(what, {ranks[i]: p for i, p in enumerate(problems_by_rank) if p}))


def _format(what: str, by_rank: dict[int, list[str]]) -> str:
    lines = [what]
    seen: dict[tuple, list[int]] = {}
    for r, problems in by_rank.items():
        seen.setdefault(tuple(problems), []).append(r)
    for problems, ranks in seen.items():
        who = "rank" if len(ranks) == 1 else "ranks"
        shown = list(problems[:20]) + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        lines.append(f"  on {who} {','.join(map(str, ranks))}:")
        lines += [f"    {p}" for p in shown]
    return "\n".join(lines)


# -- who holds what --------------------------------------------------------


def same_everywhere(keys: Sequence[str], group: Group | None = None) -> bool:
    """Whether every rank of ``group`` has the same keys (one small all-gather of digests)."""
    group = group or world()
    if not group.has_peers:
        return True
    digest = hashlib.sha1("\0".join(keys).encode()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    out = torch.empty(group.size * len(digest), dtype=torch.uint8)
    _compat.all_gather_into(out, mine, group=group.pg)
    return bool((out.view(group.size, -1) == mine).all())


def roots_of(keys: Sequence[str], group: Group | None = None) -> dict[str, int]:
    """For each key any rank of ``group`` holds, the lowest (global) rank that holds it."""
    group = group or world()
    roots: dict[str, int] = {}
    for i, ks in enumerate(exchange(list(keys), group)):
        for k in ks:
            roots.setdefault(k, group.ranks[i])
    return roots


def send_to_root(obj: Any, group: Group | None = None) -> list[Any] | None:
    """The root of ``group`` receives every rank's ``obj`` (None from those with nothing)."""
    group = group or world()
    if not group.has_peers:
        return [obj]
    out: list[Any] | None = [None] * group.size if group.is_root else None
    dist.gather_object(obj, out, dst=group.root, group=group.pg)
    return out


def broadcast_object(obj: Any, group: Group | None = None) -> Any:
    """The root's ``obj`` on every rank of ``group``."""
    group = group or world()
    if not group.has_peers:
        return obj
    box = [obj if group.is_root else None]
    dist.broadcast_object_list(box, src=group.root, group=group.pg)
    return box[0]


# -- byte buckets ----------------------------------------------------------


def aligned(n: int) -> int:
    """``n`` bytes rounded up to where the next piece of a bucket may start."""
    return -(-n // _ALIGN) * _ALIGN


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    elements = t.detach().contiguous().reshape(-1)
    if elements.stride(-1) != 1:
        # A placeholder of a never-stepped optimizer (one element, or none, expanded) counts as
        # contiguous, yet its stride of 0 cannot be viewed as bytes.
        elements = elements.clone(memory_format=torch.contiguous_format)
    return elements.view(torch.uint8) if elements.dtype != torch.uint8 else elements


def from_bytes(buf: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    if buf.numel() == 0:  # views of empty buffers may sit at unaligned offsets
        return torch.empty(shape, dtype=dtype, device=buf.device)
    return buf.view(dtype).reshape(shape)
