"""The adapter that lets the conformance suite certify ``ownstack``, a stack with its own tensors.

Run the suite against it with::

    python -m conformance --impl conformance.examples.ownstack_adapter

``ownstack`` (:mod:`conformance.examples.ownstack`) stands in for a vendor's
stack: its distributed tensor is not torch's DTensor, its mesh and
placements are its own, torch operations on its tensors are refused outside
its dispatch context, and its optimizer keeps plain local blocks. Its
state-dict functions have torch's names and signatures, so they go to the
suite as they are (``functions_are_iut``). What the adapter adds is how the
suite meets the stack:

* ``tensors``: how the suite reads a SplitTensor (its block, global shape,
  placements as torch's placement types, mesh as a description, its full
  tensor), makes one (``like``, ``from_torch``), and reads the plain blocks
  the optimizer holds as distributed like their parameter (``held``);
* ``training``: the stack's dispatch context, which the suite enters where it
  builds optimizers, trains, steps or loads the model's own ``state_dict``;
* ``mesh``: the stack builds its own mesh from the suite's description, and
  ``shard`` is its own ``fully_shard``;
* ``save_checkpoint`` / ``load_checkpoint``: the ``dcp`` mode goes through
  the stack's own checkpoint format instead of torch.distributed.checkpoint.

It declares data parallelism only (single, ddp, fsdp, hsdp: no extra
layout capability) and every mode.
"""

from __future__ import annotations

import torch
from torch.distributed import tensor as torch_tensor

from conformance.adapters import Adapter
from conformance.tensors import MeshDescription, TensorProtocol

from . import ownstack
from .ownstack import checkpoint
from .ownstack import state_dict as dsd


def _to_torch(place):
    if isinstance(place, ownstack.Shard):
        return torch_tensor.Shard(place.dim)
    if isinstance(place, ownstack.Replicate):
        return torch_tensor.Replicate()
    raise ValueError(f"ownstack has no placement {place!r}")


def _from_torch(place):
    if isinstance(place, torch_tensor.Shard):
        return ownstack.Shard(place.dim)
    if isinstance(place, torch_tensor.Replicate):
        return ownstack.Replicate()
    raise ValueError(f"ownstack cannot hold a value placed {place!r} (only Shard and Replicate)")


class OwnStackTensors(TensorProtocol):
    """ownstack's :class:`~conformance.examples.ownstack.SplitTensor`, as the suite reads it."""

    name = "SplitTensor"

    def is_distributed(self, value) -> bool:
        return isinstance(value, ownstack.SplitTensor)

    def local(self, value) -> torch.Tensor:
        return value.to_local()

    def global_shape(self, value) -> torch.Size:
        return torch.Size(value.shape)

    def placements(self, value) -> tuple:
        return tuple(_to_torch(p) for p in value.placements)

    def mesh(self, value) -> MeshDescription:
        m = value.mesh
        return MeshDescription(m.ranks, m.shape, m.dim_names, m.device_type)

    def full(self, value) -> torch.Tensor:
        return value.full_tensor()

    def like(self, value, local: torch.Tensor, shape=None):
        return ownstack.SplitTensor(local, value.mesh, value.placements, value.shape if shape is None else shape)

    def from_torch(self, dtensor):
        mesh = ownstack.Mesh.from_description(MeshDescription.of(dtensor.device_mesh))
        placements = tuple(_from_torch(p) for p in dtensor.placements)
        return ownstack.SplitTensor.from_local(dtensor.to_local(), mesh, placements, dtensor.shape)

    def held(self, value, param):
        """The optimizer keeps plain blocks: one shaped like a SplitTensor parameter's block is distributed like it."""
        if (
            isinstance(param, ownstack.SplitTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, ownstack.SplitTensor)
            and value.dim() > 0
            and value.shape == param.to_local().shape
        ):
            return self.like(param, value)
        return value


def shard(module, *, mesh, **policy):
    """ownstack's ``fully_shard``, ``reshard_after_forward=False`` unless a policy says otherwise (as the suite's)."""
    return ownstack.fully_shard(module, mesh=mesh, **{"reshard_after_forward": False, **policy})


conformance_adapter = Adapter(
    name="ownstack-example",
    version="1.0",
    get_model_state_dict=dsd.get_model_state_dict,
    set_model_state_dict=dsd.set_model_state_dict,
    get_optimizer_state_dict=dsd.get_optimizer_state_dict,
    set_optimizer_state_dict=dsd.set_optimizer_state_dict,
    get_state_dict=dsd.get_state_dict,
    set_state_dict=dsd.set_state_dict,
    options=dsd.StateDictOptions,
    functions_are_iut=True,
    shard=shard,
    layouts=frozenset(),
    modes=frozenset({"sharded", "full", "full_cpu", "bcast", "file", "flat", "dcp"}),
    tensors=OwnStackTensors(),
    training=ownstack.local_ops,
    mesh=ownstack.Mesh.from_description,
    save_checkpoint=checkpoint.save,
    load_checkpoint=checkpoint.load,
)
