"""Planning an optimizer load: check everything, describe the change, change nothing.

One pass, in the order :func:`plan_load` takes it: the optimizers' param
groups and the checkpoint parsed against them (:mod:`.optimizer_input`);
which parameters it holds state for; each value it holds prepared against
its parameter and the state its optimizer keeps or, never stepped, would
create (:class:`~.templates.Expectations`), every tensor checked by
:mod:`.load_checks`. The result is an :class:`~.load_plan.OptimizerLoadPlan`
and the problems found; once every rank has agreed there are none,
:func:`hyperdsd.state.optimizer.apply_load` carries it out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _compat
from ..placement import LayoutCache
from ..tree import is_container
from .fqn import ModelIndex
from .load_checks import (
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
from .load_plan import OptimizerLoadPlan, ParamLoad
from .optimizer_input import Source, TargetGroup, parse, target_groups, unpaired_groups
from .placeholders import has_placeholders
from .saved_templates import step_is_zero
from .templates import Expectations

_STRUCTURAL = ("params", "param_names")


def plan_load(
    index: ModelIndex, optimizers, osd: Any, *, strict: bool, foreign_ok: bool = False
) -> tuple[OptimizerLoadPlan, list[str]]:
    """Check ``osd`` against the optimizers and describe the load; change nothing.

    ``osd`` is nested or flat; its tensors may be :class:`TensorMeta`
    stand-ins (broadcast loads). FQNs the model does not have are problems
    under ``strict`` unless ``foreign_ok`` (another rank may own them; the
    caller checks). Returns the plan and the problems found.
    """
    problems: list[str] = []
    plan = OptimizerLoadPlan(optimizers=tuple(optimizers))
    targets = target_groups(index, optimizers, problems)
    if targets is None:
        return plan, problems
    source = parse(osd, index, targets, strict, problems)
    if source is None:
        return plan, problems
    plan.foreign = source.foreign
    listed = source.listed
    plan.claimed = {f for f in listed if f in index.param_of}
    if strict:
        required = [f for t in targets for p, f in zip(t.group["params"], t.fqns) if p.requires_grad]
        absent = [f for f in required if f not in listed]
        if absent:
            problems.append(f"missing from the checkpoint (strict=True): {absent}")
        if plan.foreign and not foreign_ok:
            problems.append(f"not parameters of the model (strict=True): {sorted(set(plan.foreign))}")
        problems += unpaired_groups(targets, source)
    _prepare_all(plan, targets, source, strict, problems)
    return plan, problems


def _prepare_all(
    plan: OptimizerLoadPlan, targets: list[TargetGroup], source: Source, strict: bool, problems: list[str]
) -> None:
    """A :class:`ParamLoad` for every parameter the checkpoint lists; group fields to set."""
    # By the optimizer's position: what it expects, and its entries without step, (param, fqn, entry).
    expectations = [Expectations(opt) for opt in plan.optimizers]
    stepless: list[list[tuple]] = [[] for _ in plan.optimizers]
    verdicts = Verdicts()
    for target, src in zip(targets, source.matched):
        if src is not None:
            plan.groups.append((target.group, {k: v for k, v in src.fields.items() if k not in _STRUCTURAL}))
        expectation = expectations[target.position]
        for p, fqn in zip(target.group["params"], target.fqns):
            if fqn not in source.listed:
                continue  # not in the checkpoint: left as it is
            entry = source.by_name.get(fqn)
            skip, unknown = source.unwritten(fqn, entry)
            if entry and has_placeholders(entry):
                plan.questions[fqn] = None if unknown else len(skip) < len(entry)
            written = {k: v for k, v in (entry or {}).items() if k not in skip}
            if not written:  # absent, or a template entry nobody filled: the parameter ends fresh
                plan.params.append(ParamLoad(target.opt, p, fqn, None))
                continue
            if len(written) == len(entry) and step_is_zero(entry):
                # Perhaps a saved template: "never stepped", so the parameter
                # ends without state (a warm target's own is dropped). Ranks
                # see different shards: real state if any rank sees it.
                plan.questions[fqn] = not expectation.saved_template(p, entry)
                plan.confirm.add(fqn)
            elif len(written) == len(entry) and "step" not in entry and not unknown:
                # (an entry this rank cannot tell written from unwritten goes by the other ranks alone)
                stepless[target.position].append((p, fqn, entry))
            expected = expectation.of(p)
            if expected and strict and not expected.keys() <= written.keys():
                lacking = sorted(str(k) for k in expected if k not in written)
                if lacking:
                    problems.append(
                        f"state[{fqn!r}] lacks {lacking} (the optimizer keeps {sorted(map(str, expected))})"
                    )
            prepared = {
                key: _prepare(
                    value,
                    p,
                    key,
                    target.group,
                    expected.get(key) if expected else None,
                    f"state[{fqn!r}][{key!r}]",
                    problems,
                    verdicts,
                )
                for key, value in written.items()
            }
            plan.params.append(ParamLoad(target.opt, p, fqn, prepared))
    for position, found in enumerate(stepless):
        if found:
            _ask_stepless(plan, expectations[position], found, f"\0optimizer {position}")


def _ask_stepless(plan: OptimizerLoadPlan, expectation: Expectations, found: list[tuple], name: str) -> None:
    """Ask whether an optimizer's entries without ``step`` are a saved
    never-stepped template: only if all of them are, on every rank (see
    :mod:`hyperdsd.state.saved_templates`). ``name`` stands for the optimizer in
    the vote: its position among the optimizers loaded, alike on every rank
    (NUL never occurs in an FQN). Pipeline stages each load their own
    optimizer at the same position, the parts of one optimizer that steps as
    a whole: a stage whose momentum buffers all happen to be zero (its
    gradients were) is told a real checkpoint by the others. A rank that
    sees real values anywhere in them answers "real" under that name alone;
    one that sees only the template asks, for the optimizer and for each
    entry, and all its entries go by the optimizer's answer. A load of real
    state asks nothing where every rank sees some."""
    if not expectation.stepless_template([(p, entry) for p, _, entry in found]):
        plan.questions[name] = True
        return
    fqns = [fqn for _, fqn, _ in found]
    plan.questions.update(dict.fromkeys([name, *fqns], False))
    plan.confirm.update([name, *fqns])
    plan.together.append([name, *fqns])


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


def _prepare_leaf(value, p, key: str, group: dict, expected, where: str, problems: list[str], verdicts: Verdicts):
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
