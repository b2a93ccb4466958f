"""Optimizer state by FQN: reading it (pure) and planning how to load it.

Reading never steps, never touches ``optimizer.state``, ``param_groups``,
parameters or gradients. Loading is split in two: :func:`plan_load` checks
everything and describes what would change without changing anything;
:func:`apply_load` then carries it out, copying into existing state tensors
in place where their layout allows.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from . import _compat
from .flatten import GROUPS, STATE, is_flat, unflatten
from .fqn import ModelIndex
from .placement import DTensorLayout
from .templates import has_placeholders, is_template_value, scratch_state, template_state, unwritten_keys

_STRUCTURAL = ("params", "param_names")


def _own(value: Any) -> Any:
    """A copy of a group field that the optimizer cannot change under us."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_own(v) for v in value]
    return value


def _param_fqn(index: ModelIndex, p, gi: int, pi: int) -> str:
    fqn = index.fqn_of.get(p)
    if fqn is None:
        from .errors import StateDictError

        raise StateDictError(
            f"param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) of the optimizer is not a parameter of the model"
        )
    return fqn


def read_state(index: ModelIndex, optimizers) -> dict:
    """``{"state": {fqn: {...}}, "param_groups": [{"params": [fqn, ...], ...}]}``.

    State entries are new dicts (changing them does not reach the optimizer);
    their tensors are the optimizer's own, as ``Optimizer.state_dict()`` gives
    them. A never-stepped optimizer yields placeholder state (see templates).
    """
    state: dict[str, dict] = {}
    groups: list[dict] = []
    gi = 0
    for opt in optimizers:
        template = template_state(opt) if not opt.state else {}
        sd = opt.state_dict()  # runs the optimizer's own state-dict hooks
        by_id: dict[Any, torch.Tensor] = {}
        for g_sd, group in zip(sd[GROUPS], opt.param_groups):
            fqns = []
            for pi, (pid, p) in enumerate(zip(g_sd["params"], group["params"])):
                by_id[pid] = p
                fqns.append(_param_fqn(index, p, gi, pi))
            groups.append({**{k: _own(v) for k, v in g_sd.items() if k != "params"}, "params": fqns})
            gi += 1
        stored = {by_id[k]: v for k, v in sd[STATE].items() if k in by_id}
        for group in opt.param_groups:
            for p in group["params"]:
                entry = stored.get(p) or template.get(p)
                if entry:
                    state[index.fqn_of[p]] = dict(entry)
    return {STATE: state, GROUPS: groups}


# -- planning a load -------------------------------------------------------

@dataclass(frozen=True)
class TensorMeta:
    """Stands in for a tensor only rank 0 holds (broadcast loads)."""

    shape: tuple
    dtype: torch.dtype
    index: int


@dataclass
class Prepared:
    """One state tensor as it will be loaded on this rank."""

    layout: DTensorLayout | None  # DTensor layout of the result; None: a plain tensor
    device: torch.device
    local: torch.Tensor | None = None  # this rank's piece (None until a broadcast delivers it)
    meta: TensorMeta | None = None
    redistribute: DTensor | None = None  # a DTensor to move to ``layout`` first
    dest: torch.Tensor | None = None  # an existing tensor of the same layout to copy into
    owned: bool = False  # ``local`` is ours to keep as the new tensor, no copy needed

    @property
    def local_shape(self) -> tuple:
        if self.local is not None:
            return tuple(self.local.shape)
        if self.layout is None:
            return tuple(self.meta.shape)
        return tuple(s.stop - s.start for s in self.layout.local_slices())

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype if self.local is not None else self.meta.dtype

    def receive(self, piece: torch.Tensor) -> None:
        """Take a delivered piece (a view into a transfer buffer)."""
        if self.dest is not None:
            target = _compat.local_tensor(self.dest) if isinstance(self.dest, DTensor) else self.dest
            if not same_memory(target, piece):  # received in place already
                target.copy_(piece)
            self.local = target
        else:
            self.local = piece.to(self.device, copy=True)
            self.owned = True


