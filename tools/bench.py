"""hyperdsd against torch.distributed.checkpoint.state_dict, side by side.

Four CPU ranks on gloo, an FSDP2 model (fully_shard per layer) with AdamW
state. For every mode both implementations run alternately in the same
processes, several times; the table shows the medians (slowest rank) and the
ratio hyperdsd / torch. Beside them, a floor measured in the same run: the
least any implementation with hyperdsd's guarantees must do. For set and
flat_set, torch's own op followed by one all-reduce of two flags (every
hyperdsd set agrees across ranks so that bad input on one rank raises on all;
torch's sharded set performs no collective and gives no such guarantee); for
full_get, one gloo gather of every rank's state bytes into rank 0; for
bcast_set, one gloo scatter of them from rank 0. The other modes have no
such floor (get is local; dcp is dominated by DCP's own save and load).
Peak resident memory is measured per implementation in its own processes, in
the full and broadcast modes.

    python -m tools.bench                      # everything (about 45 minutes on 2 cores, most of it torch on the 10k model)
    python -m tools.bench --sizes 4m --reps 3 --no-memory

Run from the repository root: the ranks import their work from ``tools.bench_tasks``.
"""

from __future__ import annotations

import argparse
import os
import statistics

from tools import bench_tasks
from tools.bench_tasks import MODES, SIZES

FLOORED = ("set", "flat_set", "full_get", "bcast_set")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4m,17m,67m,10k")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds per size and mode before repetitions stop early")
    parser.add_argument("--hsdp-sizes", default="4m,17m", help="sizes also run on a 2x2 mesh (full_get, bcast_set)")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()

    from hyperdsd.collectives import BUCKET_BYTES
    from hyperdsd.testing import PoolSet, Task

    sizes = [s for s in args.sizes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    runs = [(s, m, "4") for s in sizes for m in modes]
    runs += [(s, m, "2x2") for s in args.hsdp_sizes.split(",") if s for m in ("full_get", "bcast_set")]
    print(f"4 CPU ranks (gloo), {os.cpu_count()} cores, AdamW, {args.reps} repetitions per implementation, medians; "
          f"hyperdsd bucket {BUCKET_BYTES / 2**20:.0f} MiB")
    print(f"{'size':>5} {'mesh':>4} {'mode':>10} {'torch ms':>10} {'hyperdsd ms':>12} {'ratio':>7} {'floor ms':>10} {'hyperdsd/floor':>15} {'reps':>5}")
    with PoolSet(gloo_timeout_s=600) as pools:
        for size, mode, mesh in runs:
            outcome = pools.run(4, Task(bench_tasks.time_mode, {"size": size, "mode": mode, "mesh": mesh, "reps": args.reps, "budget_s": args.budget}), 3600)
            if outcome.status != "passed":
                print(f"{size:>5} {mesh:>4} {mode:>10}  failed: {outcome.describe()[:300]}")
                continue
            t = outcome.values[0]
            a, b = statistics.median(t["torch"]), statistics.median(t["hyperdsd"])
            if mode in FLOORED:
                floor = statistics.median(t["floor"])
                floors = f"{floor:10.1f} {b / floor:15.2f}"
            else:
                floors = f"{'-':>10} {'-':>15}"
            print(f"{size:>5} {mesh:>4} {mode:>10} {a:10.1f} {b:12.1f} {b / a:7.2f} {floors} {len(t['torch']):5d}", flush=True)
    if args.no_memory:
        return
    print("\npeak resident memory above the baseline during one op, MiB per rank (own processes per implementation)")
    print(f"{'size':>5} {'mesh':>4} {'mode':>10} {'impl':>9}  rank0 / rank1 / rank2 / rank3   (own state per rank)")
    for size in sizes:
        for mesh in ("4", "2x2"):
            if mesh == "2x2" and size not in args.hsdp_sizes.split(","):
                continue
            for mode in ("full_get", "bcast_set"):
                for impl in ("torch", "hyperdsd"):
                    with PoolSet(gloo_timeout_s=600) as pools:
                        outcome = pools.run(4, Task(bench_tasks.memory, {"impl": impl, "size": size, "mode": mode, "mesh": mesh}), 3600)
                    if outcome.status != "passed":
                        print(f"{size:>5} {mesh:>4} {mode:>10} {impl:>9}  failed: {outcome.describe()[:300]}")
                        continue
                    peaks = " / ".join(f"{v['peak_above_base_mib']:6.1f}" for v in outcome.values)
                    own = outcome.values[1]["own_state_mib"]
                    print(f"{size:>5} {mesh:>4} {mode:>10} {impl:>9}  {peaks}   ({own:.1f})", flush=True)


if __name__ == "__main__":
    main()
