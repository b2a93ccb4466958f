"""ownstack's optimizer state dicts: get and set, nested or flat, sharded or full.

The optimizer keeps plain local blocks as its state (it steps inside
:func:`~.tensor.local_ops`); a get shows each block shaped like its
parameter's as a SplitTensor laid out like the parameter, so that the dict
reads as distributed whatever the optimizer holds. A get never changes the
optimizer: an optimizer that never stepped gives an empty ``state``.

A set checks the whole dict first (structure, names, groups, each entry's
keys, shapes and dtypes), agrees with the other ranks, and only then loads,
through the optimizer's own ``load_state_dict`` inside ``local_ops``. That
method casts state to the parameter's dtype; the stack puts its own copies
(the checkpoint's dtypes) in place afterwards.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from . import flat as flat_layout
from .common import agree, checked, copied, device_of, gathered, group_of, is_root, named_params, offloaded, root_rank
from .groups import pair_groups, shown_names
from .tensor import SplitTensor, cut, local_ops
from .transfer import send_from_root

REFUSED = "__ownstack_refused__"


def _as_list(optimizers) -> list[torch.optim.Optimizer]:
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


class Index:
    """The optimizers' parameters by canonical FQN, and their groups in order (all optimizers, merged)."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]):
        fqn_of = {id(p): fqn for fqn, p in named_params(model)}
        self.optimizers = optimizers
        self.groups: list[tuple[int, dict, list[str]]] = []
        self.param_of: dict[str, nn.Parameter] = {}
        self.opt_of: dict[str, int] = {}
        for oi, opt in enumerate(optimizers):
            for group in opt.param_groups:
                fqns = []
                for p in group["params"]:
                    fqn = fqn_of.get(id(p))
                    if fqn is None:
                        raise ValueError(f"ownstack: optimizer {oi} holds a parameter {p!r} the model does not have")
                    fqns.append(fqn)
                    self.param_of[fqn] = p
                    self.opt_of[fqn] = oi
                self.groups.append((oi, group, fqns))
        self.fqns = [f for _, _, fs in self.groups for f in fs]


