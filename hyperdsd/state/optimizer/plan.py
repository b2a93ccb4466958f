"""Planning an optimizer load: check everything, describe the change, change nothing.

One pass, in the order :func:`plan_load` takes it: the optimizers' param
groups and the checkpoint parsed against them (:mod:`hyperdsd.state.optimizer.input`);
which parameters it holds state for; each value it holds prepared against
its parameter and the state its optimizer keeps or, never stepped, would
create (:class:`~hyperdsd.state.placeholders.scratch.Expectations`), every tensor checked by
:mod:`hyperdsd.state.loading.checks`. The result is an :class:`~hyperdsd.state.loading.plan.OptimizerLoadPlan`
and the problems found; once every rank has agreed there are none,
:func:`hyperdsd.state.optimizer.state.apply_load` carries it out.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import torch

from ...blocks import blocks
from ..keys.fqn import ModelIndex
from ..loading.plan import OptimizerLoadPlan, ParamLoad, TensorMeta
from ..placeholders.marks import has_placeholders
from ..placeholders.saved import step_is_zero, steps_nonzero
from ..placeholders.scratch import Expectations
from .input import Source, TargetGroup, parse, target_groups, unpaired_groups
from .values import EntryValues

_STRUCTURAL = ("params", "param_names")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


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
    plan.claimed = set(filter(index.param_of.__contains__, listed))
    if strict:
        trained = (itertools.compress(t.fqns, map(_REQUIRES_GRAD, t.group["params"])) for t in targets)
        required = list(itertools.chain.from_iterable(trained))
        absent = [f for f in required if f not in listed] if not listed.issuperset(required) else []
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
    values = EntryValues(problems)
    listed, by_name, unwritten = source.listed, source.by_name, source.unwritten
    for target, src in zip(targets, source.matched):
        if src is not None:
            plan.groups.append((target.group, {k: v for k, v in src.fields.items() if k not in _STRUCTURAL}))
        expectation = expectations[target.position]
        values.start_group(target)
        rest = zip(target.group["params"], target.fqns)
        if not expectation.fresh and unwritten.none:
            params, fqns = target.group["params"], target.fqns
            rest = []
            for block in blocks(len(fqns)):
                rest += _in_place(plan, values, target.opt, params[block], fqns[block], by_name)
        for p, fqn in rest:
            if fqn not in listed:
                continue  # not in the checkpoint: left as it is
            entry = by_name.get(fqn)
            skip, unknown = unwritten(fqn, entry)
            if entry and has_placeholders(entry):
                plan.questions[fqn] = None if unknown else len(skip) < len(entry)
            written = {k: v for k, v in (entry or {}).items() if k not in skip}
            if not written:  # absent, or a placeholder state entry nobody filled: the parameter ends fresh
                plan.params.append(ParamLoad(target.opt, p, fqn, None))
                continue
            if len(written) == len(entry) and step_is_zero(entry):
                # Perhaps a saved placeholder state: "never stepped", so the parameter
                # ends without state (a warm target's own is dropped). Ranks
                # see different shards: real state if any rank sees it.
                plan.questions[fqn] = not expectation.saved_placeholder(p, entry)
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
            plan.params.append(ParamLoad(target.opt, p, fqn, values.prepared(p, fqn, written, expected)))
    for position, found in enumerate(stepless):
        if found:
            _ask_stepless(plan, expectations[position], found, f"\0optimizer {position}")


def _in_place(
    plan: OptimizerLoadPlan, values: EntryValues, opt: torch.optim.Optimizer, params: list, fqns: list, by_name: dict
) -> list:
    """Plan, a column at a time, the loads of ``params`` (some of one group of
    ``opt``, their FQNs ``fqns``) that the checkpoint holds an entry for and
    the optimizer has one of its own, each value into its own tensor
    (:meth:`EntryValues.in_place`): with ``step`` and none 0, they ask nothing
    of the other ranks (:meth:`OptimizerLoadPlan.settle` keeps them). Returns
    the (parameter, FQN) pairs left to plan one by one."""
    entries = list(map(by_name.get, fqns))
    owns = list(map(opt.state.get, params))
    chosen = list(itertools.compress(range(len(entries)), map(operator.and_, map(bool, entries), map(bool, owns))))
    if not chosen:
        return list(zip(params, fqns))
    mine, theirs = [entries[i] for i in chosen], [params[i] for i in chosen]
    columns = values.columns(theirs, mine, [owns[i] for i in chosen]) if steps_nonzero(mine) else None
    if columns is None:
        return list(zip(params, fqns))
    kinds = {column.kind for column in columns}
    if kinds == {TensorMeta}:  # a broadcast's: each value planned to be received in place, by column
        loads = list(
            map(
                ParamLoad,
                itertools.repeat(opt),
                theirs,
                map(fqns.__getitem__, chosen),
                mine,
                map(owns.__getitem__, chosen),
            )
        )
        received = values.received(theirs, columns, loads)
        if received is None:
            return list(zip(params, fqns))
        plan.params += loads
        plan.columns += received
    else:
        copies = values.copies(columns) if TensorMeta not in kinds else None
        if copies is None:
            return list(zip(params, fqns))
        plan.copies += copies
        plan.params += map(
            ParamLoad,
            itertools.repeat(opt),
            map(params.__getitem__, chosen),
            map(fqns.__getitem__, chosen),
            map(entries.__getitem__, chosen),
            map(owns.__getitem__, chosen),
        )  # (positional, through map: a keyword call per parameter cost more than the check)
    if len(chosen) == len(params):
        return []
    taken = set(chosen)
    return [(p, fqn) for i, (p, fqn) in enumerate(zip(params, fqns)) if i not in taken]


def _ask_stepless(plan: OptimizerLoadPlan, expectation: Expectations, found: list[tuple], name: str) -> None:
    """Ask whether an optimizer's entries without ``step`` are a saved
    never-stepped placeholder state: only if all of them are, on every rank (see
    :mod:`hyperdsd.state.placeholders.saved`). ``name`` stands for the optimizer in
    the vote: its position among the optimizers loaded, alike on every rank
    (NUL never occurs in an FQN). Pipeline stages each load their own
    optimizer at the same position, the parts of one optimizer that steps as
    a whole: a stage whose momentum buffers all happen to be zero (its
    gradients were) is told a real checkpoint by the others. A rank that
    sees real values anywhere in them answers "real" under that name alone;
    one that sees only the placeholder state asks, for the optimizer and for each
    entry, and all its entries go by the optimizer's answer. A load of real
    state asks nothing where every rank sees some."""
    if not expectation.stepless_placeholder([(p, entry) for p, _, entry in found]):
        plan.questions[name] = True
        return
    fqns = [fqn for _, fqn, _ in found]
    plan.questions.update(dict.fromkeys([name, *fqns], False))
    plan.confirm.update([name, *fqns])
    plan.together.append([name, *fqns])
