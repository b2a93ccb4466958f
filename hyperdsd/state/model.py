"""Model state by canonical FQN: reading it, planning a load, applying it.

Keys are those of ``model.state_dict()`` with wrapper segments removed:
buffers and extra state included, non-persistent buffers excluded, tied
parameters under each of their names, as PyTorch's own state dict has them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _compat
from ..blocks import blocks
from .keys.fqn import ModelIndex
from .loading.checks import (
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
from .loading.in_place import Pairs, column_copies, column_receivers, layout_keys, signature_keys, verdicts_of
from .loading.plan import (
    ModelLoadPlan,
    Prepared,
    ReceiverColumn,
    TensorMeta,
    copy_all,
    copy_into,
    materialize,
    redistribute,
    same_memory,
)

_EXTRA_STATE = "_extra_state"  # the key suffix of a module's extra state, which is not detached
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def read_state(model: torch.nn.Module, index: ModelIndex, ignore_frozen: bool) -> dict[str, Any]:
    # As ``model.state_dict()``, whose per-tensor ``detach()`` goes through
    # DTensor's dispatcher; the same detached DTensors made directly cost a
    # third of that, a fifth of a sharded get on a model of small tensors.
    sd = _read_plain(index)
    if sd is None:
        if index.unsharded:
            with _compat.fsdp2_reshard_hooks_off(model):
                raw = {k: index.sharded_value(k, v) for k, v in model.state_dict(keep_vars=True).items()}
        else:
            raw = model.state_dict(keep_vars=True)
        sd = {
            index.canonical_key(k): _compat.detached(v)
            if isinstance(v, torch.Tensor) and not k.endswith(_EXTRA_STATE)
            else v
            for k, v in raw.items()
        }
    if ignore_frozen:
        for fqn in index.frozen_fqns():
            sd.pop(fqn, None)
    return sd


def _read_plain(index: ModelIndex) -> dict[str, Any] | None:
    """What ``model.state_dict()`` gives, read from the modules directly,
    keys canonical as they are made; None, before anything is read, when a
    module's state dict could be more than its parameters and buffers."""
    # FSDP2's pre-hook (the only one allowed) would reshard what a forward
    # left unsharded; the index reads the sharded parameters where they are
    # instead, so that a get leaves the modules as it found them.
    if not index.reads_plainly:
        return None
    return dict(zip(index.tensor_keys, map(_compat.detached, index.tensors)))


def load_targets(model: torch.nn.Module, index: ModelIndex) -> tuple[dict[str, Any], dict[str, str]]:
    """``model.state_dict(keep_vars=True)``, and its raw key by canonical key.

    Read from the modules directly where that is all it could give and no
    module is unsharded (before a load FSDP2's pre-hook reshards those)."""
    if not index.reads_plainly or index.unsharded:
        targets = model.state_dict(keep_vars=True)
        return targets, {index.canonical_key(k): k for k in targets}
    return dict(zip(index.tensor_raw_keys, index.tensors)), dict(zip(index.tensor_keys, index.tensor_raw_keys))


def _targets_now(model: torch.nn.Module, index: ModelIndex) -> dict[str, Any]:
    """``load_targets``' first, read again (a plan is applied to the tensors the modules hold then)."""
    if not index.reads_plainly or index.unsharded:
        return model.state_dict(keep_vars=True)
    targets = {}
    for module, raw in zip(index.module_objects, index.raw_prefixes):
        params, (buffers, skip) = _compat.own_parameters(module), _compat.own_buffers(module)
        targets.update((raw + name, param) for name, param in params.items() if param is not None)
        targets.update((raw + name, buf) for name, buf in buffers.items() if buf is not None and name not in skip)
    return targets