@dataclass
class ParamLoad:
    opt: torch.optim.Optimizer
    param: torch.Tensor
    fqn: str
    entry: dict | None  # None: the parameter ends without state


@dataclass
class LoadPlan:
    params: list[ParamLoad] = field(default_factory=list)
    groups: list[tuple[dict, dict]] = field(default_factory=list)
    optimizers: tuple = ()
    claimed: set[str] = field(default_factory=set)  # source FQNs this rank loads
    # Was the template entry of each FQN loaded into? None: this rank cannot tell.
    questions: dict[str, bool | None] = field(default_factory=dict)
    foreign: list[str] = field(default_factory=list)  # source FQNs this rank does not know

    def settle(self, answers: dict[str, bool]) -> None:
        """Drop the entries other ranks say nobody loaded (they stay fresh)."""
        for load in self.params:
            if self.questions.get(load.fqn, True) is None and not answers.get(load.fqn, True):
                load.entry = None

    def tensors(self):
        for load in self.params:
            for key, value in (load.entry or {}).items():
                if isinstance(value, Prepared):
                    yield load, key, value


def _is_tensorish(v) -> bool:
    return isinstance(v, (torch.Tensor, TensorMeta))


def _shape(v) -> tuple:
    return tuple(v.shape)


class _Expectations:
    """What each parameter's state should look like: its current state, or,
    for an optimizer that never stepped, what a step would create (built once,
    only when needed)."""

    def __init__(self, opt):
        self.opt = opt
        self.fresh = not opt.state
        self._scratch: dict | None | bool = False

    def scratch(self) -> dict | None:
        if self._scratch is False:
            self._scratch = scratch_state(self.opt) if self.fresh else None
        return self._scratch

    def of(self, p) -> dict | None:
        entry = self.opt.state.get(p)
        if entry:
            return entry
        scratch = self.scratch()
        return scratch.get(p) if scratch else None


def _target_device(p, key: str, group: dict, value) -> torch.device:
    local = _compat.local_tensor(p) if isinstance(p, DTensor) else p
    if key == "step" and not (group.get("capturable") or group.get("fused")):
        return value.device if isinstance(value, torch.Tensor) else torch.device("cpu")
    return local.device


def _kind_problem(dtype: torch.dtype, param_dtype: torch.dtype, key: str) -> str:
    """State keeps its own dtype, but not of another kind: no integer moments for float parameters."""
    if key == "step" or not param_dtype.is_floating_point:
        return ""
    if dtype.is_floating_point or dtype.is_complex:
        return ""
    return f"dtype {dtype}, expected a floating-point dtype for the state of a {param_dtype} parameter"


def _prepare(value, p, key: str, group: dict, expected: dict | None, where: str, problems: list[str]):
    """Check one state value against its parameter; return what to load."""
    exp = expected.get(key) if expected else None
    if not _is_tensorish(value):
        if isinstance(exp, torch.Tensor):
            problems.append(f"{where}: a {type(value).__name__} ({value!r}), expected a tensor like the optimizer's")
        return value
    if isinstance(value, DTensor) and not isinstance(p, DTensor):
        problems.append(f"{where}: a DTensor, but the parameter is not; load it with full_state_dict=True or through DCP")
        return None
    if kind := _kind_problem(value.dtype, p.dtype, key):
        problems.append(f"{where}: {kind}")
        return None
    shape = _shape(value)
    allowed = {_shape(exp)} if isinstance(exp, torch.Tensor) else {(), tuple(p.shape)}
    if shape not in allowed:
        want = " or ".join(str(a) for a in sorted(allowed))
        problems.append(f"{where}: shape {shape}, expected {want}")
        return None
    device = _target_device(p, key, group, value)
    if isinstance(value, DTensor):
        if value.device_mesh != p.device_mesh:
            problems.append(f"{where}: on mesh {value.device_mesh}, the parameter is on {p.device_mesh}")
            return None
        if tuple(value.placements) == tuple(p.placements) or shape != tuple(p.shape):
            return Prepared(DTensorLayout.of(value), device, local=_compat.local_tensor(value))
        return Prepared(DTensorLayout.of(p), device, redistribute=value)
    if isinstance(p, DTensor) and shape == tuple(p.shape) and shape != ():
        layout = DTensorLayout.of(p).with_shape(p.shape)
        if isinstance(value, TensorMeta):
            return Prepared(layout, device, meta=value)
        return Prepared(layout, device, local=layout.local_from_full(value))
    if isinstance(value, TensorMeta):
        return Prepared(None, device, meta=value)
    return Prepared(None, device, local=value)


