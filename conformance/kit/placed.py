"""Whether state is placed as its mode and layout say (OPT-STATE-1, and the
clauses that reuse its checks): what a get returns, distributed like its
parameter or full where the mode gathers, the same on every rank where it is
not a tensor; and what a set loads, laid out like its parameter."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _compat, nested, tensors
from ..judging.oracle import fail_if, layout_problems, snapshot
from ..modes import Mode
from ..world.saving import get_options, optimizers_arg


def check_loaded(s) -> None:
    """After set, state shaped like a parameter is laid out like it (nested state included)."""
    if s.layout.wrapper == "fsdp1":
        problems = _fsdp1_loaded(s)
    else:
        problems = layout_problems(snapshot(s)["state"], dict(s.named_parameters()), "state", local=True)
    fail_if(problems, "after set, state tensors are not laid out like their parameters")


def _fsdp1_loaded(s) -> list[str]:
    """FSDP1's optimizers step its flat shards (or, with its original
    parameters, their 1-D views of them): per-element state, nested included,
    is shaped like the tensor it steps, on its device."""
    fqn_of = s.fqn_of()
    problems = []
    for opt in s.optimizers:
        for p, entry in opt.state.items():
            for path, v in nested.leaves(dict(entry)):
                if not isinstance(v, torch.Tensor) or v.dim() == 0:
                    continue
                at = f"optimizer.state[{fqn_of.get(p, '?')!r}]{nested.where(path)}"
                if v.shape != p.shape:
                    problems.append(f"{at}: shape {tuple(v.shape)}, the flat shard it steps is {tuple(p.shape)}")
                elif v.device != p.device:
                    problems.append(f"{at}: on {v.device}, the flat shard on {p.device}")
    return problems


def check_get(c, s, mode: Mode) -> None:
    """Tensors shaped like the parameter are distributed like it (the
    parameter's placements, or full in the full modes); 0-d tensors and
    non-tensor values are the same on every rank that holds them."""
    osd = c.iut.get_optimizer_state_dict(s.model, optimizers_arg(s), options=get_options(c.iut, mode))
    gathered = s.gathered()  # FSDP1: state by original parameter (what a get returns), full
    if gathered is not None:
        params = gathered["params"]
        stateful = {fqn for fqn, entry in gathered["state"].items() if entry}
    else:
        params = dict(s.named_parameters())
        stateful = {fqn for fqn, entry in snapshot(s)["state"].items() if entry}
    held = by_param(osd, params)
    if mode.on_root:
        # The root holds every rank's state (pipeline stages too), the others nothing.
        everyone = {f for part in _everyone(s, sorted(stateful)) for f in part}
        stateful = everyone if s.is_root else set()
    problems = [f"get[{fqn!r}]: absent on rank {c.rank}, which should hold it" for fqn in sorted(stateful - set(held))]
    if mode.full:
        problems += _not_full(held, _shapes(s, params), cpu=mode.on_root)
        if mode.on_root and not s.is_root and held:
            problems.append(
                f"full_cpu on rank {c.rank}: {len(held)} state entries, expected none off the root (rank {s.root})"
            )
    elif gathered is not None:
        problems += _fsdp1_sharded(held, {fqn: tuple(p.shape) for fqn, p in params.items()})
    else:
        problems += layout_problems(held, params, "get", local=False)
    problems += _differ_across_ranks(s, held)
    fail_if(problems, f"{mode}: what get returns is not laid out as {c.clause} says")


def by_param(osd: dict, params: dict) -> dict:
    """The state a get returned, by FQN: nested as it is, or a flat dict's
    ``state.{fqn}...`` keys under their FQN (matched to the model's, longest first)."""
    if "state" in osd or not osd:
        return osd.get("state", {})
    out: dict = {}
    by_length = sorted(params, key=len, reverse=True)
    for key, value in osd.items():
        rest = key[len("state.") :] if isinstance(key, str) and key.startswith("state.") else None
        fqn = next((f for f in by_length if rest and rest.startswith(f) and rest[len(f) :][:1] in (".", "[")), None)
        if fqn is not None:
            out.setdefault(fqn, {})[rest[len(fqn) :]] = value
    return out


def _shapes(s, params: dict) -> dict:
    """Every parameter's shape by FQN, those of other pipeline stages included."""
    mine = {fqn: tuple(p.shape) for fqn, p in params.items()}
    return {k: v for part in _everyone(s, mine) for k, v in part.items()}


def _everyone(s, obj) -> list:
    """``obj`` of every rank of the setup's model."""
    if s.group_size == 1:
        return [obj]
    out = [None] * s.group_size
    dist.all_gather_object(out, obj, group=s.group)
    return out


def _not_full(held: dict, shapes: dict, cpu: bool) -> list[str]:
    problems = []
    for fqn, entry in held.items():
        shape = shapes.get(fqn)
        for path, v in nested.leaves(entry):
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            at = f"get[{fqn!r}]{nested.where(path)}"
            if tensors.is_distributed(v):
                problems.append(f"{at}: a {type(v).__name__}, expected a full tensor")
            elif tuple(v.shape) != shape:
                problems.append(f"{at}: shape {tuple(v.shape)}, expected the parameter's {shape}")
            elif cpu and v.device.type != "cpu":
                problems.append(f"{at}: on {v.device}, expected cpu")
    return problems


def _fsdp1_sharded(held: dict, shapes: dict) -> list[str]:
    """FSDP1's sharded state: per-element tensors (nested too) keep their
    original parameter's global shape, each rank holding a piece (a DTensor
    or torch's ShardedTensor; which one is the implementation's choice)."""
    problems = []
    for fqn, entry in held.items():
        for path, v in nested.leaves(entry):
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            at = f"get[{fqn!r}]{nested.where(path)}"
            if not tensors.is_distributed(v) and _compat.sharded_tensor_pieces(v) is None:
                problems.append(f"{at}: a plain {type(v).__name__}, expected one sharded like its parameter")
            elif tuple(tensors.global_shape(v)) != shapes.get(fqn):
                problems.append(
                    f"{at}: global shape {tuple(tensors.global_shape(v))}, its parameter's is {shapes.get(fqn)}"
                )
    return problems


def _scalars(held: dict) -> dict:
    """0-d tensors and non-tensor values, by where they are."""
    out = {}
    for fqn, entry in held.items():
        for path, v in nested.leaves(entry):
            at = f"[{fqn!r}]{nested.where(path)}"
            if tensors.is_distributed(v):
                continue
            if isinstance(v, torch.Tensor):
                if v.dim() == 0:
                    out[at] = ("0-d tensor", str(v.dtype), v.item())
            else:
                out[at] = v
    return out


def _differ_across_ranks(s, held: dict) -> list[str]:
    seen: dict = {}
    for r, part in zip(s.ranks, _everyone(s, _scalars(held))):
        for at, value in part.items():
            seen.setdefault(at, []).append((r, value))
    problems = []
    for at, values in seen.items():
        if any(v != values[0][1] for _, v in values[1:]):
            problems.append(f"get{at}: differs across ranks: " + ", ".join(f"rank {r}: {v!r}" for r, v in values))
    return problems
