"""A rank's membership in a process group: join a world of a given size and
generation through a shared store, and leave it.

Leaving destroys every process group of this rank and closes their
connections, so that a peer blocked on this rank in a collective is released
at once (gloo reports the connection closed) instead of waiting for its
timeout. That is how a failed task frees the ranks waiting on it. Joining
again uses a new generation, a fresh namespace in the same store, so a world
can re-form (or shrink to a sub-world) without new processes.
"""

from __future__ import annotations

import datetime
import os
import socket

from . import _compat


def _socket_fds() -> dict[str, int]:
    """This process's sockets: inode link -> fd (empty where /proc is not there)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out[link] = int(fd)
    return out


def _close_connections(since: set[str]) -> None:
    """Shut down the TCP connections opened after ``since`` was taken.

    Destroying a process group closes its connections only when nothing
    else holds the group; some torch modules keep a reference once imported
    (FSDP's, DCP's), and then the peers would stay blocked until their
    timeout. The sockets belong to the destroyed groups, so shutting them
    down is what their destruction would have done; the fds stay owned by
    whoever holds them.
    """
    for link, fd in _socket_fds().items():
        if link in since:
            continue
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            # Connections only: a listening socket is the leaked group's own
            # accept loop, which must not see its socket fail.
            if sock.family in (socket.AF_INET, socket.AF_INET6) and not sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN
            ):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()


class Membership:
    """This process's place in a world: which generation, rank and size."""

    def __init__(self, store, *, backend: str = "gloo", timeout_s: float = 45.0):
        self.store = store
        self.backend = backend
        self.timeout_s = timeout_s
        self.generation: int | None = None
        self.rank: int | None = None
        self.world_size: int | None = None
        self._before_join: set[str] = set(_socket_fds())

    @property
    def joined(self) -> bool:
        return self.generation is not None

    def join(self, rank: int, world_size: int, generation: int) -> None:
        import torch.distributed as dist

        self.leave()
        self._before_join = set(_socket_fds())
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"hyperdsd/gen{generation}/", self.store),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )
        self.generation, self.rank, self.world_size = generation, rank, world_size

    def close_connections(self) -> None:
        """Shut down this world's connections without destroying its groups:
        safe from another thread, it makes whatever this rank is blocked on
        in a collective fail at once."""
        if self.joined:
            _close_connections(self._before_join)

    def leave(self) -> None:
        """Destroy every process group and close its connections (no-op when there is none)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        dist.destroy_process_group()
        _compat.forget_device_meshes()
        # Groups that objects of the last task still reference (cycles, torch's
        # own caches) stay alive until collected, and a full collection costs
        # a second in a process that imported torch: their connections are
        # closed here instead, which is all their peers need.
        _close_connections(self._before_join)
        self.generation = self.rank = self.world_size = None
