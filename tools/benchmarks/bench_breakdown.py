"""Where a key's time goes in ``python -m tools.benchmarks.bench``: hyperdsd's CPU time
per key on the slowest rank, by category of the code it runs (cProfile's
shares, scaled to the unprofiled CPU time of the same op)."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import time

import torch.distributed as dist

from hyperdsd.testing import Status
from tools.benchmarks import bench_tasks
from tools.benchmarks.bench_tasks import _build, _op, _prepare

# Categories of the per-key breakdown: each of hyperdsd's modules in one
# (a test holds every module to that, so a moved module is not silently
# counted as "other"), torch's by the folder a function lives in. Built-in
# functions and torch's C methods count in their caller's category.
CATEGORIES = (
    (
        "FQN index",
        (
            "hyperdsd/state/keys/fqn.py",
            "hyperdsd/state/keys/index_cache.py",
            "hyperdsd/state/keys/hidden.py",
            "hyperdsd/wrappers.py",
        ),
    ),
    (
        "module/optimizer registries, state_dict() (torch)",
        (
            "hyperdsd/_compat/modules.py",
            "hyperdsd/_compat/registries.py",
            "torch/nn/modules/module.py",
            "torch/optim/",
            "torch/distributed/fsdp/",
            "torch/utils/hooks",
        ),
    ),
    (
        "checks (validation)",
        (
            "hyperdsd/api.py",
            "hyperdsd/options.py",
            "hyperdsd/errors.py",
            "hyperdsd/state/model.py",
            "hyperdsd/state/loading/in_place.py",
            "hyperdsd/state/optimizer/plan.py",
            "hyperdsd/state/optimizer/input.py",
            "hyperdsd/state/optimizer/values.py",
            "hyperdsd/state/placeholders/marks.py",
            "hyperdsd/state/placeholders/scratch.py",
            "hyperdsd/state/placeholders/saved.py",
        ),
    ),
    (
        "plan objects (Prepared, layouts)",
        ("hyperdsd/state/loading/plan.py", "hyperdsd/state/loading/checks.py", "hyperdsd/placement.py"),
    ),
    ("reading state (get)", ("hyperdsd/state/optimizer/state.py",)),
    ("applying (copies, new state)", ()),
    (
        "DTensor dispatch and construction",
        (
            "hyperdsd/_compat/tensors.py",
            "hyperdsd/_compat/__init__.py",
            "torch/distributed/tensor/",
            "torch/_dynamo",
            "torch/_compile",
            "torch/_ops",
            "torch/_library",
        ),
    ),
    ("tensors as dict keys (hash)", ("torch/_tensor.py",)),
    (
        "tree walks, flat layout, column blocks",
        ("hyperdsd/tree.py", "hyperdsd/blocks.py", "hyperdsd/state/keys/flat.py", "hyperdsd/state/keys/flat_keys.py"),
    ),
    (
        "FSDP1: twin, flat parameters",
        ("hyperdsd/fsdp1/", "hyperdsd/_compat/fsdp1.py"),
    ),
    ("buckets: packing, regions", ("hyperdsd/transport/", "hyperdsd/agreement.py")),
    (
        "checkpoint: plans, files",
        ("hyperdsd/checkpoint/", "hyperdsd/_compat/files.py", "torch/distributed/checkpoint/"),
    ),
    ("object collectives (pickle)", ("object", "pickle")),
    ("tensor collectives (waiting included)", ("torch/distributed/", "~:wait")),
)
# Modules no call runs code of: the package's namespace, sub-packages'
# docstrings, the test harness.
NOT_ON_A_CALL = (
    "hyperdsd/__init__.py",
    "hyperdsd/state/__init__.py",
    "hyperdsd/state/keys/__init__.py",
    "hyperdsd/state/loading/__init__.py",
    "hyperdsd/state/optimizer/__init__.py",
    "hyperdsd/state/placeholders/__init__.py",
    "hyperdsd/testing/",
)
TOP_FUNCTIONS = 12  # listed per mode with --breakdown-top
_READ = {"read_state", "_entry_copy", "_own", "_param_fqn", "_same", "offload", "_to_cpu"}
_APPLY = {"apply_load", "_loaded", "copy_into", "materialize", "receive", "redistribute", "_run_post_hooks"}


def _category(path: str, fn: str) -> str:
    if fn in _APPLY:
        return "applying (copies, new state)"
    if fn in _READ:
        return "reading state (get)"
    if "object" in fn or "pickle" in path or "pickle" in fn:
        return "object collectives (pickle)"
    for name, marks in CATEGORIES:
        if any(m in path for m in marks if m not in ("object", "pickle", "~:wait")):
            return name
    if path == "~" and fn.endswith("wait>"):
        return "tensor collectives (waiting included)"
    return "other (benchmark, Python)"


# The phases of a call (``--breakdown-phases``), each timed directly (CPU, no
# profiler: cProfile's cost per Python call would inflate the phases of many
# small calls): the functions that run it, as (module, attribute path) where
# the call looks them up; a phase a call does not run is left out. A phase
# that runs inside another is taken out of its time (_WITHIN).
PHASES = (
    ("the index (kept from the last call)", (("hyperdsd.state.keys.fqn", "ModelIndex.of"),)),
    ("the manifest (described, sent, received)", (("hyperdsd.agreement", "BroadcastAgreement.manifests"),)),
    ("planning the model's load", (("hyperdsd.state.model", "plan_load"),)),
    ("planning the optimizer's", (("hyperdsd.state.optimizer.plan", "plan_load"),)),
    ("a broadcast's needs", (("hyperdsd.agreement", "needs_for"),)),
    (
        "agreement (waiting included)",
        (("hyperdsd.agreement", "LocalAgreement.agree"), ("hyperdsd.agreement", "BroadcastAgreement.agree")),
    ),
    ("delivery (each piece into its tensor)", (("hyperdsd.agreement", "deliver"),)),
    ("applying", (("hyperdsd.api", "_Load._apply"),)),
    ("reading state", (("hyperdsd.state.model", "read_state"), ("hyperdsd.state.optimizer.state", "read_state"))),
    (
        "gathering to the root",
        (("hyperdsd.transport.consolidate", "full_model"), ("hyperdsd.transport.consolidate", "full_optimizer")),
    ),
)
_WITHIN = {"agreement (waiting included)": ("a broadcast's needs", "delivery (each piece into its tensor)")}


@contextlib.contextmanager
def _timed_phases(spent: dict[str, float]):
    """Every phase's functions wrapped to add their CPU seconds to ``spent``, put back after."""
    patched = []
    for name, where in PHASES:
        for module_name, path in where:
            owner = importlib.import_module(module_name)
            *parents, attr = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            original = inspect.getattr_static(owner, attr)
            patched.append((owner, attr, original))
            setattr(owner, attr, _timer(getattr(owner, attr), name, spent, original))
    try:
        yield
    finally:
        for owner, attr, original in reversed(patched):
            setattr(owner, attr, original)