def _source_groups(osd, index: ModelIndex, problems: list[str]):
    """Validated (fields, canonical fqns) per source group, and state by canonical FQN."""
    if not isinstance(osd, dict):
        problems.append(f"the optimizer state dict is a {type(osd).__name__}, expected a dict")
        return None
    missing = [k for k in (STATE, GROUPS) if k not in osd]
    if missing:
        problems.append(f"the optimizer state dict has no {' or '.join(repr(k) for k in missing)} entry")
        return None
    state, groups = osd[STATE], osd[GROUPS]
    if not isinstance(state, dict):
        problems.append(f"'state' is a {type(state).__name__}, expected a dict keyed by FQN")
        return None
    if not isinstance(groups, (list, tuple)):
        problems.append(f"'param_groups' is a {type(groups).__name__}, expected a list")
        return None
    out_groups = []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            problems.append(f"param_groups[{gi}] has no 'params'")
            continue
        if not isinstance(g["params"], (list, tuple)) or not all(isinstance(f, str) for f in g["params"]):
            problems.append(f"param_groups[{gi}]['params'] must be a list of FQNs (strings), got {g['params']!r:.80}")
            continue
        out_groups.append((g, list(g["params"])))
    for fqn, entry in state.items():
        if not isinstance(fqn, str):
            problems.append(f"state key {fqn!r} is not an FQN; optimizer state must be keyed by parameter names")
        elif not isinstance(entry, dict):
            problems.append(f"state[{fqn!r}] is a {type(entry).__name__}, expected a dict of state values")
    return out_groups, state


def _from_flat(osd: dict, index: ModelIndex, targets, strict: bool, problems: list[str]):
    """Rebuild source groups aligned with the target's groups from a flat dict."""
    names = set(index.param_of)
    state, fields, unknown = unflatten(osd, names)
    aligned = []
    def listed(f: str) -> bool:
        entry = state.get(f)
        if entry and len(unwritten_keys(entry)[0]) < len(entry):
            return True
        # Group fields count unless they are still the template's own objects
        # (DCP replaces every value it loads; some it copies even when not).
        values = list(fields.get(f, {}).values())
        return bool(values) and not any(is_template_value(v) for v in values)

    for opt, group, fqns in targets:
        present = [f for f in fqns if listed(f)]
        if not present:
            aligned.append(None)
            continue
        chosen = next((fields[f] for f in present if f in fields), {})
        for f in present:
            other = fields.get(f)
            if other is not None and other is not chosen and _differs(other, chosen):
                differing = sorted(k for k in set(other) | set(chosen) if _differs(other.get(k), chosen.get(k)))
                msg = f"param_groups fields of {f!r} differ from {present[0]!r} in the same group: {differing}"
                if strict:
                    problems.append(msg)
                break
        aligned.append(({**chosen, "params": present}, present))
    return aligned, state, unknown


def _differs(a, b) -> bool:
    if a is b:
        return False
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() != b.keys() or any(_differs(a[k], b[k]) for k in a)
    try:
        return bool(a != b)
    except Exception:
        return True


