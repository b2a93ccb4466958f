"""ownstack's fully_shard: data parallelism with each parameter split over a mesh.

Called on each block, then on the root, as FSDP is: each call takes the
parameters of its module's subtree that no earlier call took (a *unit*) and
replaces each by an ``nn.Parameter`` holding a :class:`~.tensor.SplitTensor`,
in every place the parameter appears (a weight tied between two modules
stays one parameter). Buffers stay plain tensors, the same on every rank.

Around the unit's forward, a pre-hook gathers its parameters into full plain
tensors through one autograd function and lays each over its parameter as
an instance attribute of every module that holds it (the registered
parameter stays where it is: ``named_parameters()`` and ``state_dict()``
see SplitTensors at all times). The full tensors stay until the unit's
backward, which activation checkpointing needs (it runs the forward again
inside the backward), or go right after a forward that no backward follows
(grad disabled). The autograd function's backward averages each full
gradient over every rank of the mesh (each rank trained on its own rows of
the batch), cuts this rank's block and adds it to ``param.grad``, a
SplitTensor laid out like the parameter. It sets the gradient itself and
hands autograd nothing, so autograd never computes with a SplitTensor. A
parameter whose full tensor got no gradient keeps ``grad is None``. One
all-reduce gives every rank the same sum, so two identical runs end bitwise
equal.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .tensor import Replicate, Shard, SplitTensor, cut, distribute, local_ops


def default_placements(mesh) -> tuple:
    """``(Shard(0),)`` on a 1-D mesh; replicated over every dimension but the
    last and sharded over the last on a larger one (HSDP's ``(Replicate(), Shard(0))``)."""
    return tuple(Replicate() for _ in range(mesh.ndim() - 1)) + (Shard(0),)


class _Unit:
    """The parameters one ``fully_shard`` call took, and every (module, name) where each appears."""

    def __init__(self, mesh, params: list[nn.Parameter], slots: list[list[tuple[nn.Module, str]]]):
        self.mesh = mesh
        self.params = params
        self.slots = slots
        self.pending = False  # full tensors in the slots, waiting for the backward

    def gather(self, module, args):
        """Forward pre-hook: the full tensors take the parameters' places."""
        if not self.params:
            return None
        fulls = _Gather.apply(self, *self.params)
        if isinstance(fulls, torch.Tensor):
            fulls = (fulls,)
        for full, slots in zip(fulls, self.slots):
            for owner, name in slots:
                # An instance attribute shadows the registered parameter: the
                # forward reads the full tensor while ``named_parameters()``
                # and ``state_dict()`` still see the SplitTensor parameter.
                vars(owner)[name] = full
        return None

    def restore(self, module, args, output):
        """Forward hook: the SplitTensor parameters back in their places, unless
        a backward is to come (grad enabled and a parameter that trains): then
        the full tensors stay until the unit's backward, so that activation
        checkpointing, which runs the forward again inside the backward,
        computes with the very tensors the forward did."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.params):
            self.pending = True
        else:
            self.put_back()
        return None

    def put_back(self) -> None:
        self.pending = False
        for slots in self.slots:
            for owner, name in slots:
                vars(owner).pop(name, None)


class _Gather(torch.autograd.Function):
    """Full tensors of a unit's parameters; backward: averaged gradients, cut, into ``param.grad``."""

    @staticmethod
    def forward(ctx, unit: _Unit, *params):
        ctx.unit = unit
        fulls = tuple(p.full_tensor() for p in params)
        frozen = [f for p, f in zip(params, fulls) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        ctx.set_materialize_grads(False)
        return fulls

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit
        mesh = unit.mesh
        with torch.no_grad(), local_ops():
            for param, grad in zip(unit.params, grads):
                if grad is None or not param.requires_grad:
                    continue
                grad = grad.detach().contiguous().clone()
                if mesh.whole_group() is not None:
                    dist.all_reduce(grad, group=mesh.whole_group())
                    grad.div_(mesh.size())
                block = cut(grad, mesh, param.placements)
                if param.grad is None:
                    param.grad = SplitTensor(block, mesh, param.placements, param.shape)
                else:
                    param.grad._local.add_(block)
        unit.put_back()
        return (None,) * (1 + len(grads))


def _unclaimed(module: nn.Module) -> tuple[list[nn.Parameter], list[list[tuple[nn.Module, str]]]]:
    """The subtree's parameters no earlier call took (plain ones), each with every place it appears."""
    order: list[nn.Parameter] = []
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            if isinstance(param, SplitTensor):
                continue
            if id(param) not in slots:
                order.append(param)
                slots[id(param)] = []
            slots[id(param)].append((sub, name))
    return order, [slots[id(p)] for p in order]


def fully_shard(module: nn.Module, *, mesh, reshard_after_forward=True, **ignored_policy) -> nn.Module:
    """Shard ``module``'s parameters that no inner call took over ``mesh``.

    ``reshard_after_forward`` is accepted and has no effect: the full
    tensors always last from a forward to its backward (one all-gather per
    unit and step), and are dropped after a forward no backward follows.
    Other policy arguments (mixed precision, offload) are ignored. Returns
    ``module``."""
    if mesh.coordinate() is None:
        raise ValueError(f"ownstack.fully_shard: this rank is not on {mesh}")
    placements = default_placements(mesh)
    params, slots = _unclaimed(module)
    sharded = []
    for param, places in zip(params, slots):
        split = nn.Parameter(distribute(param.detach(), mesh, placements), requires_grad=param.requires_grad)
        for owner, name in places:
            setattr(owner, name, split)
        sharded.append(split)
    unit = _Unit(mesh, sharded, slots)
    module.register_forward_pre_hook(unit.gather)
    module.register_forward_hook(unit.restore)
    units = module.__dict__.setdefault("_ownstack_units", [])
    units.append(unit)
    return module


def units_of(model: nn.Module) -> list[_Unit]:
    """Every unit under ``model``, inner ones first."""
    return [u for sub in model.modules() for u in sub.__dict__.get("_ownstack_units", ())]


def settle(model: nn.Module) -> None:
    """Drop the full tensors a forward left for a backward that has not come
    (or never will: a forward whose loss was dropped), so that no stale copy
    outlives a load; the next forward gathers the loaded values afresh."""
    for unit in units_of(model):
        if unit.pending:
            unit.put_back()


def _device_for(mesh) -> torch.device:
    if mesh is None or mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def materialize(model: nn.Module) -> None:
    """Give every parameter and buffer still on the meta device storage of
    its own (uninitialised), on its mesh's device, so that a load can fill
    it: a model built on the meta device and sharded loads full dicts. A
    parameter is replaced by a new one in every place it appears."""
    units = units_of(model)
    mesh = units[0].mesh if units else None
    for unit in units:
        for i, param in enumerate(unit.params):
            if param._local.device.type != "meta":
                continue
            local = torch.empty(param._local.shape, dtype=param.dtype, device=_device_for(unit.mesh))
            fresh = nn.Parameter(SplitTensor(local, unit.mesh, param.placements, param.shape), param.requires_grad)
            unit.params[i] = fresh
            for owner, name in unit.slots[i]:
                setattr(owner, name, fresh)
    for sub in model.modules():
        for name, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
            if not isinstance(param, SplitTensor) and param.device.type == "meta":
                fresh = torch.empty_like(param, device=_device_for(mesh))
                setattr(sub, name, nn.Parameter(fresh, param.requires_grad))
        for name, buf in list(sub.named_buffers(recurse=False, remove_duplicate=False)):
            if buf.device.type == "meta":
                setattr(sub, name, torch.zeros_like(buf, device=_device_for(mesh)))