def _prepare(value: Any, target: torch.Tensor, canon: str, problems: list[str], verdicts: Verdicts) -> Prepared | None:
    """Check one value against the model's tensor under ``canon``; return what
    to load (into the tensor in place where it fits)."""
    cls = type(value)
    if cls is DTensor:  # (a DTensor's layout_key, inline: called once per key of a model)
        signature = (id(_compat.layout_token(value)), layout_key(target))
    elif is_tensorish(value):
        signature = (layout_key(value) if isinstance(value, DTensor) else full_signature(value), layout_key(target))
    else:
        problems.append(f"model[{canon!r}]: a {cls.__name__}, expected a tensor")
        return None
    verdict = verdicts.get(signature)
    if verdict is None:
        verdict = verdicts[signature] = _judge(value, target, verdicts.layouts)
    if verdict.problem:
        problems.append(f"model[{canon!r}]: {verdict.problem}")
        return None
    return planned(verdict, value, _compat.local_tensor(target).device, target)


def _judge(value: Any, target: torch.Tensor, layouts) -> Verdict:
    """What the layouts, shapes and dtypes alone decide of ``value`` for ``target``."""
    if kind_differs(value.dtype, target.dtype):
        return refused(f"dtype {value.dtype}, the model's is {target.dtype}")
    shape = tuple(value.shape)
    if shape != tuple(target.shape):
        return refused(f"shape {shape}, the model has {tuple(target.shape)}")
    if isinstance(value, DTensor):
        if problem := dtensor_problem(value, target, "the model's"):
            return refused(problem)
        return accepted(value.dtype, *dtensor_layout(value, target, layouts), target)
    return accepted(value.dtype, layouts.of(target) if isinstance(target, DTensor) else None, False, target)


def _canonical_or_none(index: ModelIndex, key: str) -> str | None:
    try:
        return index.canonical_key(key)
    except Exception:
        return None


class _PlainLoads:
    """Whether a canonical key is loaded plainly (see
    :func:`hyperdsd._compat.loads_plainly`): by its module and by every module
    above it, whose loading sees (and may change) the entries of the modules
    below. Every module asked once, up front; none where a load post-hook
    sees the ``whole`` load."""

    def __init__(self, model: torch.nn.Module, index: ModelIndex):
        self._plain: set[str] = set()
        self.everywhere = False  # every module loads plainly
        modules = index.module_objects
        # A load post-hook (but FSDP2's) is handed the missing and unexpected keys of the whole
        # load: then every value goes through one load_state_dict, as in torch's load.
        hooks = _compat.load_hook_names(modules)
        self.whole = _compat.load_post_hooked(hooks)
        if self.whole or not _compat.loads_by_copying(model):
            return
        each = _compat.each_loads_plainly(modules, hooks)
        if all(each):
            self._plain, self.everywhere = set(index.module_prefixes), True
            return
        own: dict[str, bool] = {}  # by prefix: a wrapper and what it wraps share one
        for prefix, plain in zip(index.module_prefixes, each):
            own[prefix] = own.get(prefix, True) and plain
        self._plain = {prefix for prefix in own if own[prefix] and self._above_plain(prefix, own)}

    @staticmethod
    def _above_plain(prefix: str, own: dict[str, bool]) -> bool:
        while prefix:
            head = prefix[:-1].rpartition(".")[0]
            prefix = head + "." if head else ""
            if not own.get(prefix, True):
                return False
        return True

    def __call__(self, canon: str) -> bool:
        return canon[: canon.rfind(".") + 1] in self._plain  # a module not in the index: not known to be plain


