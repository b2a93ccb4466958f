"""SPEC §3 Round trip (OPT-RT)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kit import (
    BASE,
    ENDS,
    FSDP1,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
    FSDP1_HYBRID,
    MODES,
    SHARDED_STAGES,
    Clause,
    GroupSpec,
    Layout,
    ModelConfig,
    ReceiveMeter,
    Setup,
    ToyModel,
    check,
    clone_tree,
    diff_snapshots,
    diff_values,
    fail_if,
    get_options,
    grid,
    make_case,
    nested,
    optimizers_arg,
    resuming,
    saving,
    set_options,
    snapshot,
    tensors,
)

OPTS = ("adamw", "adam_amsgrad", "sgd", "sgd_plain", "adagrad")
BEFORE, AFTER = 1, 1
# The warm target's own steps (OPT-RT-5): not the checkpoint's count, so a
# load that keeps the target's ``step`` shows.
WARM = 2


def rt_1(c, layout, opt, mode, before=BEFORE, after=AFTER, how=None):
    """Resume in a fresh setup; K more steps must match the uninterrupted run bitwise.

    ``before=0``: the checkpoint is taken before the first step (as training
    scripts save at step 0), so it holds whatever get gives for an optimizer
    that never stepped; resuming from it must be like starting afresh.
    ``how``: the recipe to build (a generated scenario's); the matrix's own
    cases build the base model with ``opt``.
    """
    r = resuming.resume(c, how or resuming.recipe(layout, opt), mode, before=before, after=after)
    fail_if(
        diff_snapshots(*saving.comparable(mode, r.resumed, r.expected, snapshot(r.resumed))),
        f"{mode}: after resuming, the run differs from the uninterrupted one",
    )


def rt_5(c, layout, opt, mode, before=BEFORE, after=AFTER, warm=WARM, how=None):
    """A rollback: load into a target that trained first (other data, other
    steps, other hyperparameters). Right after the load nothing of its own
    state remains; K more steps match the uninterrupted run bitwise."""
    seen = {}
    r = resuming.resume(
        c,
        how or resuming.recipe(layout, opt),
        mode,
        before=before,
        after=after,
        warm=warm,
        on_saving=lambda a: seen.update(want=snapshot(a)),
        on_loaded=lambda b: seen.update(got=snapshot(b)),
    )
    fail_if(
        diff_snapshots(*saving.comparable(mode, r.resumed, seen["want"], seen["got"])),
        f"{mode}: after loading into a stepped optimizer, it does not reproduce the source (its own state remains)",
    )
    fail_if(
        diff_snapshots(*saving.comparable(mode, r.resumed, r.expected, snapshot(r.resumed))),
        f"{mode}: after a warm load, the run differs from the uninterrupted one",
    )


def rt_4(c, layout, opt, mode):
    """Everything at once: tied weights, a parameter that never gets a
    gradient, a frozen parameter with state, an empty group between two
    others, custom group fields and an LR scheduler."""
    pipeline = layout.pp > 1
    cfg = ModelConfig().everything(pipeline=pipeline)
    freeze = ["layers.0.fc1.weight"] if not pipeline or "layers.0.fc1.weight" in _names(c, layout, cfg) else []

    def make(seed):
        s = Setup(
            c,
            layout,
            opt,
            seed=seed,
            cfg=cfg,
            scheduler=True,
            groups=GroupSpec.for_seed(seed, empty_at=(1,), extra=(("name", f"run{seed}"), ("custom", seed))),
        )
        return s

    a = make(0)
    a.train(BEFORE)
    a.freeze(freeze)  # state from before it was frozen must survive
    saved = saving.save(c, a, mode)
    sched_states = [sch.state_dict() for sch in a.schedulers]
    a.train(AFTER)
    b = make(1)
    b.freeze(freeze)
    b.set_steps_done(BEFORE)
    saving.load(c, b, saved)
    for sched, st in zip(b.schedulers, sched_states):
        sched.load_state_dict(st)
    b.train(AFTER)
    want, got = saving.comparable(mode, b, snapshot(a), snapshot(b))
    fail_if(
        diff_snapshots(want, got),
        f"{mode}: with every feature at once, the resumed run differs from the uninterrupted one",
    )


def _names(c, layout: Layout, cfg) -> set:
    model = ToyModel(cfg)
    if layout.pp > 1:
        model.keep_stage(c.mesh(layout.mesh, layout.dim_names).get_coordinate()[0], layout.pp)
    return {n for n, _ in model.named_parameters()}


def rt_2(c, layout, opt, mode):
    """get, set into a fresh setup, get: the same dict, value for value."""
    a = Setup(c, layout, opt)
    a.train(2)
    get_opts = get_options(c.iut, mode)
    first = clone_tree(c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_opts))
    b = Setup(c, layout, opt, seed=1)
    saving.load_reference_model(b, a.module.state_dict())
    c.iut.set_optimizer_state_dict(b.model, optimizers_arg(b), clone_tree(first), options=set_options(c.iut, mode))
    second = c.iut.get_optimizer_state_dict(b.model, optimizers_arg(b), options=get_opts)
    if mode.on_root and c.rank != 0:
        check(
            not _holds_state(first) and not _holds_state(second),
            f"{mode}: ranks other than 0 must get an empty dict (or the empty structure)",
        )
        return
    fail_if(diff_values(first, second, "optim"), f"{mode}: get after set returns a different dict")


def rt_3(c, layout, opt):
    """full_cpu: rank 0 holds full CPU tensors equal to the gathered shards;
    the others get nothing, and never receive the full state on the way."""
    a = Setup(c, layout, opt)
    a.train(2)
    with ReceiveMeter() as meter:
        osd = c.iut.get_optimizer_state_dict(a.model, optimizers_arg(a), options=get_options(c.iut, "full_cpu"))
    # The oracle: the suite gathers every rank's own state itself (FSDP1's flat shards by original parameter).
    gathered = a.gathered()
    if gathered is not None:
        want = _cpu({k: e for k, e in gathered["state"].items() if e})
    else:
        mine = {k: {kk: _full(vv) for kk, vv in e.items()} for k, e in snapshot(a)["state"].items()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, _cpu(mine))
        want = {}
        for part in everyone:  # pipeline stages: rank 0 must hold every stage
            want.update(part)
    if c.rank != 0:
        check(
            not _holds_state(osd),
            f"full_cpu on rank {c.rank}: expected an empty dict (or the empty structure, no state), got "
            f"{len(osd.get('state', {}))} state entries",
        )
        total = sum(_nbytes(v) for e in want.values() for v in e.values())
        # Only the root gathers: another rank may receive control messages
        # (names, shapes: they grow with the number of entries, and outweigh
        # the state of the suite's small models), never the state's tensors
        # (SPEC OPT-RT-3: no full copy there).
        check(
            meter.payload < max(total, 1),
            f"full_cpu on rank {c.rank}: received {meter.payload} bytes of tensors ({meter.total} in all) while "
            f"rank 0 gathered {total} bytes of state; a rank other than 0 must not hold a full copy",
        )
        return
    problems = []
    for path, value in _tensors(osd.get("state", {})):
        if tensors.is_distributed(value):
            problems.append(f"optim{path}: a {type(value).__name__}, expected a full tensor")
        elif value.device.type != "cpu":
            problems.append(f"optim{path}: on {value.device}, expected cpu")
    problems += diff_values(want, osd.get("state", {}), "optim['state']")
    fail_if(problems, "full_cpu on rank 0 does not hold the full state")


def _holds_state(osd) -> bool:
    """Whether a get's dict holds any state (SPEC OPT-RT-3: ranks other than the root get ``{}``, or the
    empty structure: no state entry, and no tensor anywhere)."""
    if not osd:
        return False
    if not isinstance(osd, dict) or osd.get("state"):
        return True
    return any(isinstance(leaf, torch.Tensor) for _, leaf in nested.leaves(osd))


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _full(v):
    return tensors.full(v)


def _cpu(state):
    return nested.rebuild(
        state, lambda leaf, _path: leaf.detach().cpu().clone() if isinstance(leaf, torch.Tensor) else leaf
    )


def _tensors(state):
    return ((nested.where(path), leaf) for path, leaf in nested.leaves(state) if isinstance(leaf, torch.Tensor))


def cases():
    yield from grid("OPT-RT-1", BASE, rt_1, opts=OPTS, modes=MODES)
    yield from grid("OPT-RT-4", BASE, rt_4, opts=("adamw", "adagrad"), modes=MODES)
    for i, layout in enumerate(BASE):  # every layout and mode; the optimizers rotate over both
        for j, mode in enumerate(MODES):
            yield make_case("OPT-RT-5", layout, rt_5, opt=OPTS[(i + j) % len(OPTS)], mode=mode)
    step0 = {"step0": {"before": 0}}
    yield from grid("OPT-RT-1", ENDS | SHARDED_STAGES, rt_1, opts=("adamw", "adagrad"), modes=MODES, variants=step0)
    # A rollback to a checkpoint taken before the first step.
    yield from grid("OPT-RT-5", ENDS | SHARDED_STAGES, rt_5, opts=("adamw",), modes=MODES, variants=step0)
    # SGD with momentum keeps no step: its saved template (zero buffers) is told
    # from real state only by all of an optimizer's buffers together.
    for layout in ENDS:
        for mode in MODES:
            yield make_case("OPT-RT-1", layout, rt_1, opt="sgd", mode=mode, variant="step0", before=0)
            yield make_case("OPT-RT-5", layout, rt_5, opt="sgd", mode=mode, variant="step0", before=0)
    for layout in ENDS:  # the same, with frozen parameters: state the warm target has none for
        frozen = resuming.recipe(layout, "adamw", cfg=ModelConfig(frozen=True))
        yield make_case("OPT-RT-5", layout, rt_5, opt="adamw", mode="dcp", variant="step0-frozen", before=0, how=frozen)
    # Optional: FSDP over tensor parallelism (strided shards), the one such layout.
    yield from grid("OPT-RT-1", ("fsdp2xtp2",), rt_1, opts=("adamw",), modes=MODES, profile="tp")
    # FSDP1 (SPEC §2, 1.3): every mode with AdamW and with the other optimizers in turn; warm targets alike.
    for i, layout in enumerate(FSDP1):
        for j, mode in enumerate(MODES):
            other = OPTS[1 + (i + j) % (len(OPTS) - 1)]
            yield make_case("OPT-RT-1", layout, rt_1, opt="adamw", mode=mode)
            yield make_case("OPT-RT-1", layout, rt_1, opt=other, mode=mode)
            yield make_case("OPT-RT-5", layout, rt_5, opt=OPTS[(i + j) % len(OPTS)], mode=mode)
    # (OPT-RT-4 freezes one parameter of a unit: a flat parameter freezes whole, so original parameters only.)
    yield from grid("OPT-RT-4", FSDP1_FULL, rt_4, opts=("adamw",), modes=MODES)
    yield from grid(
        "OPT-RT-2", BASE | FSDP1_FULL_SHARD, rt_2, opts=("adamw",), modes=("sharded", "full", "full_cpu", "flat")
    )
    yield from grid("OPT-RT-3", BASE, rt_3, opts=("adamw", "sgd"), modes=("full_cpu",))
    yield from grid("OPT-RT-3", FSDP1_FULL_SHARD | FSDP1_HYBRID, rt_3, opts=("adamw",), modes=("full_cpu",))


CLAUSES = {
    "OPT-RT-1": Clause(
        contains=lambda s: not s.warm, check=lambda s: (rt_1, s.trained_args(before=s.before, after=s.after)), rank=150
    ),
    "OPT-RT-2": Clause(),
    "OPT-RT-3": Clause(side="get"),
    "OPT-RT-4": Clause(),
    "OPT-RT-5": Clause(
        contains=lambda s: bool(s.warm),
        check=lambda s: (rt_5, s.trained_args(before=s.before, after=s.after, warm=s.warm)),
        rank=140,
    ),
}
