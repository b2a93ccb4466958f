"""Every private torch API hyperdsd touches, in one place.

When a torch upgrade moves one of these, this file is the one to fix. Each
entry says why no public API does the job.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import operator
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor is its own."""
    # ``to_local()`` goes through autograd when grad mode is on; the wrapped
    # tensor itself is what DCP reads and writes in place.
    return t._local_tensor if isinstance(t, DTensor) else t


def detached(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()``: the same data, version counter and layout, without autograd."""
    # DTensor.detach() goes through DTensor's op dispatcher (about 8 us a
    # tensor); the private constructor with the same spec makes the same
    # DTensor around the detached local tensor directly. ``__new__`` alone:
    # DTensor's ``__init__`` does nothing but costs two decorator layers
    # (dynamo's and export's), more than half of the rest.
    if type(t) is DTensor:
        return DTensor.__new__(DTensor, t._local_tensor.detach(), t._spec, requires_grad=False)
    return t.detach()


# An object that stands for a DTensor's mesh, placements, global shape, stride
# and dtype, shared by DTensors laid out alike: its spec. Planning a load checks
# each value's layout against its parameter's; tens of thousands of small
# tensors share a handful of specs (FSDP2 and the ops that make state reuse
# them), so the checks run once per distinct spec. A plan keys by the specs'
# identity only while the tensors holding them are alive. An attrgetter: called
# several times per value, a Python function's call cost more than the lookup.
layout_token: Callable[[DTensor], object] = operator.attrgetter("_spec")


# A DTensor's local tensor, for code that knows it holds a DTensor (see local_tensor).
dtensor_local: Callable[[DTensor], torch.Tensor] = operator.attrgetter("_local_tensor")


def version_of(t: torch.Tensor) -> int:
    # The in-place version counter is how we know whether anyone (DCP) wrote
    # into a placeholder tensor; there is no public accessor.
    return local_tensor(t)._version


def child_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module | None]:
    # ``named_children()`` yields a module registered under two names once;
    # canonical FQNs need every name, and a dict lookup per child.
    return module._modules


def own_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter | None]:
    # ``named_parameters(recurse=False, remove_duplicate=False)`` gives the
    # same entries through a generator per module; the index reads thousands.
    return module._parameters


def own_buffers(module: torch.nn.Module) -> tuple[dict[str, torch.Tensor | None], set[str]]:
    """A module's own buffers, and the names of those not in its state dict."""
    # As own_parameters: ``named_buffers`` goes through a generator per module,
    # and tells nothing of persistence.
    return module._buffers, module._non_persistent_buffers_set


_FSDP_RESHARD_HOOK = "FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook"


@contextlib.contextmanager
def fsdp2_reshard_hooks_off(model: torch.nn.Module):
    """``model.state_dict()`` without FSDP2's pre-hook, which reshards the
    modules a forward left unsharded: a get reads the sharded parameters from
    FSDP2's groups instead and leaves the modules as it found them."""
    # The hook registries are private to nn.Module; the hooks are put back in
    # their order.
    saved = []
    for module in model.modules():
        hooks = module._state_dict_pre_hooks
        if any(getattr(h, "__qualname__", None) == _FSDP_RESHARD_HOOK for h in hooks.values()):
            saved.append((hooks, list(hooks.items())))
            for key in [k for k, h in hooks.items() if getattr(h, "__qualname__", None) == _FSDP_RESHARD_HOOK]:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


@functools.cache
def _fsdp2_class() -> type:
    # Imported once: the index asks every module of a large model.
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def fsdp2_sharded_params(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
    """(module, attribute name, sharded parameter) for each parameter that
    ``module``'s FSDP2 state manages and that is registered as something else
    now: the unsharded parameter after a forward that left it unsharded
    (``reshard_after_forward=False`` or an int, an explicit ``unshard()``).

    The optimizer steps the sharded parameters wherever the module's
    attributes point; FSDP2 says where they are only through its parameter
    groups (``state_dict()``'s pre-hook finds them by resharding, which a get
    must not do)."""
    if not isinstance(module, _fsdp2_class()):
        return []
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # a list in newer torch, one group before
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    found = []
    for group in groups:
        for fsdp_param in group.fsdp_params:
            info, sharded = fsdp_param._module_info, fsdp_param.sharded_param
            places = [(info.module, info.param_name)]
            places += list(zip(info.shared_modules, info.shared_param_names))
            for owner, name in places:
                if owner._parameters.get(name) is not sharded:
                    found.append((owner, name, sharded))
    return found


def module_state_hooks(module: torch.nn.Module) -> list[Callable] | None:
    """The pre-hooks to run before reading ``module``'s own state straight
    from its ``_parameters`` and ``_buffers``; None when ``state_dict()``
    could give anything else (overridden, extra state, other hooks)."""
    # ``model.state_dict()`` is a recursive call, a hook loop and a dict per
    # module: a fifth of a sharded get on a model of small layers. Hook
    # registries and the extra-state protocol are private to nn.Module; the
    # only hook allowed is FSDP2's, which reshards the module's group.
    cls = type(module)
    if cls not in _PLAIN_MODULE_CLASSES:
        _PLAIN_MODULE_CLASSES[cls] = (
            cls.state_dict is torch.nn.Module.state_dict
            and cls._save_to_state_dict is torch.nn.Module._save_to_state_dict
            and cls.get_extra_state is torch.nn.Module.get_extra_state
        )
    if not _PLAIN_MODULE_CLASSES[cls] or module._state_dict_hooks:
        return None
    hooks = list(module._state_dict_pre_hooks.values())
    for hook in hooks:
        if getattr(hook, "__qualname__", None) != _FSDP_RESHARD_HOOK:
            return None
    return hooks


_PLAIN_MODULE_CLASSES: dict[type, bool] = {}

# FSDP2's load hooks: before, the module's group resharded (as before a read);
# after, each sharded parameter re-padded if loading replaced its local tensor.
_FSDP_LOAD_HOOKS = (_FSDP_RESHARD_HOOK, "FSDPParam.__init__.<locals>.<lambda>")


def loads_plainly(module: torch.nn.Module) -> bool:
    """Whether ``load_state_dict`` would do no more for ``module``'s own
    parameters and buffers than copy each value into its tensor, so that a
    value of the tensor's layout and dtype may be copied in directly."""
    # ``model.load_state_dict`` hands each child the entries under its prefix,
    # filtered from its parent's: every key is tested once per sibling of each
    # module above it, thousands of times on a module with thousands of
    # children. Load hooks and ``_load_from_state_dict`` are private to
    # nn.Module. FSDP2's hooks do nothing to a copy made in place into the
    # sharded parameter (the plan reads the model resharded, and the local
    # tensor is kept).
    if (
        type(module)._load_from_state_dict is not torch.nn.Module._load_from_state_dict
        or "_load_from_state_dict" in module.__dict__  # patched on the instance
    ):
        return False
    for hooks in (module._load_state_dict_pre_hooks, module._load_state_dict_post_hooks):
        for hook in hooks.values():
            if getattr(hook, "__qualname__", None) not in _FSDP_LOAD_HOOKS:
                return False
    return True


def loads_by_copying(model: torch.nn.Module) -> bool:
    """Whether ``model.load_state_dict`` itself, not overridden, copies values
    into the tensors (swapping tensors, when torch is told to, runs each
    parameter's own ``module_load``)."""
    return (
        type(model).load_state_dict is torch.nn.Module.load_state_dict
        and "load_state_dict" not in model.__dict__
        and not torch.__future__.get_swap_module_params_on_conversion()
    )


def plain_state_dict(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.state_dict()`` would only repackage ``opt.state`` and
    ``opt.param_groups`` (not overridden, no state-dict hooks registered)."""
    # Then the state is read in place: state_dict()'s packing (a dict by
    # integer id, a copy of every group) is a tenth of a get on a model of
    # small tensors. Registration of the hooks is public, the registry not.
    return (
        getattr(type(opt), "state_dict", None) is torch.optim.Optimizer.state_dict
        and not getattr(opt, "_optimizer_state_dict_pre_hooks", None)
        and not getattr(opt, "_optimizer_state_dict_post_hooks", None)
    )


class LoadHooks(NamedTuple):
    pre: list[Callable]
    post: list[Callable]


def optimizer_load_hooks(opt: torch.optim.Optimizer) -> LoadHooks:
    # Optimizer.load_state_dict replays these; loading in place means we
    # replay them ourselves (registration is public, the registry is not).
    pre = list(getattr(opt, "_optimizer_load_state_dict_pre_hooks", {}).values())
    post = list(getattr(opt, "_optimizer_load_state_dict_post_hooks", {}).values())
    return LoadHooks(pre, post)


def unhooked_step(opt_class: type) -> Callable:
    # Optimizer patches ``step`` at class level with a wrapper that runs the
    # instance's and the global step hooks; a scratch step must not run them.
    step = opt_class.step
    if getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        return step.__wrapped__
    return step


def is_compiled_module(module: torch.nn.Module) -> bool:
    # Checked by name: importing torch._dynamo costs a second of start-up.
    return type(module).__name__ == "OptimizedModule" and "_orig_mod" in module._modules


@functools.cache
def _fsdp1_class() -> type:
    # Imported once: an import statement per module of a large model is measurable.
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def is_fsdp1(module: torch.nn.Module) -> bool:
    return isinstance(module, _fsdp1_class())


FSDP1_WRAPPED = "_fsdp_wrapped_module"  # the child FSDP1 hides from state-dict keys


class Fsdp1Unit(NamedTuple):
    """One FSDP1 instance's FlatParameter, as plain facts (see :func:`fsdp1_unit`)."""

    module: torch.nn.Module  # the FSDP1 instance
    flat: torch.nn.Parameter  # what the optimizer steps with use_orig_params=False
    local: torch.Tensor  # the padded local shard, where the values live even while FSDP1 holds them unsharded
    unsharded: bool  # FSDP1 keeps an unsharded copy to reuse (a forward of SHARD_GRAD_OP left it)
    names: tuple[str, ...]  # each original parameter's name below the wrapped module, raw
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]  # where each starts in the padded unsharded flat parameter
    shared: tuple[tuple[str, int], ...]  # (raw name below the wrapped module, index of the parameter it ties)
    in_shard: tuple[tuple[int, int] | None, ...]  # each parameter's (offset, numel) in the local shard, if any
    params: tuple | None  # the original parameters the optimizer steps (use_orig_params=True), else None
    pg: Any  # the group the flat parameter is sharded over
    mesh: Any  # the DeviceMesh FSDP1 was given (None: a process group)
    replicate_pg: Any  # HYBRID_SHARD: the group across the replicas; else None
    sharded: bool  # False for NO_SHARD


def fsdp1_unit(module: torch.nn.Module) -> Fsdp1Unit | None:
    """The FlatParameter of one FSDP1 instance (None if it manages none).

    FSDP1 keeps the layout of its flat parameters (original names, shapes,
    offsets with padding, ties) in private attributes of FlatParameter and
    its handle; its public state-dict paths need the unsharding it does
    itself, one all-gather of a whole unit per rank. Read here once per call.
    """
    handle = module._handle
    if handle is None:
        return None
    flat = handle.flat_param
    starts, offset = [], 0
    for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not padding:
            starts.append(offset)
        offset += numel
    prim = {(info.module, info.param_name): i for i, info in enumerate(flat._param_infos)}
    shared = tuple(
        (f"{s.module_name}.{s.param_name}" if s.module_name else s.param_name, prim[(s.prim_module, s.prim_param_name)])
        for s in flat._shared_param_infos
    )
    local = getattr(flat, "_local_shard", flat.data)
    padded = getattr(flat, "_full_param_padded", None)  # the all-gather's destination, freed when resharded
    return Fsdp1Unit(
        module=module,
        flat=flat,
        local=local,
        unsharded=handle.uses_sharded_strategy
        and (flat.data_ptr() != local.data_ptr() or (padded is not None and padded.untyped_storage().size() > 0)),
        names=tuple(flat._fqns),
        shapes=tuple(flat._shapes),
        offsets=tuple(starts),
        shared=shared,
        in_shard=tuple((i.offset_in_shard, i.numel_in_shard) if i.in_shard else None for i in flat._shard_param_infos),
        params=tuple(flat._params) if module._use_orig_params else None,
        pg=module.process_group,
        mesh=module._device_mesh,
        replicate_pg=getattr(module, "_inter_node_pg", None),
        sharded=handle.uses_sharded_strategy,
    )


def fsdp1_reshard(module: torch.nn.Module) -> None:
    """Free the unsharded copy an FSDP1 instance keeps, so that its next
    forward gathers the shards again (after a load wrote into them)."""
    # FSDP1 reshards through its handle only; SHARD_GRAD_OP keeps the copy a
    # forward made and reuses it while its storage is allocated.
    module._handle.reshard(True)


def is_flat_param(p: Any) -> bool:
    # FlatParameter lives in a private module; its metaclass answers isinstance by a flag.
    return getattr(p, "_is_flat_param", False) is True


def all_gather_into(output: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        fn(output, inp, group=group)
    else:
        dist.all_gather_into_tensor(output, inp, group=group)


def incompatible_keys(missing: list[str], unexpected: list[str]):
    # What Module.load_state_dict returns; set_model_state_dict returns the same type.
    from torch.nn.modules.module import _IncompatibleKeys

    return _IncompatibleKeys(missing, unexpected)


def root_mesh(mesh):
    # The mesh a slice (``mesh["dp"]``) or an FSDP-concatenated mesh was cut
    # from; it tells a model on a slice of a world mesh (one SPMD job) from a
    # model on a mesh built over part of the world. DeviceMesh keeps it private.
    get = getattr(mesh, "_get_root_mesh", None)
    if get is not None:
        return get()
    # Before DeviceMesh had the method (torch 2.6 to 2.9), the
    # module's mesh registry kept the slice-to-root map.
    from torch.distributed import device_mesh

    resources = getattr(device_mesh, "_mesh_resources", None)
    if resources is None:
        return mesh
    root = resources.get_root_mesh(mesh)
    # The registry is keyed by value (ranks, shape, dim names), not identity:
    # a mesh equal to a slice of another mesh built earlier maps to that
    # mesh's root. The root is this mesh's own only if it holds this mesh's
    # process groups, as one of its dims or as a dim flattened from them.
    own = _group_names(mesh)
    if root is mesh or not own or own <= _group_names(root) | _flattened_group_names(resources, root):
        return root
    return mesh


def _group_names(mesh) -> set[str]:
    names = getattr(mesh, "_dim_group_names", None)
    if names is None:  # torch 2.6 to 2.7: (tag, ranks, group name) per dim
        names = [info[-1] for info in getattr(mesh, "_dim_group_infos", None) or ()]
    return set(names)


def _flattened_group_names(resources, root) -> set[str]:
    flattened = getattr(resources, "root_to_flatten_mapping", {}).get(root) or {}
    return {name for flat in flattened.values() for name in _group_names(flat)}


def collective_device() -> torch.device:
    """Where buffers for the default group's collectives must live."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- for the harness (hyperdsd.testing) and the conformance suite ------------


def checkpoint_wrapper(module: torch.nn.Module) -> torch.nn.Module:
    # Activation checkpointing's wrapper module, whose child name
    # (_checkpoint_wrapped_module) state dicts must hide; torch keeps it in a
    # private module path. The suite wraps models with it.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module)


def distribute_locally(full: torch.Tensor, mesh, placements) -> DTensor:
    """``distribute_tensor(full, mesh, placements, src_data_rank=None)``: every rank holds ``full`` and cuts its
    own piece, with no communication."""
    from torch.distributed.tensor import distribute_tensor

    if _HAS_SRC_DATA_RANK:
        return distribute_tensor(full, mesh, placements, src_data_rank=None)
    # torch 2.6 has no src_data_rank: its distribute_tensor always scatters
    # (or broadcasts) rank 0's tensor, which would be every rank's own piece
    # anyway. The collectives it calls are swapped for local copies meanwhile.
    from torch.distributed.tensor import placement_types

    def scatter(output, scatter_list, mesh, mesh_dim=0, **_):
        output.copy_(scatter_list[mesh.get_local_rank(mesh_dim)])

    saved = placement_types.mesh_scatter, placement_types.mesh_broadcast
    placement_types.mesh_scatter, placement_types.mesh_broadcast = scatter, lambda *a, **k: None
    try:
        return distribute_tensor(full, mesh, placements)
    finally:
        placement_types.mesh_scatter, placement_types.mesh_broadcast = saved


def _has_src_data_rank() -> bool:
    from torch.distributed.tensor import distribute_tensor

    return "src_data_rank" in inspect.signature(distribute_tensor).parameters


_HAS_SRC_DATA_RANK = _has_src_data_rank()


def storage_dtypes() -> dict:
    """The storage classes ``torch.save`` names in an archive (``torch.FloatStorage``, ...), with their dtypes."""
    # The unpickler that rebuilds DCP's items must allow exactly these; the
    # map is torch's own, and asking each class for its dtype warns.
    return {
        getattr(torch, name): dtype
        for dtype, name in torch.storage._dtype_to_storage_type_map().items()
        if hasattr(torch, name)
    }


def tensor_archive(data):
    """The archive ``torch.save`` wrote into ``data``, for its records (``get_record``, ``get_storage_from_record``)."""
    # torch.load's own C++ archive reader; torch.load around it costs ~100 us
    # an item in Python (an unpickler class per call, the weights-only
    # unpickler in Python), most of the time for small tensors.
    return torch._C.PyTorchFileReader(io.BytesIO(data))


def file_window(reader, stream, info):
    """DCP's view of one item in an open data file (as its reader reads an item)."""
    # FileSystemReader._slice_file: a seekable window that torch.load reads
    # from without copying the item first.
    return reader._slice_file(stream, info)


def storage_info(relative_path: str, offset: int, length: int):
    """Where DCP's file-system metadata says an item lies (``_StorageInfo``: the checkpoint format's own type)."""
    # Readers of the checkpoint (torch's included) unpickle this very class
    # from .metadata; a writer of plain DCP files must produce it.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def save_records(tensor: torch.Tensor) -> list[tuple[str, Any]] | None:
    """The records ``torch.save(tensor, f)`` writes into its archive, in order: (name, data), with
    None as the data of the tensor's storage record; None where this torch cannot tell."""
    # torch.serialization._save writes an object's records into the archive
    # writer it is given; a recorder in its place sees them without writing.
    # torch.save pickles each tensor anew (a pickler class per call, a
    # Python persistent_id per object): most of its time for small tensors.
    import pickle

    from torch import serialization

    records: list[tuple[str, Any]] = []
    storage = tensor.untyped_storage()

    class Recorder:
        def write_record(self, name, data, size):
            if isinstance(data, torch.UntypedStorage):
                if data.data_ptr() != storage.data_ptr() or size != storage.nbytes():
                    raise ValueError("another storage")
                records.append((name, None))
            else:
                records.append((name, bytes(data, "ascii") if isinstance(data, str) else bytes(data)))

    try:
        serialization._save(tensor, Recorder(), pickle, serialization.DEFAULT_PROTOCOL, False)
    except Exception:  # noqa: BLE001 - another torch's _save, or a tensor it saves otherwise
        return None
    if [data for _, data in records].count(None) != 1:
        return None
    return records


def archive_writer(stream):
    """torch.save's archive writer over ``stream``: a context giving the writer; its exit ends the archive."""
    from torch import serialization

    return serialization._open_zipfile_writer(stream)
