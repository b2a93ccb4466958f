"""Per-case cost of the harness against spawning a process group per test.

PyTorch's own distributed tests spawn fresh processes and a fresh process
group for every test. This runs the same eight FSDP2 get/set tests on four
CPU ranks both ways, in the same run, and prints the per-test wall time of
each and the warm pool's overhead (wall time minus the slowest rank's own
work), as medians.

    python -m tools.benchmarks.bench_harness [--tests 8] [--world-size 4]

Run from the repository root: the pool's ranks import the test body from
``tools.benchmarks.bench_harness``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import statistics
import tempfile
import time

from hyperdsd.testing import Status


def fsdp_get_set(ctx, variant: int = 0):
    """The test body: FSDP2 model, one AdamW step, get and set (sharded or full)."""
    import torch
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.mesh(str(ctx.world_size)) if hasattr(ctx, "mesh") else init_device_mesh("cpu", (ctx.world_size,))
    torch.manual_seed(variant)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    options = StateDictOptions(full_state_dict=bool(variant % 2))
    osd = get_optimizer_state_dict(model, opt, options=options)
    set_optimizer_state_dict(model, opt, osd, options=options)
    return True


class _SpawnCtx:
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


def _spawned_test(rank, world_size, store_path, variant):
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world_size),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    fsdp_get_set(_SpawnCtx(rank, world_size), variant)
    dist.destroy_process_group()


def spawn_per_test(n: int, world_size: int) -> list[float]:
    import torch.multiprocessing as mp

    times = []
    for i in range(n):
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            mp.start_processes(
                _spawned_test, args=(world_size, os.path.join(d, "store"), i), nprocs=world_size, start_method="spawn"
            )
        times.append(time.perf_counter() - start)
    return times


def warm_pool(n: int, world_size: int) -> tuple[float, list[float], list[float]]:
    from hyperdsd.testing import PoolSet, Task

    # This module runs as __main__; the ranks import it under its own name.
    task = importlib.import_module("tools.benchmarks.bench_harness").fsdp_get_set
    with PoolSet() as pools:
        start = time.perf_counter()
        pools.pool(world_size)
        startup = time.perf_counter() - start
        pools.run(world_size, Task(task, {"variant": 99}))  # warm imports
        walls, overheads = [], []
        for i in range(n):
            start = time.perf_counter()
            outcome = pools.run(world_size, Task(task, {"variant": i}))
            wall = time.perf_counter() - start
            assert outcome.status == Status.PASSED, outcome.describe()
            walls.append(wall)
            overheads.append(wall - max(r.duration_s for r in outcome.results))
    return startup, walls, overheads


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.bench_harness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tests", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args()

    startup, walls, overheads = warm_pool(args.tests, args.world_size)
    spawned = spawn_per_test(args.tests, args.world_size)
    med = statistics.median
    print(f"{args.tests} FSDP2 get/set tests on {args.world_size} CPU ranks (gloo), {os.cpu_count()} cores")
    print(f"  spawn a process group per test : {med(spawned):7.3f} s per test (median), {sum(spawned):6.1f} s in all")
    print(
        f"  warm pool                      : {med(walls):7.3f} s per test (median), {sum(walls):6.1f} s in all, "
        f"plus {startup:.1f} s to start the pool once"
    )
    print(
        f"  warm pool overhead per test    : {med(overheads) * 1000:7.1f} ms "
        "(median; wall time minus the slowest rank's work)"
    )
    print(f"  ratio (spawn / warm, per test) : {med(spawned) / med(walls):7.1f}x")


if __name__ == "__main__":
    main()
