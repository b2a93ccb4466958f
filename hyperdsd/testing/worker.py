"""The rank side of a pool: join the process group, then serve messages
until told to stop: run a task (one answer each), leave the process group,
or join a new generation of it.

Started by the controller (``process.start_worker``), isolated from its
terminal and with its death signal armed: forked from a fork server that
has only imported modules, or a fresh interpreter through the bootstrap in
``process.py``. Either way it neither runs the controller's main module nor
inherits its threads.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import pickle
import sys
from multiprocessing.connection import Connection

from . import messages as m
from .context import RankContext, execute, select_device
from .group import Membership
from .messages import STACK_SIGNAL
from .status import RankStatus


def _send(conn, result: m.RankResult) -> None:
    try:
        conn.send(result)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        result.value = None
        result.status = RankStatus.RAISED
        result.exc_type = "hyperdsd.testing.UnpicklableResult"
        result.message = f"the task returned a value that cannot be sent to the controller: {exc}"
        conn.send(result)


def _join(conn, membership: Membership, ctx: RankContext, generation: int) -> bool:
    ctx.reset()
    try:
        membership.join(ctx.rank, ctx.world_size, generation)
    except Exception as exc:  # noqa: BLE001
        conn.send(m.StartFailed(ctx.rank, f"{type(exc).__name__}: {exc}"))
        return False
    conn.send(m.Ready(ctx.rank, os.getpid(), generation))
    return True


def serve(
    conn: Connection,
    rank: int,
    world_size: int,
    workdir: str,
    gloo_timeout_s: float,
    device_type: str = "cpu",
    backend: str = "gloo",
) -> None:
    stacks = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ctx = RankContext(rank, world_size, workdir, device_type=device_type, local_rank=rank)
    if device_type != "cpu":
        select_device(device_type, rank)
    membership = Membership(
        dist.FileStore(os.path.join(workdir, "store"), world_size), backend=backend, timeout_s=gloo_timeout_s
    )
    if not _join(conn, membership, ctx, 0):
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the controller went away
        if isinstance(msg, m.Shutdown):
            return
        if isinstance(msg, m.Leave):
            ctx.reset()
            membership.leave()
        elif isinstance(msg, m.Rejoin):
            if not _join(conn, membership, ctx, msg.generation):
                return
        else:
            _send(conn, execute(ctx, msg))
        sys.stdout.flush()
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hyperdsd.testing.worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--gloo-timeout", type=float, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="gloo")
    args = parser.parse_args(argv)  # --parent-pid was used by the bootstrap
    # Resolve task functions exactly as the controller would.
    sys.path[:0] = [p for p in json.loads(os.environ.get("HYPERDSD_SYS_PATH", "[]")) if p not in sys.path]
    os.set_inheritable(args.fd, False)  # children of a task must not hold the pipe open
    conn = Connection(args.fd)
    # What the rank imported before its first task (torch, DCP, the preloads)
    # lives as long as it does: out of the cyclic collector's way, so that a
    # collection scans only what tasks made.
    gc.freeze()
    try:
        serve(conn, args.rank, args.world_size, args.workdir, args.gloo_timeout, args.device, args.backend)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # Tearing down gloo can abort the process after all work is done; the
        # controller never judges by this exit, so skip the teardown entirely.
        os._exit(0)


if __name__ == "__main__":
    main()
