"""hyperdsd against torch.distributed.checkpoint.state_dict, side by side.

Four CPU ranks on gloo, an FSDP2 model (fully_shard per block of layers)
with AdamW state. For every mode both implementations run alternately in
the same processes, several times; the table shows the medians (slowest
rank) and the ratio hyperdsd / torch. A call's time ends when it returns:
what a get returned is released after it, untimed. Beside them, a floor
measured in the same run: the least any implementation with hyperdsd's
guarantees must do.
For set and flat_set, torch's own op followed by one all-reduce of two flags
(every hyperdsd set agrees across ranks so that bad input on one rank raises
on all; torch's sharded set performs no collective and gives no such
guarantee); for full_get, one gloo gather of every rank's state bytes into
rank 0; for bcast_set, one gloo scatter of them from rank 0. The other modes
have no such floor (get is local; dcp is dominated by DCP's own save and
load). On the models with many small parameters (10k, 50k) the table adds
hyperdsd's time per 1,000 keys (parameters; each also has three AdamW state
values), per key, and as a multiple of the per-tensor floor: one ``clone()``
of every local tensor (a parameter's shard and its optimizer state values,
the tensors DTensors wrap, not reached through ``to_local()``) in a Python
loop, slowest rank, measured in the same run; and, for the modes whose
target is relative to it, the ratio to hyperdsd's own sharded get. Where
both 10k and 50k ran, each mode's time per key on 50k over its time per key
on 10k follows the table, the per-tensor floor's and torch's beside it.
``resume`` is a save and a load of the model and optimizer:
``hyperdsd.checkpoint.save`` then ``load``, against torch's
``get_state_dict``, plain ``dcp.save``, ``get_state_dict``, ``dcp.load`` and
``set_state_dict``; not on the 268m model (as ``dcp``: gigabytes of files),
nor by default on the 50k one (``--resume-50k`` adds it; torch takes long there).

FSDP1 (``--fsdp1-sizes``, default 17m): the same model wrapped in
``FullyShardedDataParallel`` per block and at the root, with
``use_orig_params=True`` (layout ``fsdp1``) and ``False`` (``fsdp1-flat``),
in the modes of ``--fsdp1-modes``. Before each of those rows torch's op runs
once in a task of its own: torch's full optimizer state dict on FSDP1 can
kill a rank (SIGSEGV), and a dead rank ends its task. Where torch survives
it alternates with hyperdsd and the floor as above; where it does not (then
or later), the row is hyperdsd against the floor, marked with what happened
to torch (for ``set``, whose floor is torch's own op, nothing is left to
compare with).

Then, unless ``--no-breakdown``, where a key's time goes: hyperdsd's CPU
time per key of the slowest rank, by category (cProfile shares scaled to the
unprofiled CPU time). Then peak resident memory, per implementation in its
own processes, in the full and broadcast modes (FSDP1: the full get).

    python -m tools.benchmarks.bench                       # everything: hours on 2 shared cores
    python -m tools.benchmarks.bench --reps 3 --budget 60 # fewer repetitions: still over an hour
    python -m tools.benchmarks.bench --sizes 4m --reps 3 --no-memory --no-breakdown
    python -m tools.benchmarks.bench --sizes 10k --modes get,set --no-memory --breakdown-sizes 10k
    python -m tools.benchmarks.bench --sizes 2k --modes set,flat_set --hsdp-sizes "" --fsdp1-sizes "" \
        --no-memory --no-breakdown
    python -m tools.benchmarks.bench --sizes 10k,50k --modes resume --resume-50k --reps 3 --no-memory --no-breakdown

``--torch-skip SIZE:MODE,...`` leaves torch out where it takes many minutes
per repetition (by default: full get and broadcast sets on the 50k model;
``--skip`` leaves out DCP there and on the 268M model, and the joint
broadcast set on the large models); memory runs skip torch there
too, and ``--memory-torch-skip`` names more.

Run from the repository root (``python -m tools.benchmarks.bench`` or ``python tools/benchmarks/bench.py``): the
ranks import their work from ``tools.benchmarks.bench_tasks``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if not __package__:  # run as a script: tools is imported from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hyperdsd.testing import RankStatus, Status
from tools.benchmarks import bench_breakdown, bench_tasks
from tools.benchmarks.bench_tasks import MODES

FLOORED = ("set", "flat_set", "full_get", "bcast_set", "bcast_both", "resume")
MANY_KEYS = bench_tasks.MANY_KEYS
RELATIVE_TO_GET = ("full_get", "bcast_set", "bcast_both")  # targets: at most 10x hyperdsd's own sharded get
FSDP1 = tuple(bench_tasks.FSDP1_MESHES)


def _torch_failure(outcome) -> str:
    """What happened to torch in a failed task: "torch crashed (SIGSEGV, rank 0)" or its first error."""
    died = [r for r in outcome.results if r.status == RankStatus.DIED]
    if died:
        how = died[0].message.replace("killed by ", "").replace(" during the task", "")
        return f"torch crashed ({how}, rank {','.join(str(r.rank) for r in died)})"
    return "torch failed: " + (outcome.describe().splitlines() or ["?"])[0][:160]


def _pairs(text: str) -> set[tuple[str, str]]:
    return {tuple(item.split(":", 1)) for item in text.split(",") if ":" in item}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="4m,17m,67m,268m,10k,50k")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--budget", type=float, default=90.0, help="seconds per size and mode before repetitions stop early"
    )
    parser.add_argument("--hsdp-sizes", default="4m,17m", help="sizes also run on a 2x2 mesh (full_get, bcast_set)")
    parser.add_argument(
        "--fsdp1-sizes", default="17m", help="sizes also run on FSDP1: use_orig_params True (fsdp1), False (fsdp1-flat)"
    )
    parser.add_argument("--fsdp1-modes", default="full_get,bcast_set,get,set", help="modes of the FSDP1 rows")
    parser.add_argument(
        "--skip",
        default="50k:dcp,268m:dcp,67m:bcast_both,268m:bcast_both,50k:resume,268m:resume",
        help="SIZE:MODE pairs not run at all",
    )
    parser.add_argument("--resume-50k", action="store_true", help="run resume on the 50k model too")
    parser.add_argument(
        "--torch-skip",
        default="50k:full_get,50k:bcast_set,50k:bcast_both",
        help="SIZE:MODE pairs where torch is not run",
    )
    parser.add_argument("--memory-sizes", default=None, help="sizes of the memory table (default: --sizes)")
    parser.add_argument(
        "--memory-torch-skip",
        default="10k:full_get",
        help="SIZE:MODE pairs without torch in the memory table (beside --torch-skip)",
    )
    parser.add_argument("--breakdown-sizes", default="10k,50k")
    parser.add_argument("--breakdown-modes", default="get,set,full_get,bcast_set,flat_get,flat_set")
    parser.add_argument(
        "--breakdown-top", action="store_true", help="also list each mode's functions of most CPU time per key"
    )
    parser.add_argument(
        "--breakdown-phases", action="store_true", help="also give each mode's CPU by phase of the call (ms)"
    )
    parser.add_argument("--no-breakdown", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    args = parser.parse_args()

    import torch

    from hyperdsd.testing import PoolSet, Task
    from hyperdsd.transport.collectives import BUCKET_BYTES

    sizes = [s for s in args.sizes.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    skip, torch_skip = _pairs(args.skip), _pairs(args.torch_skip)
    if args.resume_50k:
        skip.discard(("50k", "resume"))
    runs = [(s, m, "4") for s in sizes for m in modes if (s, m) not in skip]
    runs += [(s, m, "2x2") for s in args.hsdp_sizes.split(",") if s for m in ("full_get", "bcast_set")]
    fsdp1_sizes = [s for s in args.fsdp1_sizes.split(",") if s]
    runs += [(s, m, layout) for s in fsdp1_sizes for layout in FSDP1 for m in args.fsdp1_modes.split(",") if m]
    print(
        f"torch {torch.__version__}, 4 CPU ranks (gloo), {os.cpu_count()} cores, AdamW, "
        f"{args.reps} repetitions per implementation, medians; "
        f"hyperdsd bucket {BUCKET_BYTES / 2**20:.0f} MiB"
    )
    print(
        f"{'size':>5} {'mesh':>10} {'mode':>10} {'torch ms':>10} {'hyperdsd ms':>12} {'ratio':>7} {'floor ms':>10}"
        f" {'hyperdsd/floor':>15} {'reps':>5}"
        f" {'us/key':>8} {'clone ms':>9} {'x clone':>8} {'x own get':>10}"
    )
    own_get: dict[str, float] = {}
    per_key: dict[tuple[str, str], float] = {}  # (size, mode or floor): ms per key, for the growth from 10k to 50k
    with PoolSet(gloo_timeout_s=900) as pools:
        for size, mode, mesh in runs:
            torch_too = (size, mode) not in torch_skip
            crashed = ""  # what happened to torch where it killed a rank (FSDP1)
            if torch_too and mesh in FSDP1:
                probe = pools.run(4, Task(bench_tasks.torch_once, {"size": size, "mode": mode, "mesh": mesh}), 3600)
                if probe.status != Status.PASSED:
                    crashed, torch_too = _torch_failure(probe), False
            while True:
                params = {"size": size, "mode": mode, "mesh": mesh, "reps": args.reps, "budget_s": args.budget}
                outcome = pools.run(4, Task(bench_tasks.time_mode, {**params, "torch_too": torch_too}), 3600)
                # torch may survive its probe and die later: run again without it rather than lose the row
                if outcome.status == Status.PASSED or not torch_too or mesh not in FSDP1:
                    break
                if not any(r.region in ("torch", "floor") for r in outcome.results if r.status.failed):
                    break
                crashed, torch_too = _torch_failure(outcome), False
            if outcome.status != Status.PASSED:
                print(f"{size:>5} {mesh:>10} {mode:>10}  failed: {outcome.describe()[:300]}", flush=True)
                continue
            t = outcome.values[0]
            b = statistics.median(t["hyperdsd"])
            if torch_too:
                a = statistics.median(t["torch"])
                theirs = f"{a:10.1f} {b:12.1f} {b / a:7.2f}"
            else:
                said = crashed.split(" ", 2)[1].rstrip(":") if crashed else "not run"  # "crashed" or "failed"
                theirs = f"{said:>10} {b:12.1f} {'-':>7}"
            if mode in FLOORED and t["floor"]:
                floor = statistics.median(t["floor"])
                floors = f"{floor:10.1f} {b / floor:15.2f}"
            else:
                floors = f"{'-':>10} {'-':>15}"
            extra = ""
            if size in MANY_KEYS and mesh == "4":
                if mode == "get":
                    own_get[size] = b
                relative = f"{b / own_get[size]:10.1f}" if mode in RELATIVE_TO_GET and size in own_get else f"{'':>10}"
                keys = bench_tasks.keys_of(size)
                clone = statistics.median(t["clone"])  # the per-tensor floor, alternating in the same run
                per_key.update({(size, mode): b / keys, (size, f"clone ({mode})"): clone / keys})
                if torch_too:
                    per_key[(size, f"torch ({mode})")] = a / keys
                extra = f" {b / keys * 1000:8.1f} {clone:9.1f} {b / clone:8.2f} {relative}"
            print(f"{size:>5} {mesh:>10} {mode:>10} {theirs} {floors} {len(t['hyperdsd']):5d}{extra}", flush=True)
            if crashed:
                print(f"{'':>5} {mesh:>10} {mode:>10}  {crashed}", flush=True)
            if mode == "resume":
                ratio = f", torch {a / 1000:.1f} s, ratio {b / a:.2f}" if torch_too else ""
                floor = statistics.median(t["floor"])
                print(
                    f"{'':>5} resume {size}: hyperdsd {b / 1000:.1f} s{ratio}; "
                    f"DCP's floor {floor / 1000:.1f} s, x floor {b / floor:.2f}",
                    flush=True,
                )
        _growth(per_key)
        if not args.no_breakdown:
            bench_breakdown.table(
                pools,
                [s for s in args.breakdown_sizes.split(",") if s],
                [m for m in args.breakdown_modes.split(",") if m],
                top=args.breakdown_top,
                phases=args.breakdown_phases,
            )
    if not args.no_memory:
        memory_sizes = [s for s in (args.memory_sizes or args.sizes).split(",") if s]
        _memory(memory_sizes, args.hsdp_sizes.split(","), torch_skip | _pairs(args.memory_torch_skip), fsdp1_sizes)


def _growth(per_key: dict[tuple[str, str], float], small: str = "10k", large: str = "50k") -> None:
    """Each call's time per key on the ``large`` model over its time per key on
    the ``small`` one, where both ran; beside it, the per-tensor floor's and
    torch's where it ran (measured in the same rows)."""
    rows = [what for size, what in per_key if size == small and (large, what) in per_key]
    if not rows:
        return
    print(f"\ntime per key, {large} over {small}: hyperdsd's, and beside it the clone floor's and torch's")
    for what in rows:
        print(f"{what:>24} {per_key[(large, what)] / per_key[(small, what)]:6.2f}")