def _match_groups(targets, sources) -> list[int | None]:
    """For each target group, the index of its source group (or None)."""
    if len(targets) == len(sources) and all(set(t[2]) == set(s[1]) for t, s in zip(targets, sources)):
        return list(range(len(targets)))
    owner: dict[str, int] = {}
    for j, (_, fqns) in enumerate(sources):
        for f in fqns:
            owner.setdefault(f, j)
    matches: list[int | None] = []
    for _, _, fqns in targets:
        votes = Counter(owner[f] for f in fqns if f in owner)
        matches.append(min(votes, key=lambda j: (-votes[j], j)) if votes else None)
    # Groups without parameters have nothing to match by: they pair up in order.
    empty_t = [i for i, t in enumerate(targets) if not t[2]]
    empty_s = [j for j, s in enumerate(sources) if not s[1]]
    for i, j in zip(empty_t, empty_s):
        matches[i] = j
    return matches


def plan_load(index: ModelIndex, optimizers, osd: Any, *, strict: bool, foreign_ok: bool = False) -> tuple[LoadPlan, list[str]]:
    """Check ``osd`` against the optimizers and describe the load; change nothing.

    ``osd`` is nested or flat; its tensors may be :class:`TensorMeta`
    stand-ins (broadcast loads). FQNs the model does not have are problems
    under ``strict`` unless ``foreign_ok`` (another rank may own them; the
    caller checks). Returns the plan and the problems found.
    """
    problems: list[str] = []
    plan = LoadPlan(optimizers=tuple(optimizers))
    targets = []
    for opt in optimizers:
        for gi, g in enumerate(opt.param_groups):
            unknown = [i for i, p in enumerate(g["params"]) if p not in index.fqn_of]
            if unknown:
                problems.append(f"the optimizer's param_groups[{gi}] holds parameters that are not the model's (positions {unknown})")
                return plan, problems
            targets.append((opt, g, [index.fqn_of[p] for p in g["params"]]))
    flat = is_flat(osd) and bool(osd)
    if flat:
        sources, state, unknown = _from_flat(osd, index, targets, strict, problems)
        matches = list(range(len(targets)))
        plan.foreign = unknown
    else:
        parsed = _source_groups(osd, index, problems)
        if parsed is None:
            return plan, problems
        sources, state = parsed
        sources = [(g, [index.canonical(f) or f for f in fqns]) for g, fqns in sources]
        matches = _match_groups(targets, sources)
        plan.foreign = [f for _, fqns in sources for f in fqns if f not in index.param_of]
        plan.foreign += [f for f in state if isinstance(f, str) and f not in index.param_of]

    # Canonical names of everything the checkpoint lists, and its state by canonical name.
    listed: set[str] = set()
    for src in sources:
        if src is not None:
            listed.update(index.canonical(f) or f for f in src[1])
    by_name: dict[str, dict] = {}
    for fqn, entry in state.items():
        if isinstance(fqn, str) and isinstance(entry, dict):
            canon = index.canonical(fqn)
            if canon is not None and (canon not in by_name or fqn == canon):
                by_name[canon] = entry
    # State that nobody wrote into (a template's placeholders) does not list a parameter.
    listed.update(f for f, e in by_name.items() if len(unwritten_keys(e)[0]) < len(e))
    plan.claimed = {f for f in listed if f in index.param_of}

    if strict:
        required = [f for _, g, fqns in targets for p, f in zip(g["params"], fqns) if p.requires_grad]
        absent = [f for f in required if f not in listed]
        if absent:
            problems.append(f"missing from the checkpoint (strict=True): {absent}")
        if plan.foreign and not foreign_ok:
            problems.append(f"not parameters of the model (strict=True): {sorted(set(plan.foreign))}")

    expectations = {id(opt): _Expectations(opt) for opt in optimizers}
    for (opt, group, fqns), j in zip(targets, matches):
        src = sources[j] if j is not None else None
        if src is not None:
            plan.groups.append((group, {k: v for k, v in src[0].items() if k not in _STRUCTURAL}))
        exp = expectations[id(opt)]
        for p, fqn in zip(group["params"], fqns):
            if fqn not in listed:
                continue  # not in the checkpoint: left as it is
            entry = by_name.get(fqn)
            skip, unknown = unwritten_keys(entry) if entry else (set(), False)
            if entry and has_placeholders(entry):
                plan.questions[fqn] = None if unknown else len(skip) < len(entry)
            written = {k: v for k, v in (entry or {}).items() if k not in skip}
            if entry is not None and not written:
                entry = None  # a template entry nobody filled: as if absent
            if entry is None:
                plan.params.append(ParamLoad(opt, p, fqn, None))
                continue
            expected = exp.of(p)
            if expected and strict:
                lacking = sorted(str(k) for k in expected if k not in written)
                if lacking:
                    problems.append(f"state[{fqn!r}] lacks {lacking} (the optimizer keeps {sorted(map(str, expected))})")
            prepared = {}
            for key, value in written.items():
                prepared[key] = _prepare(value, p, key, group, expected, f"state[{fqn!r}][{key!r}]", problems)
                target = expected.get(key) if expected else None
                if isinstance(prepared[key], Prepared) and _same_layout(target, prepared[key]):
                    prepared[key].dest = target
            plan.params.append(ParamLoad(opt, p, fqn, prepared))
    return plan, problems