def _per_element(value, param) -> bool:
    """Whether ``value`` is shaped like ``param`` (its block, or whole), so distributed like it."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    if isinstance(param, SplitTensor):
        return isinstance(value, SplitTensor) or value.shape in (param._local.shape, param.shape)
    return value.shape == param.shape


def _shown(value, param):
    """A copy of what the optimizer holds, its blocks as SplitTensors laid out like ``param``."""
    if isinstance(value, torch.Tensor) and not isinstance(value, SplitTensor) and isinstance(param, SplitTensor):
        if value.dim() > 0 and value.shape == param._local.shape:
            return SplitTensor(value.detach().clone(), param.mesh, param.placements, param.shape)
    if isinstance(value, dict):
        return {k: _shown(v, param) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_shown(v, param) for v in value)
    return copied(value)


def get_optimizer_state_dict(model: nn.Module, optimizers, *, submodules=None, options=None) -> dict:
    """``{"state": {fqn: {key: value}}, "param_groups": [{"params": [fqn, ...], ...}]}`` (or flat)."""
    options = checked(options)
    index = Index(model, _as_list(optimizers))
    keep = not (options.full_state_dict and options.cpu_offload) or is_root(model)
    state: dict = {}
    for fqn in index.fqns:
        p = index.param_of[fqn]
        entry = index.optimizers[index.opt_of[fqn]].state.get(p)
        if not entry:
            continue
        value = {k: _shown(v, p) for k, v in entry.items()}
        if options.full_state_dict:  # collective: every rank walks the same entries in the same order
            value = gathered(value, options.cpu_offload)
        elif options.cpu_offload:
            value = offloaded(value)
        if keep:
            state[fqn] = value
    if not keep:
        return {}
    groups = [
        {**{k: copied(v) for k, v in g.items() if k != "params"}, "params": list(fs)} for _, g, fs in index.groups
    ]
    out = {"state": state, "param_groups": groups}
    return flat_layout.flatten(out) if options.flatten_optimizer_state_dict else out


# -- set ----------------------------------------------------------------------


def _kinds(index: Index, state: dict) -> tuple[dict, dict, dict]:
    """Per optimizer: the keys the checkpoint's entries have, the keys
    holding tensors and those shaped like their parameter (in the
    checkpoint's entries or the target's own state): what each entry is
    checked against."""
    keys: dict = {}
    tensor_keys: dict = {}
    element_keys: dict = {}

    def note(fqn, entry):
        oi, p = index.opt_of[fqn], index.param_of[fqn]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensor_keys.setdefault(oi, set()).add(key)
                if _per_element(value, p):
                    element_keys.setdefault(oi, set()).add(key)

    for fqn, entry in state.items():
        if fqn in index.param_of and isinstance(entry, dict):
            keys.setdefault(index.opt_of[fqn], set()).update(entry)
            note(fqn, entry)
    for fqn in index.fqns:
        note(fqn, index.optimizers[index.opt_of[fqn]].state.get(index.param_of[fqn], {}))
    return keys, tensor_keys, element_keys


def _taken(where: str, value, param, element: bool):
    """``value`` as the optimizer will hold it for ``param``: a fresh plain
    tensor (this rank's block where it is shaped like the parameter), or a
    copy of any other value. ValueError naming ``where`` if it does not fit."""
    if not isinstance(value, torch.Tensor):
        return copy.deepcopy(value)
    home = param._local.device if isinstance(param, SplitTensor) else param.device
    if isinstance(param, SplitTensor) and isinstance(value, SplitTensor):
        if value.shape != param.shape or value._local.shape != param._local.shape:
            raise ValueError(
                f"ownstack: {where}: a SplitTensor of shape {tuple(value.shape)} (block {tuple(value._local.shape)}) "
                f"where the parameter's is {tuple(param.shape)} (block {tuple(param._local.shape)})"
            )
        local = value._local
    elif isinstance(value, SplitTensor):
        raise ValueError(f"ownstack: {where}: a SplitTensor for a parameter of plain tensors")
    elif isinstance(param, SplitTensor) and value.dim() > 0 and value.shape == param.shape:
        local = cut(value.detach(), param.mesh, param.placements)
    elif _per_element(value, param):
        local = value
    elif element:
        shape = param._local.shape if isinstance(param, SplitTensor) else param.shape
        raise ValueError(f"ownstack: {where}: shape {tuple(value.shape)} where the parameter's is {tuple(shape)}")
    else:
        return value.detach().clone()
    if param.is_floating_point() and not (local.is_floating_point() or local.is_complex()):
        raise ValueError(f"ownstack: {where}: dtype {local.dtype} where the state is floating point")
    return local.detach().to(home, copy=True)


def _entry(fqn: str, entry, param, expected: set, tensor_keys: set, element_keys: set) -> dict:
    """One parameter's state, checked and converted (nested dicts and lists walked)."""
    if not isinstance(entry, dict):
        raise ValueError(f"ownstack: state[{fqn!r}] is a {type(entry).__name__}, expected a dict")
    lacking = sorted(expected - set(entry), key=str)
    if lacking:
        raise ValueError(f"ownstack: the state of {fqn} lacks the keys {lacking} (present: {sorted(entry, key=str)})")
    out = {}
    for key, value in entry.items():
        if key in tensor_keys and not isinstance(value, torch.Tensor):
            raise ValueError(f"ownstack: state[{fqn!r}][{key!r}] is a {type(value).__name__} where a tensor must be")
        out[key] = _walk(f"state[{fqn!r}][{key!r}]", value, param, key in element_keys)
    return out


def _walk(where, value, param, element):
    if isinstance(value, dict):
        return {k: _walk(f"{where}[{k!r}]", v, param, False) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(f"{where}[{i}]", v, param, False) for i, v in enumerate(value))
    return _taken(where, value, param, element)


def _plan(index: Index, osd, strict: bool) -> dict:
    """Everything a load will do, checked: raises ValueError naming what does not fit."""
    if not isinstance(osd, dict) or REFUSED in osd:
        raise ValueError(f"ownstack: {osd.get(REFUSED) if isinstance(osd, dict) else type(osd).__name__}")
    for part, kind in (("state", dict), ("param_groups", list)):
        if not isinstance(osd.get(part), kind):
            raise ValueError(f"ownstack: the optimizer state dict has no {part!r} {kind.__name__}")
    state, ckpt = osd["state"], osd["param_groups"]
    for i, g in enumerate(ckpt):
        if not isinstance(g, dict) or not isinstance(g.get("params"), (list, tuple)):
            raise ValueError(f"ownstack: param_groups[{i}] has no 'params' list")
    known = set(index.param_of)
    listed = [f for g in ckpt for f in g["params"]]
    unknown = list(dict.fromkeys([f for f in listed + list(state) if f not in known]))
    if unknown and strict:
        raise ValueError(f"ownstack: the checkpoint names parameters the optimizers lack: {shown_names(unknown)}")
    missing = [f for f in index.fqns if f not in set(listed)]
    if missing and strict:
        raise ValueError(f"ownstack: the checkpoint has no state or group for {shown_names(missing)} (strict)")
    pairs, problems = pair_groups(index.groups, ckpt, known)
    if problems and strict:
        raise ValueError("ownstack: param groups do not match: " + "; ".join(problems))
    keys, tensor_keys, element_keys = _kinds(index, state)
    entries = {}
    for fqn in dict.fromkeys(listed):
        entry = state.get(fqn)
        if fqn in known and entry is not None and not (isinstance(entry, dict) and not entry):
            oi = index.opt_of[fqn]
            entries[fqn] = _entry(
                fqn,
                state[fqn],
                index.param_of[fqn],
                keys.get(oi, set()),
                tensor_keys.get(oi, set()),
                element_keys.get(oi, set()),
            )
    return {"pairs": pairs, "groups": ckpt, "entries": entries, "missing": set(missing)}


def _load(index: Index, plan: dict) -> None:
    """Load a checked plan into each optimizer (its ``load_state_dict`` inside ``local_ops``)."""
    for oi, opt in enumerate(index.optimizers):
        groups, state, held, n = [], {}, [], 0
        for ti, ci in plan["pairs"]:
            owner, group, fqns = index.groups[ti]
            if owner != oi:
                continue
            fields = {k: v for k, v in group.items() if k != "params"}
            if ci is not None:
                fields.update({k: copied(v) for k, v in plan["groups"][ci].items() if k != "params"})
            groups.append({**fields, "params": list(range(n, n + len(fqns)))})
            for fqn in fqns:
                if fqn in plan["entries"]:
                    state[n] = plan["entries"][fqn]
                    held.append((index.param_of[fqn], plan["entries"][fqn]))
                n += 1
        kept = {p: opt.state[p] for p in opt.state if any(p is index.param_of[f] for f in plan["missing"])}
        with torch.no_grad(), local_ops():
            opt.load_state_dict({"state": state, "param_groups": groups})
        for p, entry in held:  # the checkpoint's own dtypes, not the parameter's
            opt.state[p] = entry
        for p, entry in kept.items():  # parameters the checkpoint has nothing for keep what they had
            opt.state[p] = entry


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict, *, options=None) -> None:
    """Load ``optim_state_dict`` (nested or flat, sharded or full) into ``optimizers``."""
    options = checked(options)
    index = Index(model, _as_list(optimizers))
    osd, error, plan = optim_state_dict, None, None
    if options.broadcast_from_rank0:
        osd = _received(model, index, osd, options)
    try:
        if options.flatten_optimizer_state_dict and not options.broadcast_from_rank0:
            osd = flat_layout.unflatten(osd, index.groups, options.strict)
        plan = _plan(index, osd, options.strict)
    except (ValueError, TypeError, KeyError) as exc:
        error = exc if isinstance(exc, ValueError) else ValueError(f"ownstack: malformed optimizer state dict: {exc!r}")
    agree(model, error)
    _load(index, plan)


def _received(model, index: Index, osd, options):
    """The root's dict (made nested there) on every rank, per-element state scattered as blocks."""
    group, size = group_of(model)
    if is_root(model) and options.flatten_optimizer_state_dict:
        try:
            osd = flat_layout.unflatten(osd, index.groups, options.strict)
        except ValueError as exc:
            osd = {REFUSED: str(exc)}
    if size == 1:
        return osd

    def target_of(path, slot):
        if len(path) == 3 and path[0] == "state":
            p = index.param_of.get(path[1])
            return p if isinstance(p, SplitTensor) else None
        return None

    return send_from_root(osd, src=root_rank(model), group=group, device=device_of(model), target_of=target_of)
