"""The checks of each value an optimizer load holds, against its parameter
and the state the optimizer keeps (or would create) under its key, each
tensor's by :mod:`hyperdsd.state.loading.checks`' verdicts: value by value, nested values leaf
by leaf, and a group's values a column at a time where they land in the
tensors they replace (:mod:`hyperdsd.state.loading.in_place`). :mod:`hyperdsd.state.optimizer.plan` takes a load
through them parameter by parameter.
"""

from __future__ import annotations

import itertools
import numbers
import operator
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ... import _compat
from ...placement import LayoutCache
from ...tree import is_container
from ..loading.checks import (
    Verdict,
    Verdicts,
    accepted,
    dtensor_layout,
    dtensor_problem,
    full_signature,
    is_tensorish,
    kind_differs,
    layout_key,
    planned,
    refused,
)
from ..loading.in_place import (
    ColumnVerdicts,
    Pairs,
    column_copies,
    column_receivers,
    layout_keys,
    signature_keys,
    verdicts_of,
)
from ..loading.plan import ReceiverColumn, TensorMeta
from .input import TargetGroup


class StateColumn(NamedTuple):
    """One state key's values across a group's parameters, checked (:meth:`EntryValues.columns`)."""

    key: str
    kind: type  # DTensor, torch.Tensor or TensorMeta
    values: list
    existing: list  # the optimizer's own tensors under the key
    verdicts: ColumnVerdicts


class EntryValues:
    """Each value of an entry checked against its parameter and ``expected``,
    the state the optimizer keeps (or would create) under its key, as
    :func:`_prepare` checks it: a DTensor, a plain tensor or a broadcast's
    stand-in inline, by its verdict's signature alone; or a group's entries
    a column at a time where they land in the optimizer's own tensors. A load
    of many small parameters spends most of its planning here."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        self.verdicts = Verdicts()
        self.target: TargetGroup | None = None
        self.step_on_param = False

    def start_group(self, target: TargetGroup) -> None:
        self.target = target
        # where a step lands: beside its parameter only in capturable and fused groups (_target_device)
        self.step_on_param = bool(target.group.get("capturable") or target.group.get("fused"))

    def columns(self, params: list, entries: list[dict], owns: list[dict]) -> list[StateColumn] | None:
        """Each key's column of ``entries`` checked against ``owns``, the
        optimizer's own entries (of ``params``, one to one), each distinct
        signature judged once: None where the entries do not all hold the
        same keys as their own (``step`` among them: without it they may be a
        saved placeholder state, see :func:`_ask_stepless`), or a value would not land
        in the tensor it replaces as it is (the caller plans them one by one)."""
        keys = tuple(entries[0])
        # the same number of keys, and each key in each (itemgetter raises below): the same keys
        if "step" not in keys or set(map(len, entries)) != {len(keys)} or set(map(len, owns)) != {len(keys)}:
            return None
        found = layout_keys(params)
        if found is None:
            return None
        columns = []
        for key in keys:
            take = operator.itemgetter(key)
            try:
                values, existing = list(map(take, entries)), list(map(take, owns))
            except KeyError:
                return None
            mine, theirs = signature_keys(values), layout_keys(existing)
            if mine is None or theirs is None:
                return None
            signatures = list(zip(mine[0], found[0], theirs[0], itertools.repeat(key == "step")))

            def judge(i: int, key=key, values=values, existing=existing) -> Verdict:
                return _judge(values[i], params[i], key, existing[i], self.verdicts.layouts)

            verdicts = verdicts_of(signatures, self.verdicts, judge)
            if verdicts is None:
                return None
            columns.append(StateColumn(key, mine[1], values, existing, verdicts))
        return columns

    @staticmethod
    def copies(columns: list[StateColumn]) -> Pairs | None:
        """(destination, source) local tensors that load the columns' values (tensors)
        into their tensors: the pairs that are not the same memory already; None
        where one would not land as it is."""
        copies: Pairs = []
        for column in columns:
            pairs = column_copies(column.values, column.kind, column.existing, column.verdicts)
            if pairs is None:
                return None
            copies += pairs
        return copies

    def received(self, params: list, columns: list[StateColumn], loads: list) -> list[ReceiverColumn] | None:
        """The columns' stand-ins (a broadcast's), each to be received into the
        tensor it replaces, as receiver columns of ``loads`` (one per parameter
        of ``params``); None where one's local shape is not that tensor's (the
        loads are planned anew)."""
        received = []
        devices = list(map(_DEVICE, _compat.local_tensors(params)))
        cpu = [_CPU] * len(params)
        for column in columns:
            on = cpu if column.key == "step" and not self.step_on_param else devices
            found = column_receivers(column.values, column.existing, column.verdicts, on, loads, column.key)
            if found is None:
                return None
            received.append(found)
        return received

    def prepared(self, p, fqn: str, written: dict, expected: dict | None) -> dict:
        """Each of ``written``'s values as :func:`_prepare` plans it."""
        target, device, p_key = self.target, _compat.local_tensor(p).device, layout_key(p)
        prepared = {}
        for key, value in written.items():
            existing = expected.get(key) if expected else None
            cls = type(value)
            if cls is DTensor:  # (the signature _verdict makes, inline: once per value of a load)
                mine = id(_compat.layout_token(value))
            elif cls is torch.Tensor or cls is TensorMeta:
                mine = (cls, tuple(value.shape), value.dtype)
            else:  # nested, a number, a subclass
                prepared[key] = _prepare(
                    value, p, key, target.group, existing, f"state[{fqn!r}][{key!r}]", self.problems, self.verdicts
                )
                continue
            signature = (mine, p_key, layout_key(existing), key == "step")
            verdict = self.verdicts.get(signature)
            if verdict is None:
                verdict = self.verdicts[signature] = _judge(value, p, key, existing, self.verdicts.layouts)
            if verdict.problem:
                self.problems.append(f"state[{fqn!r}][{key!r}]: {verdict.problem}")
                prepared[key] = None
                continue
            if key == "step" and not self.step_on_param:
                on = value.device if cls is not TensorMeta else _CPU
            else:
                on = device
            prepared[key] = planned(verdict, value, on, existing)
        return prepared