def plan_load(
    model: torch.nn.Module, index: ModelIndex, sd: Any, *, strict: bool, ignore_frozen: bool, foreign_ok: bool = False
) -> tuple[ModelLoadPlan, list[str]]:
    problems: list[str] = []
    plan = ModelLoadPlan()
    if not isinstance(sd, dict):
        problems.append(f"the model state dict is a {type(sd).__name__}, expected a dict")
        return plan, problems
    verdicts = Verdicts()
    loads_plainly = _PlainLoads(model, index)
    plan.whole = loads_plainly.whole
    # Read from the modules directly (no extra state, see load_targets), every key
    # the model's as it is named, every module loading by copying:
    plain = index.reads_plainly and not index.unsharded and not index.renames and loads_plainly.everywhere
    if plain and _planned_in_place(plan, model, index, sd, verdicts):
        return plan, problems
    targets, raw_of = load_targets(model, index)
    matched: set[str] = set()
    for key, value in sd.items():
        canon = key if key in raw_of else (_canonical_or_none(index, key) if isinstance(key, str) else None)
        if canon not in raw_of:
            plan.unexpected.append(key)
            continue
        raw = raw_of[canon]
        matched.add(canon)
        plan.claimed.add(key)
        target = targets[raw]
        # A lazy module's tensor: load_state_dict materialises it in the value's shape (its load
        # pre-hook), which is all a full tensor needs; it has no layout to check against.
        lazy = isinstance(target, torch.nn.parameter.UninitializedTensorMixin)
        if lazy and type(value) not in _PLAIN:
            problems.append(
                f"model[{canon!r}]: the model's is uninitialized (a lazy module's), which only a full "
                f"tensor loaded without broadcast_from_rank0 initializes; got {type(value).__name__} "
                "(run a forward first to initialize it)"
            )
            continue
        if isinstance(target, torch.Tensor) and not lazy:
            prepared = _prepare(value, target, canon, problems, verdicts)
            if prepared is None:
                continue
            if target.device.type == "meta":
                prepared.dest = None
                plan.on_meta.add(raw)
                if prepared.device.type == "meta":
                    prepared.device = (
                        prepared.local.device if prepared.local is not None else _compat.collective_device()
                    )
            elif raw.endswith(_EXTRA_STATE) or (
                prepared.dest is not None and prepared.meta is None and not loads_plainly(canon)
            ):
                # Through load_state_dict, which the module's own loading may extend (extra
                # state goes to set_extra_state). A broadcast piece goes straight into the
                # model's tensor where it fits: a rank holds no more.
                prepared.dest = None
            plan.values[raw] = prepared
        else:
            plan.values[raw] = value  # extra state, a lazy module's tensor: whatever the module accepts
    frozen = index.frozen_fqns() if ignore_frozen else set()
    plan.missing = [c for c in raw_of if c not in matched and c not in frozen]
    if plan.missing:
        plan.missing = _not_filled_in(plan.missing, sd, raw_of, index, targets)
    if strict and (plan.missing or (plan.unexpected and not foreign_ok)):
        parts = []
        if plan.missing:
            parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.missing) + ".")
        if plan.unexpected and not foreign_ok:
            parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in plan.unexpected) + ".")
        problems.append(f"Error(s) in loading state_dict for {type(model).__name__}: " + " ".join(parts))
    return plan, problems


def _planned_in_place(
    plan: ModelLoadPlan, model: torch.nn.Module, index: ModelIndex, sd: dict, verdicts: Verdicts
) -> bool:
    """Plan ``sd`` into ``plan`` as a load in place (:func:`_in_place`), where
    every key is the model's and every value lands so; False, ``plan`` as it
    was, otherwise."""
    keys = list(sd)
    if keys == index.tensor_raw_keys:  # (in the model's order: its tensors as the index holds them)
        found = _in_place(keys, list(sd.values()), list(index.tensors), verdicts)
    else:
        own, _ = load_targets(model, index)
        same = sd.keys() == own.keys()
        found = _in_place(keys, list(sd.values()), list(map(own.__getitem__, keys)), verdicts) if same else None
    if found is None:
        return False
    plan.copies, plan.columns = found
    plan.values = dict(sd)
    plan.claimed, plan.in_place = set(sd), True
    plan.registries = _compat.module_registries(index.module_objects)
    plan.registered = index.registered
    return True


def _not_filled_in(missing: list[str], sd: dict, raw_of: dict, index: ModelIndex, targets: dict) -> list[str]:
    """``missing`` (canonical keys) without those ``load_state_dict`` fills in by
    itself: a batch norm's ``num_batches_tracked``
    (:func:`hyperdsd._compat.filled_in_batch_counts`), left as it is. A model on
    the meta device gets a 0 there, which is left to be reported missing."""
    if not any(c.endswith("num_batches_tracked") for c in missing):
        return missing
    filled = _compat.filled_in_batch_counts(index.module_objects, index.raw_prefixes, sd)

    def fills(canon: str) -> bool:
        target = targets.get(raw_of[canon])
        return isinstance(target, torch.Tensor) and not target.is_meta and id(target) in filled

    return [c for c in missing if not fills(c)]


