"""What the implementation under test returned, judged as input (SPEC §4, 1.3).

A case reads and edits what the IUT's functions return. When that output is
not what torch's signatures promise (a prefix on its keys, keys missing or
added, ``None``, a list, a tensor where a dict belongs, an optimizer state
dict without ``param_groups``), the suite's own code may stumble on it. Such
a stumble is the IUT's deviation, never the suite's ``error``.

So the suite records, on each rank, a summary of every result of a get or a
set as it arrives (:class:`Received`), and when the case's own code raises
outside any IUT call, asks what in those results broke the promise
(:meth:`Received.surprises`). A surprise turns the error into a failure
naming what came back; a case that stumbles on well-formed output stays an
``error``: that is the suite's defect. Keys are compared only on this path,
so a case that copes with a surprise judges it under its own clause.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import _compat
from .naming import show
from .oracle import canonical

__all__ = ["Received", "RECEIVES"]

# The IUT functions whose results the suite reads, and what each returns
# (torch's signatures).
RECEIVES = {
    "get_model_state_dict": "model",
    "get_optimizer_state_dict": "optim",
    "get_state_dict": "both",
    "set_model_state_dict": "keys",
    "set_state_dict": "keys",
}
_SHOWN = 3

# What a flat optimizer dict is noted as (its keys in place of state and groups).
_FLAT_KEYS = "flat keys"


def _type(obj: Any) -> str:
    return "None" if obj is None else type(obj).__name__


def _some(names) -> str:
    """A few of ``names`` (keys the IUT returned: tensors among them are named, not printed)."""
    names = list(names)
    if all(isinstance(n, str) for n in names):
        names.sort()
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(show(n) for n in names[:_SHOWN]) + more


@dataclass
class _Result:
    """One result, summarised when it arrived (the case may edit it later)."""

    fn: str
    model: Any
    optimizers: Any
    options: Any
    kwargs_keys: frozenset
    problems: list  # what is wrong in its form alone
    model_keys: frozenset | None = None  # a model state dict's keys
    optim: tuple | None = None  # (state FQNs, group FQNs) or ("flat", keys)


class Received:
    """Every result of a get or a set on this rank, in one phase of one case."""

    def __init__(self) -> None:
        self._results: list[_Result] = []
        self._changes: list[str] = []  # what calls did to the objects they were handed (1.4)

    def note_changes(self, fn: str, lines: list[str]) -> None:
        if lines:
            self._changes.append(f"{fn} changed the objects it was handed: " + "; ".join(lines))

    def changes(self) -> list[str]:
        return list(self._changes)

    def note(self, fn: str, args: tuple, kwargs: dict, result: Any) -> None:
        kind = RECEIVES.get(fn)
        if kind is None:
            return
        model = args[0] if args else kwargs.get("model")
        optimizers = args[1] if len(args) > 1 else kwargs.get("optimizers")
        given = frozenset(k for k, v in kwargs.items() if v is not None)
        r = _Result(fn, model, optimizers, kwargs.get("options"), given, [])
        self._results.append(r)
        try:
            self._summarise(r, kind, result)
        except Exception as exc:  # noqa: BLE001 - an odd result may fail even to be read
            r.problems.append(f"returned {_type(result)}, which could not be read ({type(exc).__name__}: {exc})")

    def _summarise(self, r: _Result, kind: str, result: Any) -> None:
        if _gathered_elsewhere(r, result):
            return
        if kind == "both":
            if not isinstance(result, (tuple, list)) or len(result) != 2:
                r.problems.append(f"returned {_type(result)}, not a (model state dict, optimizer state dict) pair")
            else:
                self._model(r, result[0], "its model state dict")
                self._optim(r, result[1], "its optimizer state dict")
        elif kind == "model":
            self._model(r, result, "it")
        elif kind == "optim":
            self._optim(r, result, "it")
        elif not all(hasattr(result, a) for a in ("missing_keys", "unexpected_keys")):
            r.problems.append(f"returned {_type(result)}, not the missing_keys and unexpected_keys of the load")

    @staticmethod
    def _model(r: _Result, sd: Any, what: str) -> None:
        if not isinstance(sd, Mapping):
            r.problems.append(f"{what} is {_type(sd)}, not a dict of FQN to value")
            return
        odd = [k for k in sd if not isinstance(k, str)]
        if odd:
            r.problems.append(f"{what} has keys that are not FQN strings: {_some(odd)}")
        r.model_keys = frozenset(k for k in sd if isinstance(k, str))

    @staticmethod
    def _optim(r: _Result, sd: Any, what: str) -> None:
        if not isinstance(sd, Mapping):
            r.problems.append(f"{what} is {_type(sd)}, not a dict with 'state' and 'param_groups'")
            return
        if "state" not in sd and "param_groups" not in sd:
            keys = [k for k in sd if isinstance(k, str)]
            bad = [k for k in sd if not isinstance(k, str) or not k.startswith(("state.", "param_groups."))]
            if bad or not keys:
                r.problems.append(
                    f"{what} has neither 'state' nor 'param_groups'"
                    + (f", and keys outside a flat layout: {_some(bad)}" if bad else " (it is empty)")
                )
                return
            r.optim = (_FLAT_KEYS, frozenset(keys))
            return
        state, groups = sd.get("state"), sd.get("param_groups")
        if not isinstance(state, Mapping):
            r.problems.append(f"{what}'s 'state' is {_type(state)}, not a dict of FQN to a parameter's state")
            state = {}
        not_dicts = [k for k, v in state.items() if not isinstance(v, Mapping)]
        if not_dicts:
            kinds = sorted({_type(state[k]) for k in not_dicts})
            r.problems.append(
                f"{what}'s 'state' holds {'/'.join(kinds)} where a dict belongs, under {_some(not_dicts)}"
            )
        in_groups: set = set()
        if not isinstance(groups, (list, tuple)):
            r.problems.append(f"{what}'s 'param_groups' is {_type(groups)}, not a list of dicts")
        else:
            for i, g in enumerate(groups):
                params = g.get("params") if isinstance(g, Mapping) else None
                if not isinstance(params, (list, tuple)):
                    r.problems.append(
                        f"{what}'s param_groups[{i}] is {_type(g)}"
                        + (", without a 'params' list" if isinstance(g, Mapping) else ", not a dict")
                    )
                    continue
                in_groups.update(p for p in params if isinstance(p, str))
        r.optim = (frozenset(k for k in state if isinstance(k, str)), frozenset(in_groups))

    def surprises(self) -> list[str]:
        """What in the results broke torch's promise, one line per result."""
        out = []
        for r in self._results:
            problems = list(r.problems)
            try:
                problems += _key_problems(r)
            except Exception as exc:  # noqa: BLE001 - the model itself may be what the IUT left odd
                problems.append(f"(its keys could not be compared with the model's: {type(exc).__name__}: {exc})")
            if problems:
                out.append(f"{r.fn} returned what torch's signature does not: " + "; ".join(problems))
        return out + self._changes


