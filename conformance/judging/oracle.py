"""Oracles: what a setup holds, captured independently of the implementation
under test, and comparisons that say exactly what differs.

Comparison is bitwise unless a tolerance is given; a difference names the
FQN, the key, and what differs (presence, type, dtype, shape, placements,
device, values with the max abs error). State is named by canonical FQNs
(:func:`canonical`), the names the SPEC keys state dicts by.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from .. import _compat, nested, tensors
from . import packed
from .naming import describe, show

# Path segments that wrappers insert and canonical FQNs leave out.
WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


@functools.lru_cache(maxsize=65536)
def canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


class CheckFailure(AssertionError):
    """A clause does not hold; the message says where and how."""


def fail_if(differences: list[str], what: str) -> None:
    if differences:
        shown = differences[:12]
        more = f"\n  ... and {len(differences) - len(shown)} more" if len(differences) > len(shown) else ""
        raise CheckFailure(f"{what}:\n  " + "\n  ".join(shown) + more)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailure(message)


def clone_tree(obj: Any) -> Any:
    """A deep copy of a state dict's containers and tensors (distributed values stay distributed)."""
    return nested.rebuild(obj, lambda leaf, _path: tensors.copied(leaf) if isinstance(leaf, torch.Tensor) else leaf)


class FqnOf(dict):
    """Parameter -> canonical FQN. A tensor the model does not hold (one an
    implementation left in an optimizer's ``param_groups``, SPEC §4, 1.4)
    gets a name saying so, not a KeyError: the comparison that reads it
    then says what changed, under the case's own clause."""

    def __missing__(self, p) -> str:
        return f"<not a parameter of the model: {describe(p)}>" if isinstance(p, torch.Tensor) else f"<{p!r}>"


def snapshot(setup, copy: bool = True) -> dict:
    """Parameters, buffers, optimizer state and param groups of ``setup``, by FQN.
    ``copy=False``: the live tensors and values, for a comparison made at once
    (a many-key model's copy costs more than the comparison)."""
    own = clone_tree if copy else _as_is
    named = setup.named_parameters()
    fqn_of = FqnOf((p, n) for n, p in named)
    params = {fqn: own(p) for fqn, p in named}
    state: dict[str, dict] = {}
    groups = []
    for opt in setup.optimizers:
        for group in opt.param_groups:
            groups.append(
                {
                    **{k: own(v) for k, v in group.items() if k != "params"},
                    "params": [fqn_of[p] for p in group["params"]],
                }
            )
            for p in group["params"]:
                entry = opt.state.get(p)
                if entry:  # an empty entry is the same as none
                    state[fqn_of[p]] = own(held_entry(entry, p))
    return {"params": params, "state": state, "groups": groups}


def held_entry(entry, param) -> dict:
    """An optimizer's state entry for ``param`` as the suite reads it: each
    tensor as the implementation's stack says its optimizers hold them
    (``TensorProtocol.held``: plain local shards read as distributed like
    their parameter, where a stack keeps them so)."""
    protocol = tensors.current()
    if type(protocol).held is tensors.TensorProtocol.held:  # read as held: no walk
        return dict(entry)
    return nested.rebuild(dict(entry), lambda v, _path: protocol.held(v, param) if isinstance(v, torch.Tensor) else v)


def _as_is(obj: Any) -> Any:
    return obj


# Tensor types compared as they are (any other, not distributed, may be a
# ShardedTensor, compared by its shards).
_ORDINARY = frozenset({torch.Tensor, torch.nn.Parameter})


