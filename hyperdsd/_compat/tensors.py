"""DTensors, device meshes and collectives: what torch keeps private of them."""

from __future__ import annotations

import inspect
import itertools
import operator
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_SHAPE = operator.attrgetter("shape")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor; any other tensor is its own."""
    # ``to_local()`` goes through autograd when grad mode is on; the wrapped
    # tensor itself is what DCP reads and writes in place.
    return t._local_tensor if isinstance(t, DTensor) else t


def set_local(t: DTensor, local: torch.Tensor) -> None:
    """Make ``local`` the local tensor of the DTensor ``t`` (of the same local
    shape, dtype and device): a kept FSDP1 twin's parameter gets each call's
    rows so (:mod:`hyperdsd.fsdp1.kept`). The wrapper's metadata is its
    global shape and spec, which stay; the local tensor is a plain attribute."""
    t._local_tensor = local


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


def dtensors_of(locals_: Iterable[torch.Tensor], specs: Iterable) -> list[DTensor]:
    """A DTensor around each local tensor with its spec, not requiring grad,
    made as :func:`detached` makes one (an FSDP1 twin's state, many a call)."""
    new = DTensor.__new__
    return [new(DTensor, t, spec, requires_grad=False) for t, spec in zip(locals_, specs)]


def joined_flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and joined into one new 1-D tensor (``torch.cat``
    of their flat views, dtypes promoted as it promotes), in one call rather
    than a ``reshape`` each; not recorded by autograd."""
    with torch.no_grad():
        return torch._C._nn.flatten_dense_tensors(tensors)


_foreach_clone = getattr(torch, "_foreach_clone", None)


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A clone of each of ``tensors``, each with its own storage: in one call
    where torch has ``_foreach_clone`` and every one is a plain tensor."""
    if tensors and _foreach_clone is not None and all(type(t) is torch.Tensor for t in tensors):
        return list(_foreach_clone(tensors))
    return [t.clone() for t in tensors]


def unbound_copies(t: torch.Tensor) -> list[torch.Tensor]:
    """``t.unbind(0)``, each piece a copy with its own storage, made in one
    call (no view made first: a fifth less than views cloned)."""
    return list(torch.unbind_copy(t, 0))


def cloned(t: torch.Tensor) -> torch.Tensor:
    """``t.detach().clone()``; a DTensor's made around its local tensor's clone
    with the same spec, without the op dispatcher (see :func:`detached`)."""
    if type(t) is DTensor:
        return DTensor.__new__(DTensor, t._local_tensor.detach().clone(), t._spec, requires_grad=False)
    return t.detach().clone()


def as_parameter(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``nn.Parameter(t, requires_grad)``. For a DTensor, what nn.Parameter makes
    of a tensor subclass (``t`` detached, ``requires_grad_``, flagged
    ``_is_param``), detached without DTensor's op dispatcher (:func:`detached`)."""
    if type(t) is not DTensor:
        return torch.nn.Parameter(t, requires_grad)
    out = detached(t).requires_grad_(requires_grad)
    out._is_param = True
    return out


def dtensor_spec(mesh, placements: tuple, shape: torch.Size, stride: tuple, dtype: torch.dtype):
    """The spec a DTensor of this mesh, placements, global shape, stride and
    dtype carries (what ``DTensor.from_local`` builds; its module is private)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, stride, dtype))


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


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`local_tensor` of each of ``tensors``: read in C where all are DTensors."""
    if set(map(type, tensors)) == {DTensor}:
        return list(map(dtensor_local, tensors))
    return list(map(local_tensor, tensors))


def copy_each(dests: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``dest.copy_(source)`` for each pair, in one call."""
    # torch's foreach kernels are private; one call for thousands of small
    # copies is a third of their time as Python calls.
    torch._foreach_copy_(dests, sources)


def copy_each_of_run(dests: list[torch.Tensor], run: torch.Tensor, shaped: bool = False) -> None:
    """``dests[i].copy_(run[i])`` for each of ``run``'s pieces along dim 0;
    ``shaped``: every dest is known to have the pieces' shape (not asked again)."""
    piece = run.shape[1:]
    # One call that cuts and copies in C++, without a Python view per piece
    # (FSDP2 copies its all-gather out the same way), where every dest has the
    # piece's shape: an out= op resizes a dest of another shape.
    if piece and (shaped or all(map(operator.eq, map(_SHAPE, dests), itertools.repeat(piece)))):
        try:
            with torch.no_grad():
                torch.split_with_sizes_copy(run.flatten(0, 1), [piece[0]] * len(dests), dim=0, out=dests)
            return
        except RuntimeError:  # a dest of another dtype or device: copied as below (a copy twice is harmless)
            pass
    # Views made under inference mode skip autograd's view bookkeeping; the
    # pieces are dropped after the copy.
    with torch.inference_mode():
        if not piece and len(dests) == len(run) > 1 and _alike(run):
            # 0-d values (an optimizer's steps), mostly all alike: the one value
            # copied into each, half the time of a view made per value
            torch._foreach_copy_(dests, [run[0]] * len(dests))
        else:
            torch._foreach_copy_(dests, run.unbind(0))


def _alike(run: torch.Tensor) -> bool:
    """Whether every element of the 1-D CPU tensor ``run`` is the first one bit
    for bit (-0.0 is not 0.0); False on another device (the answer would wait
    for it) or where its bytes cannot be viewed."""
    if run.device.type != "cpu" or not run.is_contiguous():
        return False
    try:
        bits = run.view(torch.uint8).view(len(run), -1)
    except (RuntimeError, TypeError):
        return False
    return bool((bits == bits[0]).all())


def version_of(t: torch.Tensor) -> int:
    # The in-place version counter is how we know whether anyone (DCP) wrote
    # into a placeholder tensor; there is no public accessor.
    return local_tensor(t)._version


def all_gather_into(output: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
    fn = getattr(dist, "all_gather_single", None)
    if fn is not None:
        fn(output, inp, group=group)
    else:
        dist.all_gather_into_tensor(output, inp, group=group)


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