_CPU = torch.device("cpu")
_DEVICE = operator.attrgetter("device")


def _target_device(key: str, group: dict, value, param_device: torch.device) -> torch.device:
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    return param_device


def _verdict(value, p, key: str, expected, verdicts: Verdicts) -> Verdict:
    """The checks of a tensor state value (or stand-in) against its parameter
    and the state the optimizer keeps, all of which depend on layouts, shapes
    and dtypes alone: once per combination of them and ``step`` or not."""
    mine = layout_key(value) if isinstance(value, DTensor) else full_signature(value)
    signature = (mine, layout_key(p), layout_key(expected), key == "step")
    verdict = verdicts.get(signature)
    if verdict is None:
        verdict = verdicts[signature] = _judge(value, p, key, expected, verdicts.layouts)
    return verdict


def _judge(value, p, key: str, expected, layouts: LayoutCache) -> Verdict:
    if isinstance(value, DTensor):
        if not isinstance(p, DTensor):
            return refused(dtensor_problem(value, p, "the parameter"))
        if problem := _value_problem(value, p, key, expected) or dtensor_problem(value, p, "the parameter"):
            return refused(problem)
        return accepted(value.dtype, *dtensor_layout(value, p, layouts), expected)
    if problem := _value_problem(value, p, key, expected):
        return refused(problem)
    # A full value of the parameter's shape is sharded like it; scalars (step) stay plain.
    shape = tuple(value.shape)
    sharded = isinstance(p, DTensor) and shape == tuple(p.shape) and shape != ()
    return accepted(value.dtype, layouts.of(p, contiguous=True) if sharded else None, False, expected)


def _value_problem(value, p, key: str, expected) -> str:
    """Why a tensor (or stand-in) cannot be ``p``'s state under ``key`` beside
    ``expected``, the optimizer's own ("" if it can): its kind and shape."""
    # State keeps its own dtype, but not of another kind: no integer moments for float parameters.
    if key != "step" and kind_differs(value.dtype, p.dtype):
        return f"dtype {value.dtype}, expected a floating-point dtype for the state of a {p.dtype} parameter"
    shape = tuple(value.shape)
    allowed = (tuple(expected.shape),) if isinstance(expected, torch.Tensor) else ((), tuple(p.shape))
    if shape not in allowed:
        want = " or ".join(str(a) for a in sorted(set(allowed)))
        return f"shape {shape}, expected {want}"
    return ""


def _prepare(value, p, key: str, group: dict, expected, where: str, problems: list[str], verdicts: Verdicts):
    """Check one state value against its parameter and ``expected``, what the
    optimizer keeps (or would create) under ``key``; return what to load.

    Nested values (dicts, lists and tuples, as custom optimizers keep) are
    checked leaf by leaf against the same place in ``expected``.
    """
    if isinstance(value, torch.Tensor):
        return _prepare_leaf(value, p, key, group, expected, where, problems, verdicts)
    if is_container(value) and isinstance(expected, torch.Tensor):
        problems.append(f"{where}: a {type(value).__name__}, expected a tensor like the optimizer's")
        return None
    if type(value) is dict:
        mine = expected if isinstance(expected, dict) else {}
        return {
            k: _prepare(v, p, key, group, mine.get(k), f"{where}[{k!r}]", problems, verdicts) for k, v in value.items()
        }
    if type(value) in (list, tuple):
        mine = expected if isinstance(expected, (list, tuple)) and len(expected) == len(value) else [None] * len(value)
        return type(value)(
            _prepare(v, p, key, group, e, f"{where}[{i}]", problems, verdicts)
            for i, (v, e) in enumerate(zip(value, mine))
        )
    return _prepare_leaf(value, p, key, group, expected, where, problems, verdicts)


def _scalar_tensor(t) -> bool:
    return type(t) is torch.Tensor and t.ndim == 0


def _prepare_leaf(value, p, key: str, group: dict, expected, where: str, problems: list[str], verdicts: Verdicts):
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and _scalar_tensor(expected):
        # A number where the optimizer keeps a 0-d tensor: checkpoints of torch before 1.12
        # kept ``step`` (and ASGD's ``eta`` and ``mu``) so, and the optimizers' __setstate__
        # make it a tensor; this one is of the optimizer's own dtype and device.
        value = torch.tensor(float(value), dtype=expected.dtype, device=expected.device)
    if not is_tensorish(value):
        if isinstance(expected, torch.Tensor):
            problems.append(f"{where}: a {type(value).__name__} ({value!r}), expected a tensor like the optimizer's")
        return value
    verdict = _verdict(value, p, key, expected, verdicts)
    if verdict.problem:
        problems.append(f"{where}: {verdict.problem}")
        return None
    # loaded in place into the state tensor it replaces, where it fits
    return planned(verdict, value, _target_device(key, group, value, _compat.local_tensor(p).device), expected)
