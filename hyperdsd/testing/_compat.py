"""The private torch and multiprocessing APIs the harness touches, apart from
hyperdsd's own (``hyperdsd/_compat/``): the harness judges other
implementations too, so it loads nothing of the library it ships with. Each
entry says why no public API does the job."""

from __future__ import annotations

import os

# torch is imported inside the functions that need it: the rank's bootstrap
# (process.py) uses this module before the seconds spent importing torch.


def member_groups(rank: int) -> dict:
    # Every process group this rank belongs to, by its global ranks. torch
    # keeps the registry private; it is only read here, to tell whether the
    # groups are still in step after a task and to count collectives issued.
    import torch.distributed as dist

    out = {}
    for pg, ranks in dist.distributed_c10d._world.pg_group_ranks.items():
        if isinstance(pg, dist.ProcessGroup) and rank in ranks:
            out[tuple(sorted(ranks))] = pg
    return out


def collectives_issued(pg) -> int:
    # The group's collective sequence number; no public accessor exists.
    return pg._get_sequence_number_for_group()


def forget_device_meshes() -> None:
    # DTensor memoises sharding and redistribution plans keyed by specs whose
    # DeviceMesh compares equal across process-group generations (equality
    # ignores the groups): after the groups are re-formed, a cached plan would
    # hand back a mesh of the old generation, whose groups no longer exist.
    # No public API clears these caches.
    import sys

    # torch 2.6 to 2.9 keep every sliced and flattened mesh in a registry
    # keyed by value: a mesh of the new generation equal to an old one would
    # be taken for it and handed its destroyed groups ("value was None").
    resources = getattr(sys.modules.get("torch.distributed.device_mesh"), "_mesh_resources", None)
    for name in ("child_to_root_mapping", "root_to_flatten_mapping", "flatten_name_to_root_dims"):
        registry = getattr(resources, name, None)
        if isinstance(registry, dict):
            registry.clear()
    if "torch.distributed.tensor" not in sys.modules:
        return
    import torch
    from torch.distributed.tensor import DTensor, _redistribute, _sharding_prop

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(_sharding_prop.ShardingPropagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        # Before 2.10 the propagator's cache is a thread-local wrapper with
        # no cache_clear of its own; its lru_cache is its ``cache``.
        cached = cached if hasattr(cached, "cache_clear") else getattr(cached, "cache", None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    clear_plans = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_plans is not None:
        clear_plans()
    # The C++ dispatch fast path keeps a sharding cache of its own, in front
    # of the Python one: a hit hands back an output spec on a mesh of the old
    # generation ("Could not resolve the process group registered under ...").
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()


# -- multiprocessing: its fork server and resource tracker have no public handles.


def forget_child(proc) -> None:
    # multiprocessing's exit handler joins every child it started, without a
    # deadline; the pool kills and reaps its ranks itself, so a rank is not
    # left on that list.
    import multiprocessing.process

    multiprocessing.process._children.discard(proc)


def fork_server_pid() -> int | None:
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def detach_fork_server() -> tuple[int | None, str | None]:
    """Forget this process's fork server, closing its "alive" pipe (EOF on it
    ends the server's loop): (its pid, its socket address) to reap and remove,
    or (None, None) where this process started none."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is None:
        return None, None
    pid, server._forkserver_pid = server._forkserver_pid, None
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None
    address, server._forkserver_address = server._forkserver_address, None
    return pid, address


def detach_resource_tracker() -> int | None:
    """Forget this process's resource tracker, closing its pipe (it leaves once
    every holder has closed it): its pid to reap, or None."""
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if tracker._pid is None:
        return None
    pid, tracker._pid = tracker._pid, None
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = None
    return pid


def close_fork_server_alive_fd() -> None:
    # The fork server hands each child a copy of the controller's "alive"
    # pipe: a rank holding it would keep the server alive after the controller.
    from multiprocessing import forkserver

    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