def describe_tensor_difference(
    expected: torch.Tensor, actual: Any, where: str, rtol: float = 0.0, atol: float = 0.0
) -> str | None:
    """What differs between two tensors, or None. With ``rtol``, values may
    differ by it, relative to each value and to the tensor's largest, and by
    ``atol`` (absolute)."""
    if not isinstance(actual, torch.Tensor):
        return f"{where}: expected a tensor, got {type(actual).__name__}"
    distributed = tensors.is_distributed(expected), tensors.is_distributed(actual)
    ordinary = any(distributed) or (type(expected) in _ORDINARY and type(actual) in _ORDINARY)
    pieces = (
        (None, None) if ordinary else (_compat.sharded_tensor_pieces(expected), _compat.sharded_tensor_pieces(actual))
    )
    if pieces != (None, None):  # a ShardedTensor (torch's FSDP1): its global size and local shards
        if None in pieces:
            return f"{where}: expected {type(expected).__name__}, got {type(actual).__name__}"
        if tuple(expected.size()) != tuple(actual.size()):
            return f"{where}: global shape {tuple(actual.size())}, expected {tuple(expected.size())}"
        if [o for o, _ in pieces[0]] != [o for o, _ in pieces[1]]:
            return f"{where}: local shards at {[o for o, _ in pieces[1]]}, expected {[o for o, _ in pieces[0]]}"
        for (offsets, e), (_, a) in zip(*pieces):
            d = describe_tensor_difference(e, a, f"{where}.shard{list(offsets)}", rtol, atol)
            if d:
                return d
        return None
    if distributed[0] != distributed[1]:
        return f"{where}: expected {type(expected).__name__}, got {type(actual).__name__}"
    if distributed[0]:
        d = _layout_difference(expected, actual, where)
        if d:
            return d
        expected, actual = tensors.local(expected), tensors.local(actual)
    if expected.dtype != actual.dtype:
        return f"{where}: dtype {actual.dtype}, expected {expected.dtype}"
    if expected.shape != actual.shape:
        return f"{where}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if expected.device != actual.device:
        return f"{where}: device {actual.device}, expected {expected.device}"
    if expected.numel() == 0:
        return None
    if rtol == 0.0:
        if torch.equal(expected, actual):
            return None
    else:
        scale = expected.abs().max().item()
        atol = max(rtol * scale, atol, 1e-30)
        if torch.allclose(actual.double(), expected.double(), rtol=rtol, atol=atol, equal_nan=True):
            return None
    err = (actual.double() - expected.double()).abs()
    idx = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape)) if err.dim() else ()
    tol = "bitwise" if rtol == 0.0 else f"rtol {rtol:g}, atol {atol:.3g}"
    return f"{where}: values differ ({tol}): max abs error {err.max().item():.3e} at index {idx}"


def _layout_difference(expected, actual, where: str) -> str | None:
    """How two distributed values are laid out differently (SPEC 1.6: by global
    shape, placements and mesh, whatever their class), or None."""
    if tensors.placements(expected) != tensors.placements(actual):
        return f"{where}: placements {tensors.placements(actual)}, expected {tensors.placements(expected)}"
    if tensors.mesh(expected) != tensors.mesh(actual):
        return f"{where}: mesh {tensors.mesh(actual)}, expected {tensors.mesh(expected)}"
    if tensors.global_shape(expected) != tensors.global_shape(actual):
        return (
            f"{where}: global shape {tuple(tensors.global_shape(actual))}, "
            f"expected {tuple(tensors.global_shape(expected))}"
        )
    return None