def _names(model) -> tuple[dict, set[str], dict[int, list]]:
    """(each parameter's canonical names by its id, every other key its state
    dict may have, and for each of FSDP1's flat parameters the keys of the
    original parameters it holds, each named apart by ``(id, i)``)."""
    stepped = _compat.stepped_parameters(model)
    params: dict = {}
    others: set[str] = set()
    flats: dict[int, list] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        at = f"{prefix}." if prefix else ""
        for name, p in _compat.own_parameters(module).items():
            if p is None:
                continue
            originals = _compat.flat_param_fqns(p)
            if originals is not None:  # FSDP1's flat parameter: its original parameters are the names
                flats[id(p)] = [(id(p), i) for i in range(len(originals))]
                for i, fqn in enumerate(originals):
                    params[(id(p), i)] = {canonical(at + fqn)}
            else:
                p = stepped.get((id(module), name), p)
                params.setdefault(id(p), set()).add(canonical(at + name))
        others.update(canonical(at + name) for name, _ in module.named_buffers(recurse=False))
        if type(module).get_extra_state is not torch.nn.Module.get_extra_state:
            others.add(canonical(at + "_extra_state"))
    return params, others, flats


def _gathered_elsewhere(r: _Result, result: Any) -> bool:
    """An empty result of a get with ``full_state_dict`` and ``cpu_offload``:
    torch's promise on every rank but the root, which holds the whole state."""
    if not (getattr(r.options, "full_state_dict", False) and getattr(r.options, "cpu_offload", False)):
        return False
    if r.fn == "get_state_dict":
        return isinstance(result, (tuple, list)) and len(result) == 2 and all(x == {} for x in result)
    return r.fn.startswith("get_") and result == {}


def _optimizer_params(optimizers) -> list:
    if optimizers is None:
        return []
    optimizers = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    return [p for o in optimizers for g in getattr(o, "param_groups", []) for p in g["params"]]


def _key_problems(r: _Result) -> list[str]:
    if r.model is None or not isinstance(r.model, torch.nn.Module) or "submodules" in r.kwargs_keys:
        return []
    params, others, flats = _names(r.model)
    every = set().union(*params.values(), others) if params else set(others)
    out = []
    if r.model_keys is not None:
        added = r.model_keys - every
        frozen_ok = bool(getattr(r.options, "ignore_frozen_params", False))
        # A tied parameter may come under any of its names.
        lacking = [
            min(names)
            for pid, names in params.items()
            if not names & r.model_keys and not (frozen_ok and not _requires_grad(r.model, names))
        ]
        if added:
            out.append(f"keys the model does not have: {_some(added)}")
        if lacking:
            out.append(f"none of the model's {_some(lacking)}")
    if r.optim is not None:
        stepped = [params.get(k, set()) for p in _optimizer_params(r.optimizers) for k in flats.get(id(p), [id(p)])]
        stepped_names = set().union(*stepped) if stepped else set()
        if r.optim[0] is _FLAT_KEYS:
            outside = [k for k in r.optim[1] if not any(k.split(".", 1)[1].startswith(n + ".") for n in stepped_names)]
            if outside:
                out.append(f"flat keys naming no parameter the optimizer steps: {_some(outside)}")
            grouped = {k.split(".", 1)[1] for k in r.optim[1] if k.startswith("param_groups.")}
            ungrouped = [
                min(names)
                for names in stepped
                if names and not any(g.startswith(n + ".") for g in grouped for n in names)
            ]
            if ungrouped:
                out.append(f"no param_groups.<FQN>.<field> keys for {_some(ungrouped)}")
        else:
            state, grouped = r.optim
            unknown = (state | grouped) - stepped_names
            if unknown:
                out.append(f"FQNs naming no parameter the optimizer steps: {_some(unknown)}")
            lacking = [min(names) for names in stepped if names and not names & grouped]
            if lacking and not getattr(r.options, "ignore_frozen_params", False):
                out.append(f"param_groups without {_some(lacking)}")
    return out


def _requires_grad(model, names: set[str]) -> bool:
    own = {canonical(n): p for n, p in model.named_parameters(remove_duplicate=False)}
    return any(own[n].requires_grad for n in names if n in own)