# -- applying a load -------------------------------------------------------

def _same_layout(existing, prepared: Prepared) -> bool:
    if not isinstance(existing, torch.Tensor):
        return False
    if isinstance(existing, DTensor) != (prepared.layout is not None):
        return False
    if prepared.layout is not None:
        if (existing.device_mesh, tuple(existing.placements), existing.shape) != (
            prepared.layout.mesh,
            prepared.layout.placements,
            prepared.layout.shape,
        ):
            return False
        existing = _compat.local_tensor(existing)
    return tuple(existing.shape) == prepared.local_shape and existing.dtype == prepared.dtype


def _materialize(prepared: Prepared) -> torch.Tensor:
    if prepared.owned and prepared.local.device == prepared.device:
        local = prepared.local  # delivered for us alone: adopt it
    else:
        local = torch.empty_like(prepared.local, device=prepared.device)
        local.copy_(prepared.local)
    return prepared.layout.wrap(local) if prepared.layout is not None else local


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same view of the same storage (copying is a no-op)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _into(existing: torch.Tensor, prepared: Prepared) -> torch.Tensor:
    local = _compat.local_tensor(existing) if isinstance(existing, DTensor) else existing
    if not same_memory(local, prepared.local):  # a DCP template filled in place needs no copy
        local.copy_(prepared.local)
    return existing


def apply_load(plan: LoadPlan) -> None:
    """Carry out a checked plan: state first, then group fields."""
    for load in plan.params:
        for key, prepared in (load.entry or {}).items():
            if isinstance(prepared, Prepared) and prepared.redistribute is not None:
                moved = prepared.redistribute.redistribute(prepared.layout.mesh, prepared.layout.placements)
                prepared.local = _compat.local_tensor(moved)
    for load in plan.params:
        current = load.opt.state.get(load.param)
        if load.entry is None:
            load.opt.state.pop(load.param, None)
            continue
        new = {}
        for key, value in load.entry.items():
            if isinstance(value, Prepared):
                existing = value.dest if value.dest is not None else (current or {}).get(key)
                new[key] = _into(existing, value) if _same_layout(existing, value) else _materialize(value)
            else:
                new[key] = copy.deepcopy(value)
        if current is None:
            load.opt.state[load.param] = new
        else:
            for key in [k for k in current if k not in new]:
                del current[key]
            current.update(new)
    for group, fields in plan.groups:
        for key, value in fields.items():
            old = group.get(key)
            if isinstance(old, torch.Tensor) and isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
                if not isinstance(value, torch.Tensor) or value.shape == old.shape:
                    old.copy_(value) if isinstance(value, torch.Tensor) else old.fill_(value)
                    continue
            group[key] = _own(value)