def _timer(fn, name: str, spent: dict[str, float], original):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.process_time() - start

    if isinstance(original, classmethod):
        return classmethod(lambda cls, *a, **k: timed(*a, **k))  # (fn is bound already)
    return timed


def phases(ctx, size: str, mode: str, mesh: str = "4"):
    """hyperdsd's CPU time for one op on this rank, by phase (seconds), and in all."""
    model, opt = _build(ctx, size, mesh)
    inputs = _prepare(ctx, "hyperdsd", mode, model, opt)
    _op(ctx, "hyperdsd", mode, model, opt, inputs)  # warm up
    inputs = _prepare(ctx, "hyperdsd", mode, model, opt)
    spent: dict[str, float] = {}
    with _timed_phases(spent):
        dist.barrier()
        start = time.process_time()
        got = _op(ctx, "hyperdsd", mode, model, opt, inputs)
        cpu = time.process_time() - start
    del got  # released untimed, as in the timed runs
    for outer, inner in _WITHIN.items():
        if outer in spent:
            spent[outer] -= sum(spent.get(name, 0.0) for name in inner)
    return {"rank": ctx.rank, "cpu_s": cpu, "phases": spent}


def breakdown(ctx, size: str, mode: str, mesh: str = "4"):
    """hyperdsd's CPU time for one op on this rank (unprofiled) and its
    profiled CPU time by category (seconds), built-ins counted in their
    caller's category."""
    import cProfile
    import pstats

    model, opt = _build(ctx, size, mesh)
    inputs = _prepare(ctx, "hyperdsd", mode, model, opt)
    _op(ctx, "hyperdsd", mode, model, opt, inputs)  # warm up
    inputs = _prepare(ctx, "hyperdsd", mode, model, opt)
    dist.barrier()
    start = time.process_time()
    got = _op(ctx, "hyperdsd", mode, model, opt, inputs)
    cpu = time.process_time() - start
    del got  # released untimed, as in the timed runs
    inputs = _prepare(ctx, "hyperdsd", mode, model, opt)
    dist.barrier()
    prof = cProfile.Profile(time.process_time)  # CPU time: the machine is shared
    prof.enable()
    got = _op(ctx, "hyperdsd", mode, model, opt, inputs)
    prof.disable()
    del got
    by_cat: dict[str, float] = {}
    by_fn: dict[str, float] = {}  # the same time by function

    def credit(path: str, line: int, fn: str, seconds: float) -> None:
        cat, name = _category(path, fn), _function_name(path, line, fn)
        by_cat[cat] = by_cat.get(cat, 0.0) + seconds
        by_fn[name] = by_fn.get(name, 0.0) + seconds

    for (path, line, fn), (_, _, tt, _, callers) in pstats.Stats(prof).stats.items():
        if path == "~" and callers and not fn.endswith("wait>"):
            for caller, edge in callers.items():  # a built-in: its callers', by share
                credit(*caller, edge[2])
        else:
            credit(path, line, fn, tt)
    top = sorted(by_fn.items(), key=lambda kv: -kv[1])[:TOP_FUNCTIONS]
    return {"rank": ctx.rank, "cpu_s": cpu, "profiled": by_cat, "top": top}