def _memory(
    sizes: list[str], hsdp_sizes: list[str], torch_skip: set[tuple[str, str]], fsdp1_sizes: list[str] | None = None
) -> None:
    from hyperdsd.testing import PoolSet, Task

    print("\npeak resident memory above the baseline during one op, MiB per rank (own processes per implementation)")
    print(
        f"{'size':>5} {'mesh':>10} {'mode':>10} {'impl':>9}  rank0 / rank1 / rank2 / rank3   (own state per rank)  "
        "KiB per key, non-root ranks"
    )
    fsdp1_sizes = fsdp1_sizes or []
    for size in sizes + [s for s in fsdp1_sizes if s not in sizes]:  # FSDP1's sizes whatever the memory sizes
        for mesh in ("4", "2x2", *FSDP1):
            if mesh in FSDP1:
                if size not in fsdp1_sizes:
                    continue
            elif size not in sizes or (mesh == "2x2" and size not in hsdp_sizes):
                continue
            for mode in ("full_get", "bcast_set"):
                for impl in ("torch", "hyperdsd"):
                    if impl == "torch" and (size, mode) in torch_skip:
                        print(f"{size:>5} {mesh:>10} {mode:>10} {impl:>9}  not run", flush=True)
                        continue
                    with PoolSet(gloo_timeout_s=900) as pools:
                        outcome = pools.run(
                            4, Task(bench_tasks.memory, {"impl": impl, "size": size, "mode": mode, "mesh": mesh}), 3600
                        )
                    if outcome.status != Status.PASSED:
                        why = _torch_failure(outcome) if impl == "torch" else f"failed: {outcome.describe()[:300]}"
                        print(f"{size:>5} {mesh:>10} {mode:>10} {impl:>9}  {why}", flush=True)
                        continue
                    peaks = " / ".join(f"{v['peak_above_base_mib']:6.1f}" for v in outcome.values)
                    own = outcome.values[1]["own_state_mib"]
                    per_key = ""
                    if size in MANY_KEYS:
                        worst = max(v["peak_above_base_mib"] for v in outcome.values[1:])
                        per_key = f"  {worst * 1024 / bench_tasks.keys_of(size):6.2f}"
                    print(f"{size:>5} {mesh:>10} {mode:>10} {impl:>9}  {peaks}   ({own:.1f}){per_key}", flush=True)


if __name__ == "__main__":
    main()