def _in_place(
    keys: list[str], values: list, dests: list, verdicts: Verdicts
) -> tuple[Pairs, list[ReceiverColumn]] | None:
    """A load of ``values`` under ``keys`` (the model's own keys, not renamed)
    that puts each into ``dests``' tensor beside it (the model's under its
    key), checked a column at a time (of one kind of value and of tensor:
    DTensors apart from plain ones, buffers; each in blocks): the
    (destination, source) local tensors to copy, the pairs that are not the
    same memory already; and, for a broadcast's stand-ins, the columns that
    receive them (else none). None where any value does not land so (the
    caller plans key by key, and words any problem)."""
    kinds = set(zip(map(type, values), map(type, dests)))
    if len(kinds) == 1:
        by_kind = [range(len(values))]
    else:
        rows_of: dict[tuple, list[int]] = {}
        for i, kind in enumerate(zip(map(type, values), map(type, dests))):
            rows_of.setdefault(kind, []).append(i)
        by_kind = list(rows_of.values())
    columns = [rows[block] for rows in by_kind for block in blocks(len(rows))]  # (see hyperdsd.blocks)
    stand_ins = {value_kind for value_kind, _ in kinds} == {TensorMeta}
    copies: Pairs = []
    receivers: list[ReceiverColumn] = []
    for rows in columns:
        column, existing = [values[i] for i in rows], [dests[i] for i in rows]
        mine, theirs = signature_keys(column), layout_keys(existing)
        if mine is None or theirs is None or (mine[1] is TensorMeta) != stand_ins:
            return None
        signatures = list(zip(mine[0], theirs[0]))

        def judge(i: int, column=column, existing=existing) -> Verdict:
            return _judge(column[i], existing[i], verdicts.layouts)

        found = verdicts_of(signatures, verdicts, judge)
        if found is None:
            return None
        if stand_ins:
            got = column_receivers(column, existing, found, None, list(map(keys.__getitem__, rows)))
            if got is None:
                return None
            receivers.append(got)
            continue
        pairs = column_copies(column, mine[1], existing, found)
        if pairs is None:
            return None
        copies += pairs
    return copies, receivers


def apply_load(model: torch.nn.Module, plan: ModelLoadPlan, index: ModelIndex) -> None:
    redistribute(plan.tensors())
    copy_in: dict[str, Any] = {}
    assign: dict[str, Any] = {}
    changed = False
    if plan.in_place:
        names, held = _compat.registered_in(plan.registries)
        planned_names, planned_held = plan.registered
        if names == planned_names and len(held) == len(planned_held) and all(map(operator.is_, held, planned_held)):
            copy_all(plan.copies)  # every module holds what the plan was made against
            return
        # A module or tensor of the model replaced since the plan was made (by an optimizer's load
        # post-hook): every value as any value, through load_state_dict, into the model as it is now.
        changed, plan.in_place = True, False
        plan.expand(delivered=True)
    targets = model.state_dict(keep_vars=True) if changed else _targets_now(model, index)
    for raw, value in plan.values.items():
        if raw in plan.on_meta:
            assign[raw] = materialize(value)
        elif isinstance(value, Prepared):
            if value.landing is not None:
                continue  # delivered where it belongs already
            target = targets.get(raw)
            if value.dest is not None and target is value.dest:
                copy_into(target, value)  # nothing to copy for a piece delivered into it
            elif isinstance(target, torch.Tensor) and same_memory(_compat.local_tensor(target), value.local):
                pass  # the model's own tensor (a DCP template filled in place): nothing to copy
            else:
                copy_in[raw] = value.layout.wrap(value.local) if value.layout is not None else value.local
                continue
            if plan.whole:
                copy_in[raw] = target  # (holding its value: loading copies it onto itself)
        else:
            copy_in[raw] = value
    if copy_in or plan.whole:
        model.load_state_dict(copy_in, strict=False)
    if assign:
        model.load_state_dict(assign, strict=False, assign=True)