def diff_values(
    expected: Any, actual: Any, where: str, rtol: float = 0.0, atol: float = 0.0, atol_of: dict | None = None
) -> list[str]:
    """Every difference, by path. ``atol_of``: the absolute tolerance of
    the values under each dict key it names (a state key's scale)."""
    if isinstance(expected, torch.Tensor):
        d = describe_tensor_difference(expected, actual, where, rtol, atol)
        return [d] if d else []
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{where}: expected a dict, got {type(actual).__name__}"]
        out = [f"{where}[{show(k)}]: absent, expected present" for k in expected if k not in actual]
        out += [f"{where}[{show(k)}]: present, expected absent" for k in actual if k not in expected]
        for k in expected:
            if k in actual:
                sub = atol_of.get(k, atol) if atol_of else atol
                out += diff_values(expected[k], actual[k], f"{where}[{show(k)}]", rtol, sub, atol_of)
        return out
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)):
            return [f"{where}: {show(actual)}, expected {show(expected)}"]
        out = []
        if len(actual) != len(expected):
            out.append(f"{where}: {len(actual)} items, expected {len(expected)}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            out += diff_values(e, a, f"{where}[{i}]", rtol, atol, atol_of)
        n = len(expected)
        out += [f"{where}[{i}]: present, expected absent: {show(a)}" for i, a in enumerate(actual[n:], n)]
        out += [f"{where}[{i}]: absent, expected {show(e)}" for i, e in enumerate(expected[len(actual) :], len(actual))]
        return out
    if type(expected) is not type(actual) and not (
        isinstance(expected, (int, float)) and isinstance(actual, (int, float))
    ):
        return [
            f"{where}: type {type(actual).__name__} ({show(actual)}), expected {type(expected).__name__} "
            f"({show(expected)})"
        ]
    if expected != actual:
        return [f"{where}: {show(actual)}, expected {show(expected)}"]
    return []


def without_empty_groups(snap: dict) -> dict:
    """A snapshot whose groups without parameters keep only their place: where
    a mode cannot carry them, the target's own values stand (OPT-EMPTY-2)."""
    return {**snap, "groups": [g if g["params"] else {"params": []} for g in snap["groups"]]}


def diff_snapshots(expected: dict, actual: dict, rtol: float = 0.0, parts=("params", "state", "groups")) -> list[str]:
    out: list[str] = []
    for part in parts:
        out += diff_values(expected[part], actual[part], part, rtol)
    return out


def full_snapshot(setup) -> dict:
    """Like :func:`snapshot`, with every distributed value gathered into a full tensor.

    Used across layouts (resharding), where local shards cannot be compared.
    Collective: every rank of the setup's model must call it.
    """

    gathered = setup.gathered()  # a layout without distributed parameters gathers its own way (FSDP1)
    if gathered is not None:
        return gathered
    snap = snapshot(setup)
    whole = gather_distributed({"params": snap["params"], "state": snap["state"]}, setup.group)
    return {**whole, "groups": snap["groups"]}


def gather_distributed(tree: dict, group=None) -> dict:
    """``tree`` with every distributed value replaced by its full tensor, on
    every rank of ``group`` (None: the world; each must call it, with its own tree).

    One object exchange for all of them, not a collective each (a model of
    thousands of parameters, SPEC SCALE): each rank sends the blocks of the
    global tensors its values hold locally and where each starts, and
    assembles its own values' full tensors from everyone's. A value whose
    local part is not one block of the global one gathers itself
    (``TensorProtocol.full``), in the same order on every rank of its mesh."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = {}
    for path, leaf in nested.leaves(tree):
        if tensors.is_distributed(leaf):
            start = tensors.block_start(leaf, rank)
            if start is not None:
                mine[path] = (start, tensors.local(leaf))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        # The local tensors in one buffer (a pickle each would cost more than the rest).
        sent = {
            "paths": list(mine),
            "starts": [s for s, _ in mine.values()],
            **packed.blob([t for _, t in mine.values()]),
        }
        received = [None] * dist.get_world_size(group)
        dist.all_gather_object(received, sent, group=group)
        everyone = [dict(zip(part["paths"], zip(part["starts"], packed.unblob(part)))) for part in received]

    def full(leaf, path):
        if not tensors.is_distributed(leaf):
            return leaf
        if path not in mine:
            return tensors.full(leaf)
        out = torch.empty(tensors.global_shape(leaf), dtype=leaf.dtype)
        for part in everyone:
            start, local = part.get(path, (None, None))
            if start is not None:
                out[tuple(slice(at, at + n) for at, n in zip(start, local.shape))] = local
        return out.to(tensors.local(leaf).device)

    return nested.rebuild(tree, full)


def layout_problems(state: dict, params: dict, where: str, *, local: bool) -> list[str]:
    """Where state tensors shaped like a distributed parameter (nested ones
    included) are not laid out like it: a distributed value of the
    parameter's global shape, mesh and placements, and with ``local``, its
    local shape and device. 0-d tensors (``step``) may be anything."""
    problems = []
    noun = tensors.current().name
    for fqn, entry in state.items():
        p = params.get(fqn)
        if not tensors.is_distributed(p):
            continue
        for path, v in nested.leaves(entry):
            if not isinstance(v, torch.Tensor) or v.dim() == 0:
                continue
            at = f"{where}[{fqn!r}]{nested.where(path)}"
            if not tensors.is_distributed(v):
                problems.append(f"{at}: a {type(v).__name__}, expected a {noun} like its parameter")
                continue
            if tensors.global_shape(v) != tensors.global_shape(p):
                problems.append(
                    f"{at}: global shape {tuple(tensors.global_shape(v))}, "
                    f"the parameter's is {tuple(tensors.global_shape(p))}"
                )
            if tensors.mesh(v) != tensors.mesh(p):
                problems.append(f"{at}: mesh {tensors.mesh(v)}, the parameter's is {tensors.mesh(p)}")
            if tensors.placements(v) != tensors.placements(p):
                problems.append(
                    f"{at}: placements {tensors.placements(v)}, the parameter's are {tensors.placements(p)}"
                )
            mine, theirs = tensors.local(v), tensors.local(p)
            if local and mine.shape != theirs.shape:
                problems.append(f"{at}: local shape {tuple(mine.shape)}, the parameter's is {tuple(theirs.shape)}")
            if local and mine.device != theirs.device:
                problems.append(f"{at}: on {mine.device}, the parameter on {theirs.device}")
    return problems


def optimizer_view(setup) -> dict:
    """What an optimizer holds, for checking that nothing changed: state and groups."""
    snap = snapshot(setup)
    return {"state": snap["state"], "groups": snap["groups"], "params": snap["params"]}


def grads_view(setup) -> dict:
    return {fqn: (None if p.grad is None else tensors.copied(p.grad)) for fqn, p in setup.named_parameters()}


def expect_unchanged(before: dict, after: dict, what: str) -> None:
    fail_if(diff_values(before, after, "optimizer"), what)


def expect_error(fn, *, names: list[str] = (), what: str = "") -> BaseException:
    """Call ``fn``; the implementation must raise, and the message must name each of ``names``.

    A pass is the implementation's own (SPEC §4): the error must leave a call
    into it (``conformance.adapters.iut_call``). An adapter's refusal
    (``Unsupported``, ``NotImplementedError``) makes the case not applicable;
    any other error raised outside the implementation is no pass either.
    """
    from hyperdsd.testing import NotApplicable, region_of

    from ..adapters import raised_by_iut

    try:
        fn()
    except (CheckFailure, NotApplicable):
        raise
    # DCP raises CheckpointException (a BaseException) on every rank, carrying
    # each failing rank's error in its message.
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - any error type is acceptable, silence is not
        if isinstance(exc, NotImplementedError) and not raised_by_iut(exc):
            raise NotApplicable(f"{what}: the adapter refused ({exc})") from None
        if not raised_by_iut(exc):
            if not region_of(exc):
                raise  # the suite's own code: an error, never a verdict
            raise CheckFailure(
                f"{what}: {type(exc).__name__} was raised outside the implementation's own call (by its "
                f"adapter, not inside conformance.adapters.iut_call), which is no pass (SPEC §4): "
                f"{str(exc)[:400]}"
            ) from None
        text = str(exc)
        missing = [n for n in names if n not in text]
        if missing:
            raise CheckFailure(
                f"{what}: raised {type(exc).__name__}, but the message does not name {missing}: {text[:600]}"
            ) from None
        return exc
    raise CheckFailure(f"{what}: no error was raised")
