"""A full get of an FSDP1 model, gathered from its flat shards run by run.

A full get's twin (:class:`hyperdsd.fsdp1.twin.FSDP1Twin` with ``stream``) reads no
rows: its parameters and per-element optimizer state stand in hollow. The
gather (:func:`hyperdsd.transport.consolidate.full_entries`) takes them in
rounds, each a run of one unit's parameters of about one gather bucket's
share of a rank: every rank sends what its flat shards hold of them
straight to their place in the full tensors (one exchange over the unit's
group). Reading rows first moved the state twice, once to rows and once
to the root, and held a copy of a rank's whole state; now each element
moves once, from where FSDP1 keeps it, and a rank holds nothing of its own
state beyond what is in flight. Every rank makes the same rounds from the
units' shapes alone and takes them in the same order.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import _compat
from ..transport.collectives import BUCKET_BYTES, DIRECT_BYTES
from ..tree import is_container, rebuild
from . import full_moves
from . import unit_moves as moves
from .summaries import at_path
from .units import UnitLayout, shard_state


def _runs(u: UnitLayout, itemsize: int) -> list[list[int]]:
    """The unit's parameters in runs of about one gather bucket's share of a
    rank's bytes (``itemsize`` an element), at least one parameter each;
    :func:`_packed` then puts runs of several units in one round."""
    budget = max(BUCKET_BYTES // u.size, 1)
    runs: list[list[int]] = []
    size = 0
    for i, shape in enumerate(u.unit.shapes):
        nbytes = -(-math.prod(shape) // u.size) * itemsize
        if not runs or size + nbytes > budget:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += nbytes
    return runs


def _gathers(u: UnitLayout, root: int | None) -> bool:
    """Whether the unit's group gathers its parameters: with a root, only the
    group the root is in (other replicas of HYBRID_SHARD have nothing to do)."""
    return root is None or root in dist.get_process_group_ranks(u.unit.pg)


def _packed(runs: list[tuple], size_of) -> list[list[tuple]]:
    """Consecutive ``runs`` ((unit, run, ...), of any units) in rounds of about
    one gather bucket's share of a rank (``size_of(*item)`` bytes), at least
    one run each: a round's runs move in one exchange, not one per unit.
    Runs of a rank's 1 MiB or more are not packed."""
    rounds: list[list[tuple]] = []
    size = 0
    for item in runs:
        u = item[0]
        nbytes = size_of(*item)
        # (runs of large parameters keep a round each, as unpacked: their exchanges cost their bytes)
        if not rounds or size + nbytes > max(BUCKET_BYTES // u.size, 1) or max(size, nbytes) >= DIRECT_BYTES:
            rounds.append([])
            size = 0
        rounds[-1].append(item)
        size += nbytes
    return rounds


def _run_bytes(u: UnitLayout, run: list[int], itemsize: int) -> int:
    return sum(-(-math.prod(u.unit.shapes[i]) // u.size) for i in run) * itemsize


def model_rounds(twin) -> list | None:
    """The model's rounds: ``(keys, fill)``, ``fill(entries, root_of)`` giving
    the entries of those keys full (None on ranks that keep none of them);
    None when the twin's rows are read."""
    if not twin.stream_rows:
        return None
    runs = [(u, run) for u in twin.units for run in _runs(u, u.unit.local.dtype.itemsize)]
    rounds = []
    for pack in _packed(runs, lambda u, run: _run_bytes(u, run, u.unit.local.dtype.itemsize)):
        keys = [key for u, run in pack for key in _model_keys(u, run)]
        rounds.append((keys, partial(_model_values, pack)))
    return rounds


def _model_keys(u: UnitLayout, run: list[int]) -> list[str]:
    return [u.fqns[i] for i in run] + [fqn for fqn, i in u.aliases if i in run]


def _model_values(pack: list[tuple], entries: dict, root_of) -> dict:
    exchange = moves.Exchange(limit=math.inf)  # (a round is one bucket already)
    gathered = []
    for u, run in pack:
        keys = [key for key in _model_keys(u, run) if key in entries]
        if not keys:
            continue
        root = root_of(keys[0])  # (one unit's keys: the same ranks hold them, and the same root gathers them)
        full = full_moves.to_full(u, [u.unit.local], run, root, exchange)[0] if _gathers(u, root) else [None] * len(run)
        gathered.append((u, run, full))
    exchange.run()
    by_fqn = {}
    for u, run, full in gathered:
        full = dict(zip(run, full))
        by_fqn.update({u.fqns[i]: full[i] for i in run})
        # (a tied name is a tensor of its own, as a gather of each name gives it)
        by_fqn.update({fqn: full[i] if full[i] is None else full[i].clone() for fqn, i in u.aliases if i in run})
    return {key: by_fqn[key] for key in entries}


def optim_rounds(twin) -> list | None:
    """:func:`model_rounds` for the optimizers' state, keyed by the FQNs the
    twin optimizers give their parameters (units without per-element state
    on any rank have none)."""
    if not twin.stream_state:
        return None
    runs = []
    itemsize = {}
    for n, (u, twins) in enumerate(zip(twin.units, twin.params)):
        typed = twin.state_plans[n][1]
        if not typed:
            continue
        itemsize[n] = sum(dtype.itemsize for _, dtype in typed)
        runs += [(u, run, n) for run in _runs(u, itemsize[n])]
    rounds = []
    for pack in _packed(runs, lambda u, run, n: _run_bytes(u, run, itemsize[n])):
        keys = [twin.index.fqn_of(twin.params[n][i]) for _, run, n in pack for i in run]
        rounds.append((keys, partial(_state_values, twin, [(n, run) for _, run, n in pack])))
    return rounds


def _state_values(twin, pack: list[tuple], entries: dict, root_of) -> dict:
    exchange = moves.Exchange(limit=math.inf)  # (a round is one bucket already)
    by_unit = {}
    for n, run in pack:
        u, (targets, typed) = twin.units[n], twin.state_plans[n]
        keys = [key for key in (twin.index.fqn_of(twin.params[n][i]) for i in run) if key in entries]
        root = root_of(keys[0]) if keys else None  # (one unit's keys: the same ranks hold them, one root)
        if not keys or not _gathers(u, root):
            continue
        sources = [_state_source(u, targets, path, dtype) for path, dtype in typed]
        by_unit[n] = full_moves.to_full(u, sources, run, root, exchange), run
    exchange.run()
    # Hollow values are shared (see FSDP1Twin._hollow): each is found by its entry's FQN and its path.
    spots = {twin.index.fqn_of(twin.params[n][i]): (n, i) for n, run in pack for i in run}
    full_at = {  # unit -> path -> parameter -> its full tensor (None where this rank keeps none)
        n: {path: dict(zip(run, fulls[k])) for k, (path, _) in enumerate(twin.state_plans[n][1])}
        for n, (fulls, run) in by_unit.items()
    }
    hollow, me = twin.hollow_ids, dist.get_rank()
    copied: list[tuple[dict, str]] = []  # (an entry handed out, its key): the twin's tensor there, copied below

    def filled(entry: dict, n: int, i: int, kept: bool) -> dict:
        at = full_at.get(n)

        def full(value, path):
            if id(value) in hollow:
                return at[path][i] if at is not None else None
            return value.clone() if kept and isinstance(value, torch.Tensor) else value

        out = {}
        for key, v in entry.items():  # (most state is flat: a key's value read as it is, a container rebuilt)
            if id(v) in hollow:
                out[key] = at[(key,)][i] if at is not None else None
            elif is_container(v):
                out[key] = rebuild(v, full, (key,))
            else:
                out[key] = v
                if kept and isinstance(v, torch.Tensor):
                    copied.append((out, key))
        return out

    values: dict = {}
    for fqn, entry in entries.items():
        n, i = spots[fqn]
        # (the twin's other tensors are the optimizer's: copied where handed out)
        kept = entry is not None and root_of(fqn) in (None, me)
        # (another rank's key whose state is all gathered here: nothing of it is left to gather with the rest)
        if entry is None or (not kept and all(id(v) in hollow or not _gathered_later(v) for v in entry.values())):
            values[fqn] = None
        else:
            values[fqn] = filled(entry, n, i, kept)
    for (out, key), copy in zip(copied, _compat.clones([out[key] for out, key in copied])):  # (in one call)
        out[key] = copy
    return values


def _gathered_later(value) -> bool:
    """Whether a twin entry's value holds what the gather takes with the rest: a DTensor, or a container."""
    return isinstance(value, DTensor) or is_container(value)


def _state_source(u: UnitLayout, targets: list, path: tuple, dtype: torch.dtype):
    """This rank's flat shard of the state at ``path``: the flat parameter's
    own tensor, or each original parameter's, read where it lies (zeros
    where a parameter has none), assembled into one only for a unit of
    many small parameters."""
    device = u.unit.local.device
    if u.unit.params is None:
        _, p, opt = targets[0]
        value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
        return value if value is not None else torch.zeros(u.shard, dtype=dtype, device=device)
    if u.index_plan() is not None:  # (a unit of many small parameters: joined, to move as one piece)
        return shard_state(u, targets, path, dtype)
    base = u.index * u.shard

    def cut(i: int, a: int, b: int) -> torch.Tensor:
        _, p, opt = targets[i]
        value = at_path(opt.state.get(p) or {}, path) if opt is not None else None
        where = u.unit.in_shard[i]
        if value is None or where is None or not where[1]:
            return torch.zeros(b - a, dtype=dtype, device=device)
        at = a - base - where[0]
        return value.reshape(-1)[at : at + b - a].to(dtype)

    return full_moves.Pieces(cut, dtype, device)
