"""hyperdsd on FSDP1 against hyperdsd on FSDP2, the same model, the same run.

Four CPU ranks on gloo. The model is a root of ``Linear(8, 8)`` blocks of 20
(40 keys a block, each block a unit), AdamW stepped once. For each FSDP1
variant (``use_orig_params`` True and False; ``FULL_SHARD``,
``SHARD_GRAD_OP``, ``HYBRID_SHARD`` on a 2x2 mesh) the task builds the FSDP1
model and its FSDP2 counterpart (``fully_shard`` per block and root; on the
2x2 mesh for ``HYBRID_SHARD``) and, for each mode, alternates hyperdsd's call
on the two (and torch's on FSDP1 where asked), ``--reps`` times each. The
table gives medians of the slowest rank and FSDP1's time over FSDP2's: the
target is at most 2x in every call, and per key from 10k to 50k keys within
1.2x, as FSDP2's (printed after the table where both sizes ran). The CPU
columns give the slowest rank's process time in the call, the same way:
four ranks on two cores wait for each other, and the wall time moves with
the host more than the work does.

For the sharded gets and sets the ``new`` column is the floor FSDP1's call
stands on beyond FSDP2's (:func:`_new_values`): the CPU ms, on the same
rank in the same run, to make each value of FSDP2's get new, a copy with
its own storage in a new DTensor. FSDP2's get returns the optimizer's own
tensors and its set of them copies nothing; FSDP1's must make or land
every value anew. ``CPU1/(2+new)`` is FSDP1's CPU over FSDP2's plus that
floor: how far FSDP1's call is from the least it could do.

    python -m tools.benchmarks.bench_fsdp1 --sizes 4k,10k --reps 3
    python -m tools.benchmarks.bench_fsdp1 --sizes 10k,50k --variants orig-full --modes get,set --reps 3
    python -m tools.benchmarks.bench_fsdp1 --sizes 4k --variants orig-full --modes set --profile

``--torch`` adds torch's own call on the FSDP1 model (minutes per call at
these sizes: off by default). ``--profile`` profiles rank 0's FSDP1 call once
per mode (after the timed ones) and prints its functions of most time.

Run from the repository root: the ranks import their work from this module.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

if not __package__:  # run as a script: tools is imported from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch
import torch.distributed as dist
import torch.nn as nn

from tools.benchmarks import bench_tasks

WIDTH, PER_BLOCK = 8, 20
# blocks of 20 Linear(8, 8): 40 keys a block ("80": two blocks, for a quick check that every call runs)
SIZES = {"80": 2, "2k": 50, "4k": 100, "10k": 250, "50k": 1250}
# variant -> (use_orig_params, sharding strategy); HYBRID_SHARD runs on a 2x2 mesh (replicate, shard)
VARIANTS = {
    "orig-full": (True, "FULL_SHARD"),
    "flat-full": (False, "FULL_SHARD"),
    "orig-grad_op": (True, "SHARD_GRAD_OP"),
    "flat-grad_op": (False, "SHARD_GRAD_OP"),
    "orig-hybrid": (True, "HYBRID_SHARD"),
    "flat-hybrid": (False, "HYBRID_SHARD"),
}
MODES = ("get", "set", "full_get", "bcast_set", "flat_get", "flat_set")
# Calls whose every value FSDP1 must make new, where FSDP2's makes none (see _new_values).
NEW_VALUE_MODES = ("get", "set", "flat_get", "flat_set")


def keys_of(size: str) -> int:
    return SIZES[size] * PER_BLOCK * 2


def _model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(PER_BLOCK)]) for _ in range(blocks)])


def _stepped(model: nn.Module):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, WIDTH)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _build(ctx, size: str, variant: str):
    """(FSDP2 model and optimizer, FSDP1 model and optimizer) of ``size`` and ``variant``, cached per process."""
    key = ("fsdp1-pair", size, variant)
    if key not in ctx.cache:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy, fully_shard

        ctx.cache.clear()
        orig, strategy = VARIANTS[variant]
        hybrid = strategy == "HYBRID_SHARD"
        mesh = ctx.mesh("2x2") if hybrid else ctx.mesh("4")
        two = _model(SIZES[size])
        for block in two:
            fully_shard(block, mesh=mesh, reshard_after_forward=strategy != "SHARD_GRAD_OP")
        fully_shard(two, mesh=mesh)
        wrap = {
            "device_id": torch.device("cpu"),
            "use_orig_params": orig,
            "sharding_strategy": getattr(ShardingStrategy, strategy),
            **({"device_mesh": mesh} if hybrid else {}),
        }
        one = _model(SIZES[size])
        one = FSDP(nn.Sequential(*[FSDP(block, **wrap) for block in one]), **wrap)
        ctx.cache[key] = (_stepped(two), _stepped(one))
    return ctx.cache[key]


def _timed(ctx, fn) -> tuple[float, float]:
    """(wall ms, CPU ms) of ``fn`` on the slowest rank in each: four ranks on
    fewer cores wait for each other, so a rank's CPU time is the steadier
    measure of the work a call does."""
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    got = fn()
    elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    del got
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed[0].item() * 1000, elapsed[1].item() * 1000


def _new_values(ctx, mode: str, model, opt) -> float:
    """The slowest rank's CPU ms to make each value of hyperdsd's get of the
    FSDP2 ``model`` new: a copy with its own storage and, for a DTensor, a
    new DTensor around it (as hyperdsd's FSDP1 twin makes them).

    FSDP2's get returns the optimizer's own tensors, and its set of what
    that get returned copies nothing (each value is already where it
    lands). FSDP1 keeps no tensor in the canonical layout: its get makes
    every value new, and its load lands every value in new rows before the
    flat shards. This is that floor, the least FSDP1's call does beyond
    FSDP2's, measured on the same values in the same run."""
    from torch.distributed.tensor import DTensor

    from hyperdsd import _compat
    from hyperdsd.api import _working
    from hyperdsd.tree import leaves

    impl = bench_tasks._impl("hyperdsd")
    options = bench_tasks._options(impl, flatten_optimizer_state_dict=mode.startswith("flat"))
    values = [t for _, t in leaves(impl.get_state_dict(model, opt, options=options)) if isinstance(t, torch.Tensor)]
    wrapped = [t for t in values if type(t) is DTensor]
    plain = [t for t in values if type(t) is not DTensor]
    locals_ = list(map(_compat.local_tensor, wrapped))
    specs = list(map(_compat.layout_token, wrapped))  # (each DTensor's spec)

    def made_new():
        # As hyperdsd's calls run: no autograd, the cyclic collector paused (its
        # walks of the process, not the work, cost 0.5 s at 10k).
        with _working():
            return _compat.dtensors_of(_compat.clones(locals_), specs) + _compat.clones(plain)

    return _timed(ctx, made_new)[1]


def time_pair(
    ctx, size: str, variant: str, mode: str, reps: int, torch_too: bool, profile: bool, sort="tottime", top=25
):
    """hyperdsd's ``mode`` on the FSDP2 and the FSDP1 model (and torch's on
    FSDP1), alternating, ``reps`` times each: slowest rank's ms each time;
    with ``profile``, rank 0's profile of one more FSDP1 call."""
    (m2, o2), (m1, o1) = _build(ctx, size, variant)
    contenders = {"fsdp2": ("hyperdsd", m2, o2), "fsdp1": ("hyperdsd", m1, o1)}
    if torch_too:
        contenders["torch"] = ("torch", m1, o1)
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    floor: list[float] = []
    for r in range(reps):
        if mode in NEW_VALUE_MODES:
            floor.append(_new_values(ctx, mode, m2, o2))
        for name in names[r % len(names) :] + names[: r % len(names)]:
            impl, model, opt = contenders[name]
            inputs = bench_tasks._prepare(ctx, impl, mode, model, opt)
            with ctx.under_test(name):
                wall, used = _timed(ctx, lambda: bench_tasks._op(ctx, impl, mode, model, opt, inputs))
            times[name].append(wall)
            cpu[name].append(used)
            del inputs
    report = ""
    if profile:
        inputs = bench_tasks._prepare(ctx, "hyperdsd", mode, m1, o1)
        prof = cProfile.Profile()
        dist.barrier()
        prof.enable()
        got = bench_tasks._op(ctx, "hyperdsd", mode, m1, o1, inputs)
        prof.disable()
        del got, inputs
        if ctx.rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(top)
            report = out.getvalue()
    return {"times": times, "cpu": cpu, "new": floor, "profile": report}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.benchmarks.bench_fsdp1",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="4k,10k")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="also torch's call on the FSDP1 model")
    parser.add_argument("--profile", action="store_true", help="profile rank 0's FSDP1 call once per mode")
    parser.add_argument("--profile-sort", default="tottime", help="pstats order of the profile (tottime, cumulative)")
    parser.add_argument("--profile-top", type=int, default=25, help="functions the profile lists")
    args = parser.parse_args()

    from hyperdsd.testing import PoolSet, Status, Task
    from tools.benchmarks import bench_fsdp1  # the ranks import the task by this name, not as __main__

    sizes = [s for s in args.sizes.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    modes = [m for m in args.modes.split(",") if m]
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    print(
        f"torch {torch.__version__}, 4 CPU ranks (gloo), {os.cpu_count()} cores, Linear({WIDTH}, {WIDTH}) blocks "
        f"of {PER_BLOCK} as units, AdamW, {args.reps} repetitions, medians of the slowest rank (ms)"
    )
    print(
        f"{'size':>5} {'variant':>13} {'mode':>10} {'FSDP2':>9} {'FSDP1':>9} {'FSDP1/2':>8} {'torch':>9}"
        f" {'CPU2':>8} {'CPU1':>8} {'CPU1/2':>7} {'new':>7} {'CPU1/(2+new)':>12}"
    )
    per_key: dict[tuple, float] = {}
    failed = False
    with PoolSet(gloo_timeout_s=900) as pools:
        for size in sizes:
            for variant in variants:
                for mode in modes:
                    params = {"size": size, "variant": variant, "mode": mode, "reps": args.reps}
                    profile = {"profile": args.profile, "sort": args.profile_sort, "top": args.profile_top}
                    task = Task(bench_fsdp1.time_pair, {**params, "torch_too": args.torch, **profile})
                    outcome = pools.run(4, task, 3600)
                    if outcome.status != Status.PASSED:
                        failed = True
                        print(f"{size:>5} {variant:>13} {mode:>10}  failed: {outcome.describe()[:300]}", flush=True)
                        continue
                    t, c = outcome.values[0]["times"], outcome.values[0]["cpu"]
                    two, one = statistics.median(t["fsdp2"]), statistics.median(t["fsdp1"])
                    theirs = f"{statistics.median(t['torch']):9.1f}" if t.get("torch") else f"{'-':>9}"
                    cpu2, cpu1 = statistics.median(c["fsdp2"]), statistics.median(c["fsdp1"])
                    row = f"{size:>5} {variant:>13} {mode:>10} {two:9.1f} {one:9.1f} {one / two:8.2f} {theirs}"
                    row += f" {cpu2:8.1f} {cpu1:8.1f} {cpu1 / cpu2:7.2f}"
                    new = outcome.values[0]["new"]
                    if new:
                        floor = statistics.median(new)
                        row += f" {floor:7.1f} {cpu1 / (cpu2 + floor):12.2f}"
                    print(row, flush=True)
                    per_key[(size, variant, mode, "fsdp1")] = one / keys_of(size)
                    per_key[(size, variant, mode, "fsdp2")] = two / keys_of(size)
                    if outcome.values[0]["profile"]:
                        print(outcome.values[0]["profile"], flush=True)
    if "10k" in sizes and "50k" in sizes:
        print("\nper key, 50k over 10k (target for FSDP1: at most 1.2, as FSDP2's):")
        for variant in variants:
            for mode in modes:
                got = [
                    per_key.get(("50k", variant, mode, w), 0) / per_key.get(("10k", variant, mode, w), 1)
                    for w in ("fsdp1", "fsdp2")
                ]
                print(f"{variant:>13} {mode:>10}  FSDP1 {got[0]:.2f}  FSDP2 {got[1]:.2f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
