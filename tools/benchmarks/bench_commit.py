"""What an atomic save costs: hyperdsd.checkpoint.save against plain dcp.save, side by side.

Four CPU ranks on gloo, the README's 17M-parameter FSDP2 model with AdamW
state (``tools.benchmarks.bench``'s ``17m``). Each repetition saves over an existing
checkpoint at a fixed path, as training scripts do, once each way and in
rotating order; the table shows the medians (slowest rank):

- ``sync``: ``get_state_dict`` + ``dcp.save`` (what hyperdsd's save did
  before it committed atomically) against ``hyperdsd.checkpoint.save``;
- ``async blocking``: until ``dcp.async_save`` (after ``get_state_dict``) or
  ``hyperdsd.checkpoint.save(..., async_save=True)`` returns;
- ``async total``: until the checkpoint is written (committed, for hyperdsd).

Then the cost a per-file CRC-32 would add (not done by hyperdsd): reading
back and checksumming one rank's data file, as a save (and again a load)
would have to.

    python -m tools.benchmarks.bench_commit [--size 17m] [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib

if not __package__:  # run as a script: tools is imported from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

WAYS = ("sync", "async")


def _dirs(ctx) -> str:
    import torch.distributed as dist

    box = [tempfile.mkdtemp(prefix="bench-commit-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _plain(model, opt, path: str, async_save: bool):
    import torch.distributed.checkpoint as dcp

    import hyperdsd

    msd, osd = hyperdsd.get_state_dict(model, opt)
    if async_save:
        return dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=path)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    return None


def _atomic(model, opt, path: str, async_save: bool):
    import hyperdsd

    return hyperdsd.checkpoint.save(path, model, opt, async_save=async_save)


def time_saves(ctx, size: str, reps: int):
    """Per way and implementation: the slowest rank's ms of each repetition (and the blocking part of async)."""
    import torch
    import torch.distributed as dist

    from tools.benchmarks.bench_tasks import _build

    model, opt = _build(ctx, size, "4")
    root = _dirs(ctx)
    impls = {"dcp": _plain, "hyperdsd": _atomic}
    times: dict[str, list[float]] = {}
    try:
        for name, save in impls.items():  # a checkpoint at each path first: every timed save replaces one
            save(model, opt, os.path.join(root, name), False)
        orders = (("dcp", "hyperdsd"), ("hyperdsd", "dcp"))
        for r in range(reps):
            for way in WAYS:
                for name in orders[r % 2]:
                    dist.barrier()
                    start = time.perf_counter()
                    fut = impls[name](model, opt, os.path.join(root, name), way == "async")
                    blocking = time.perf_counter() - start
                    if fut is not None:
                        fut.result()
                    total = time.perf_counter() - start
                    spent = torch.tensor([blocking, total])
                    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
                    if way == "async":
                        times.setdefault(f"async blocking {name}", []).append(spent[0].item() * 1000)
                    row = "async total" if way == "async" else "sync"
                    times.setdefault(f"{row} {name}", []).append(spent[1].item() * 1000)
        dist.barrier()
        data = sorted(p for p in os.listdir(os.path.join(root, "hyperdsd")) if p.endswith(".distcp"))
        crc = []
        if ctx.rank == 0:
            file = os.path.join(root, "hyperdsd", data[0])
            for _ in range(reps):
                start = time.perf_counter()
                with open(file, "rb") as f:
                    value = 0
                    while chunk := f.read(1 << 24):
                        value = zlib.crc32(chunk, value)
                crc.append((time.perf_counter() - start) * 1000)
            times["crc32 of one rank's file"] = crc
            times["file MiB"] = [os.path.getsize(file) / 2**20]
    finally:
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.bench_commit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", default="17m")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()

    import torch

    from hyperdsd.testing import PoolSet, Status, Task

    with PoolSet(gloo_timeout_s=900) as pools:
        outcome = pools.run(
            4, Task("tools.benchmarks.bench_commit:time_saves", {"size": args.size, "reps": args.reps}), 3600
        )
    if outcome.status != Status.PASSED:
        sys.exit(f"failed: {outcome.describe()}")
    t = outcome.values[0]
    print(
        f"torch {torch.__version__}, 4 CPU ranks (gloo), {os.cpu_count()} cores, {args.size} FSDP2 model with AdamW, "
        f"{len(t['sync dcp'])} repetitions, medians of the slowest rank"
    )
    print(f"{'':>16} {'dcp.save ms':>12} {'hyperdsd ms':>12} {'ratio':>6} {'paired':>7}")
    for row in ("sync", "async blocking", "async total"):
        a, b = statistics.median(t[f"{row} dcp"]), statistics.median(t[f"{row} hyperdsd"])
        paired = statistics.median(y / x for x, y in zip(t[f"{row} dcp"], t[f"{row} hyperdsd"]))
        print(f"{row:>16} {a:12.1f} {b:12.1f} {b / a:6.2f} {paired:7.2f}")
    crc = statistics.median(t["crc32 of one rank's file"])
    print(f"a CRC-32 of one rank's data file ({t['file MiB'][0]:.0f} MiB, read back from the page cache): {crc:.1f} ms")


if __name__ == "__main__":
    main()
