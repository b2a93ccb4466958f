"""An adapter for mindspore-ai/hyper-parallel: a vendor stack with tensors of its own (SPEC 1.6).

Where hyper_parallel is installed (its torch platform)::

    HYPER_PARALLEL_PLATFORM=torch python -m conformance --impl conformance.examples.hyper_parallel_adapter

hyper_parallel is not a dependency: it is imported when the suite asks for the adapter
(:func:`conformance_adapter`), which says so where it is missing. What it tells the suite:

* ``tensors``: its own ``DTensor`` (not torch's, nor a subclass), read through
  :class:`HyperParallelTensors`, its placements mapped to torch's by type and
  field. Its optimizers keep plain local shards of a sharded parameter:
  ``held`` reads them as distributed like the parameter.
* ``training``: its ``SkipDTensorDispatch``, the context its optimizers step
  and load in (plain torch ops on its tensors raise outside it). It does not
  nest; the suite enters it around single operations only.
* ``mesh``: its ``DeviceMesh``, built from the suite's description.
* ``shard``: its ``fully_shard`` with ``reshard_after_forward=False`` (its backward
  fails on the CPU when resharding after forward); no policies. Uneven shards it
  refuses itself (NotImplementedError: the case is n/a).
* the four functions: its ``get_model_state_dict``, ``set_model_state_dict``,
  ``get_optim_state_dict`` and ``set_optim_state_dict``, looked up where its
  releases keep them (:data:`PLACES`); one that a release lacks is refused.
  The optimizer functions take one optimizer: several are refused.
  ``set_optim_state_dict`` runs inside ``SkipDTensorDispatch``, as its
  documentation requires.
* ``save_checkpoint``/``load_checkpoint``: its own checkpoint module (the ``dcp`` mode).
Declared: data parallelism only (no layout capability); get in sharded, full,
full_cpu and flat; load in sharded, full, file, flat and dcp. Its loads refuse
``broadcast_from_rank0`` (NotImplementedError): no ``full_cpu`` or ``bcast`` load.
"""

from __future__ import annotations

import importlib
import os

import torch
import torch.distributed as dist

from conformance.adapters import Adapter, AdapterError, iut_call, not_supported
from conformance.tensors import MeshDescription, TensorProtocol

from . import _compat

# Where hyper_parallel's releases keep the state-dict functions, newest first.
PLACES = (
    "hyper_parallel.core.fully_shard.state_dict_utils",
    "hyper_parallel.core.distributed_checkpoint.state_dict",
    "hyper_parallel.core.fully_shard.api",
)
# Its checkpoint module (save; a load that fills a template), newest first.
CHECKPOINTS = ("hyper_parallel.core.distributed_checkpoint", "hyper_parallel.core.checkpoint")
# Its tensor modules moved from flat modules into a package ``core.dtensor``.
TENSOR_MODULES = ("hyper_parallel.core.dtensor.dtensor", "hyper_parallel.core.dtensor", "hyper_parallel")
PLACEMENT_MODULES = ("hyper_parallel.core.dtensor.placement_types", "hyper_parallel.core.placement_types")