def _function_name(path: str, line: int, fn: str) -> str:
    for root in ("hyperdsd/", "torch/", "tools/"):
        if root in path:
            return f"{root}{path.split(root, 1)[1]}:{line}({fn})"
    return f"{path}:{line}({fn})"


def table(pools, sizes: list[str], modes: list[str], top: bool = False, phases: bool = False) -> None:
    from hyperdsd.testing import Task

    print(
        "\nwhere a key's time goes: hyperdsd's CPU time per key (us), slowest rank; "
        "cProfile shares scaled to the unprofiled CPU time"
    )
    for size in sizes:
        keys = bench_tasks.keys_of(size)
        columns: dict[str, dict[str, float]] = {}
        by_phase: dict[str, dict[str, float]] = {}
        for mode in modes:
            outcome = pools.run(4, Task(breakdown, {"size": size, "mode": mode}), 3600)
            if outcome.status != Status.PASSED:
                print(f"{size} {mode}: failed: {outcome.describe()[:300]}")
                continue
            slowest = max(outcome.values, key=lambda v: v["cpu_s"])
            profiled = sum(slowest["profiled"].values()) or 1.0
            scale = slowest["cpu_s"] / profiled
            columns[mode] = {cat: sec * scale / keys * 1e6 for cat, sec in slowest["profiled"].items()}
            columns[mode]["total"] = slowest["cpu_s"] / keys * 1e6
            if phases:
                by_phase[mode] = _phases_of(pools, size, mode)
            if top:
                print(f"\n{size} {mode}: the {TOP_FUNCTIONS} functions of most CPU time per key (us), slowest rank")
                for name, sec in slowest["top"]:
                    print(f"  {sec * scale / keys * 1e6:8.2f}  {name}")
        if not columns:
            continue
        if phases and by_phase:
            _print_phases(size, by_phase)
        cats = [name for name, _ in CATEGORIES] + ["other (benchmark, Python)"]
        print(f"\n  {f'{size} ({keys} keys)':<50}" + "".join(f"{m:>10}" for m in columns))
        for cat in cats + ["total"]:
            if cat != "total" and not any(col.get(cat, 0.0) >= 0.05 for col in columns.values()):
                continue
            print(f"  {cat:<50}" + "".join(f"{col.get(cat, 0.0):10.1f}" for col in columns.values()), flush=True)


def _phases_of(pools, size: str, mode: str) -> dict[str, float]:
    """Each phase's CPU ms on the rank whose op took the most CPU."""
    from hyperdsd.testing import Task

    outcome = pools.run(4, Task(phases, {"size": size, "mode": mode}), 3600)
    if outcome.status != Status.PASSED:
        print(f"{size} {mode} phases: failed: {outcome.describe()[:300]}")
        return {}
    slowest = max(outcome.values, key=lambda v: v["cpu_s"])
    return {**{name: sec * 1e3 for name, sec in slowest["phases"].items()}, "the call": slowest["cpu_s"] * 1e3}


def _print_phases(size: str, by_phase: dict[str, dict[str, float]]) -> None:
    print(f"\n  {f'{size}: phases, CPU ms, slowest rank':<50}" + "".join(f"{m:>10}" for m in by_phase))
    for name in [n for n, _ in PHASES] + ["the call"]:
        if any(name in col for col in by_phase.values()):
            print(f"  {name:<50}" + "".join(f"{col.get(name, 0.0):10.1f}" for col in by_phase.values()), flush=True)