def _module(name: str):
    """``name`` imported, or None where this release has no such module."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            return None
        raise


def _first(modules: tuple[str, ...], attr: str, required: bool = False):
    """``attr`` of the first of ``modules`` that has it (None, or AdapterError where ``required``)."""
    for name in modules:
        mod = _module(name)
        if mod is not None and hasattr(mod, attr):
            return getattr(mod, attr)
    if required:
        raise AdapterError(f"hyper_parallel has no {attr} in {', '.join(modules)}")
    return None


class HyperParallelTensors(TensorProtocol):
    """hyper_parallel's ``DTensor`` as the suite reads it (SPEC 1.6)."""

    name = "hyper_parallel DTensor"

    def __init__(self, build_mesh):
        self._cls = _first(TENSOR_MODULES, "DTensor", required=True)
        self._own = {n: _first(PLACEMENT_MODULES, n, required=True) for n in ("Shard", "Replicate", "Partial")}
        self._build_mesh = build_mesh

    def is_distributed(self, value) -> bool:
        return isinstance(value, self._cls)

    def local(self, value) -> torch.Tensor:
        return value.to_local()

    def global_shape(self, value) -> torch.Size:
        return torch.Size(value.shape)  # its class derives it from the local shape and the mesh

    def placements(self, value) -> tuple:
        from torch.distributed import tensor as dt

        return tuple(self._mapped(p, self._own, vars(dt)) for p in value.placements)

    @staticmethod
    def _mapped(p, source: dict, target: dict):
        """Placement ``p`` (a class of ``source``) as the same kind of ``target``, by type and field."""
        if isinstance(p, source["Shard"]):
            return target["Shard"](p.dim)
        if isinstance(p, source["Replicate"]):
            return target["Replicate"]()
        if isinstance(p, source["Partial"]):
            return target["Partial"](p.reduce_op)
        raise TypeError(f"placement {p!r} has no counterpart")

    def mesh(self, value) -> MeshDescription:
        mesh = value.device_mesh
        ranks = torch.as_tensor(mesh.mesh)
        names = tuple(mesh.mesh_dim_names or (f"dim{i}" for i in range(ranks.dim())))
        return MeshDescription(tuple(ranks.flatten().tolist()), tuple(ranks.shape), names, mesh.device_type)

    def full(self, value) -> torch.Tensor:
        return value.full_tensor()

    def like(self, value, local, shape=None):
        # Its class holds no global shape of its own: it derives one from the local
        # shape, which is ``shape`` where the suite grows a value evenly (all it does).
        return self._cls.from_local(local, value.device_mesh, value.placements)

    def from_torch(self, dtensor):
        from torch.distributed import tensor as dt

        mesh = self._build_mesh(MeshDescription.of(dtensor.device_mesh))
        placements = [self._mapped(p, vars(dt), self._own) for p in dtensor.placements]
        return self._cls.from_local(dtensor.to_local(), mesh, placements)

    def held(self, value, param):
        """A plain tensor of the parameter's local shape (not ``step``) reads as distributed like it."""
        plain = isinstance(value, torch.Tensor) and not self.is_distributed(value) and value.dim() > 0
        if plain and self.is_distributed(param) and value.shape == param.to_local().shape:
            return self.like(param, value)
        return value


def _one(optimizers):
    if isinstance(optimizers, torch.optim.Optimizer):
        return optimizers
    optimizers = list(optimizers)
    if len(optimizers) != 1:
        raise not_supported(f"several optimizers (hyper_parallel's functions take one; {len(optimizers)} given)")
    return optimizers[0]


def _whole_world(process_group) -> None:
    if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
        raise not_supported("a checkpoint of part of the world (its save and load take no process group)")


class _Stack:
    """hyper_parallel's pieces the adapter calls, found in the installed release."""

    def __init__(self):
        names = ("get_model_state_dict", "set_model_state_dict", "get_optim_state_dict", "set_optim_state_dict")
        self.found = {f: _first(PLACES, f) for f in names}
        self.skip = _first(TENSOR_MODULES, "SkipDTensorDispatch", required=True)
        self.device_mesh = _first(("hyper_parallel.core.dtensor.device_mesh", "hyper_parallel"), "DeviceMesh", True)
        self.fully_shard = _first(("hyper_parallel.core.fully_shard.api", "hyper_parallel"), "fully_shard", True)
        self.ckpt = next((m for m in map(_module, CHECKPOINTS) if m is not None and hasattr(m, "load")), None)
        self.meshes: dict = {}

    def build_mesh(self, d: MeshDescription):
        """Its DeviceMesh for ``d``, built once per description and default process
        group. The suite's ranks re-create the default group between worlds; its
        DeviceMesh keeps the groups it made in a process-wide map, which then
        holds destroyed groups: they are forgotten when the default group changes."""
        world = dist.group.WORLD
        if self.meshes.get("world") is not world:
            self.meshes.clear()
            self.meshes["world"] = world
            _compat.forget_hyper_parallel_groups(self.device_mesh)
        if d not in self.meshes:
            ranks = torch.tensor(d.ranks, dtype=torch.int64).reshape(d.shape)
            self.meshes[d] = self.device_mesh(d.device_type, ranks, mesh_dim_names=d.dim_names)
        return self.meshes[d]

    def fn(self, name: str):
        if self.found[name] is None:
            raise not_supported(f"{name} (absent from this hyper_parallel release)")
        return self.found[name]

    def shard(self, module, *, mesh, **policy):
        if policy:
            raise not_supported(f"fully_shard policies {sorted(policy)}")
        return self.fully_shard(module, mesh=mesh, reshard_after_forward=False)

    def get_model_state_dict(self, model, *, options=None):
        fn = self.fn("get_model_state_dict")
        with iut_call():
            return fn(model, options=options)

    def set_model_state_dict(self, model, model_state_dict, *, options=None):
        fn = self.fn("set_model_state_dict")
        with iut_call():
            return fn(model, model_state_dict, options=options)

    def get_optimizer_state_dict(self, model, optimizers, *, options=None):
        fn, optimizer = self.fn("get_optim_state_dict"), _one(optimizers)
        with iut_call():
            return fn(model, optimizer, options=options)

    def set_optimizer_state_dict(self, model, optimizers, optim_state_dict, *, options=None):
        fn, optimizer = self.fn("set_optim_state_dict"), _one(optimizers)
        with iut_call(), self.skip():  # its optimizer loads only under its own dispatch rules
            fn(model, optimizer, optim_state_dict, options=options)

    def save_checkpoint(self, state_dict, *, checkpoint_id, process_group=None):
        _whole_world(process_group)
        with iut_call():
            self.ckpt.save(state_dict, checkpoint_id=checkpoint_id)

    def load_checkpoint(self, state_dict, *, checkpoint_id, process_group=None):
        _whole_world(process_group)
        with iut_call():
            self.ckpt.load(state_dict, checkpoint_id=checkpoint_id)
        return state_dict


def conformance_adapter() -> Adapter:
    """The adapter, where hyper_parallel is installed."""
    os.environ.setdefault("HYPER_PARALLEL_PLATFORM", "torch")
    try:
        import hyper_parallel
    except ImportError as exc:
        raise AdapterError(f"hyper_parallel is not installed ({exc}); install it to certify it") from exc
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    stack = _Stack()
    own_checkpoint = stack.ckpt is not None
    gets = {"sharded", "full", "full_cpu"} | ({"flat"} if stack.found["get_optim_state_dict"] else set())
    loads = {"sharded", "full", "file"} | ({"flat"} if stack.found["set_optim_state_dict"] else set())
    loads |= {"dcp"} if own_checkpoint else set()
    return Adapter(
        name="hyper-parallel",
        version=str(getattr(hyper_parallel, "__version__", "unknown")),
        get_model_state_dict=stack.get_model_state_dict,
        set_model_state_dict=stack.set_model_state_dict,
        get_optimizer_state_dict=stack.get_optimizer_state_dict,
        set_optimizer_state_dict=stack.set_optimizer_state_dict,
        options=StateDictOptions,
        shard=stack.shard,
        get_modes=frozenset(gets),
        load_modes=frozenset(loads),
        layouts=frozenset(),
        tensors=HyperParallelTensors(stack.build_mesh),
        training=stack.skip,
        mesh=stack.build_mesh,
        save_checkpoint=stack.save_checkpoint if own_checkpoint else None,
        load_checkpoint=stack.load_checkpoint if own_checkpoint else None,
    )
