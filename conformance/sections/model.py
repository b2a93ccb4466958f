"""SPEC §3 Model state dict (MODEL)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from ..kit import (
    BASE,
    DATA_PARALLEL,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
    FSDP1_HYBRID,
    FSDP1_SHARD_GRAD_OP,
    HALVED,
    HYBRID,
    MODES,
    ONE_RANK,
    QUARTERS,
    SHARDED,
    THIRDS,
    WRAPPERS,
    Clause,
    Layout,
    ModelConfig,
    ReceiveMeter,
    Setup,
    ToyModel,
    check,
    clone_tree,
    diff_values,
    expect_error,
    fail_if,
    fsdp1,
    get_options,
    grid,
    make_case,
    saving,
    set_options,
    tensors,
)


def _model_view(s) -> dict:
    """Parameters, persistent buffers and extra state (MODEL-5 only), by canonical name."""
    out = {k: clone_tree(v) for k, v in s.module.state_dict().items()}
    return {".".join(p for p in k.split(".") if p != "_checkpoint_wrapped_module"): v for k, v in out.items()}


def model_1(c, layout, mode, wrappers=(), tie=False, cfg=None):
    """Round trip in every mode; keys are those of the unwrapped model's state_dict
    (wrapper segments left out, a tied parameter under each of its names).
    ``cfg``: another model than the base one (a generated scenario's)."""
    cfg = replace(cfg, tie=cfg.tie or tie) if cfg is not None else ModelConfig(tie=tie)
    a = Setup(c, layout, "adamw", wrappers=wrappers, cfg=cfg)
    a.train(1)
    plain = ToyModel(a.cfg)
    if a.layout.pp > 1:
        plain.keep_stage(a.stage, a.layout.pp)
    expected_keys = list(plain.state_dict())
    msd = c.iut.get_model_state_dict(a.model, options=get_options(c.iut, mode))
    rank0_holds_all = mode.on_root
    want_keys = _all_ranks_keys(expected_keys) if rank0_holds_all else expected_keys  # a collective: every rank
    want = _model_view(a)
    saved = saving.save(c, a, mode, model="iut", optim=False)
    b = Setup(c, layout, "adamw", seed=1, wrappers=wrappers, cfg=cfg)
    saving.load(c, b, saved, optim=False)
    fail_if(diff_values(want, _model_view(b), "model"), f"{mode}: the model does not round-trip")
    if not rank0_holds_all or c.rank == 0:
        fail_if(
            sorted(set(want_keys) ^ set(msd)),
            "model keys differ from model.state_dict() of the unwrapped model (symmetric difference)",
        )
        check("tok.cache" not in msd, "a non-persistent buffer is in the model state dict")
    else:
        check(not msd, f"{mode}: rank {c.rank} must get an empty dict, got {len(msd)} keys")


def _unwrapped(block: torch.nn.Module) -> torch.nn.Module:
    """The block itself, under activation checkpointing's or FSDP1's wrapper."""
    for attr in ("_fsdp_wrapped_module", "_checkpoint_wrapped_module"):
        block = getattr(block, attr, block)
    return block


def model_5(c, layout, mode, kind, cfg=None):
    """Extra state of ``kind`` (a tensor, a dict, a picklable object) round-trips under its ``_extra_state`` key."""
    cfg = replace(cfg or ModelConfig(), extra_state=kind)
    a = Setup(c, layout, "adamw", cfg=cfg)
    a.train(1)
    msd = c.iut.get_model_state_dict(a.model, options=get_options(c.iut, mode))
    want = {k: v for k, v in _model_view(a).items() if k.endswith("_extra_state")}
    check(want, "setup error: the model has no extra state")
    if not mode.on_root or c.rank == 0:
        fail_if(
            diff_values(want, {k: msd[k] for k in want if k in msd}, "model")
            + [f"{k}: missing from get's dict" for k in want if k not in msd],
            f"{mode}: get lost extra state",
        )
    saved = saving.save(c, a, mode, model="iut", optim=False)
    b = Setup(c, layout, "adamw", seed=1, cfg=cfg)
    blocks = {name: _unwrapped(blk) for name, blk in b.module.layers.items()}
    for block in blocks.values():
        block.index = -1  # extra state must come back from the checkpoint
    saving.load(c, b, saved, optim=False)
    got_index = {name: blk.index for name, blk in blocks.items()}
    check(all(int(n) == i for n, i in got_index.items()), f"{mode}: {kind} extra state was not restored: {got_index}")
    fail_if(
        diff_values(_model_view(a), _model_view(b), "model"),
        f"{mode}: a model with {kind} extra state does not round-trip",
    )


def _all_ranks_keys(keys: list[str]) -> list[str]:
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    return sorted({k for ks in everyone for k in ks})


def model_2(c, layout, mode, strict, cfg=None):
    """Missing and unexpected keys: strict raises naming them; strict=False returns them.
    ``cfg``: another model than the base one (a generated scenario's); its last block loses a key."""
    a = Setup(c, layout, "adamw", cfg=cfg)
    if mode.every_rank_reads:  # every rank reads the file rank 0 saved
        msd = saving.read_full(saving.save(c, a, mode, model="iut", optim=False).path)["model"]
    else:
        msd = clone_tree(c.iut.get_model_state_dict(a.model, options=get_options(c.iut, mode)))
    gone = f"layers.{a.cfg.n_layers - 1}.fc2.bias"
    if not mode.broadcast or c.rank == 0:  # a broadcast reads only rank 0's dict (the others got {})
        msd.pop(gone)
        msd["ghost.weight"] = torch.zeros(2)
    b = Setup(c, layout, "adamw", seed=1, cfg=cfg)
    opts = set_options(c.iut, mode, strict=strict)
    if strict:
        expect_error(
            lambda: c.iut.set_model_state_dict(b.model, msd, options=opts),
            names=[gone, "ghost.weight"],
            what="MODEL-2: strict load with a missing and an unexpected key",
        )
        return
    result = c.iut.set_model_state_dict(b.model, msd, options=opts)
    missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    check(missing == [gone], f"missing_keys = {missing}, expected [{gone!r}]")
    check(unexpected == ["ghost.weight"], f"unexpected_keys = {unexpected}, expected ['ghost.weight']")
    want = {k: v for k, v in _model_view(a).items() if k != gone}
    got = {k: v for k, v in _model_view(b).items() if k != gone}
    fail_if(diff_values(want, got, "model"), "MODEL-2: strict=False did not load the other keys")


def model_3(c, layout, cfg=None):
    """broadcast from rank 0 into a sharded model: values, DTensors kept, bounded memory in flight.

    The bound counts the state bytes a non-root rank receives in total
    (SPEC 1.2): its own share of the model plus one tensor in flight. A
    bound on the largest receive alone never binds on the suite's small
    models, and a load that sends every rank whole tensors, each cutting its
    own shard, gets every value right."""
    a = Setup(c, layout, "adamw", cfg=cfg)
    a.train(1)
    want = _model_view(a)
    saved = saving.save(c, a, "bcast", model="iut", optim=False)
    b = Setup(c, layout, "adamw", seed=1, cfg=cfg)
    data = saving.read_full(saved.path) if c.rank == 0 else {"model": {}}
    largest_full = max(
        (v.numel() * v.element_size() for v in data["model"].values() if isinstance(v, torch.Tensor)), default=0
    )
    box = [largest_full]
    dist.broadcast_object_list(box, src=0)
    largest_full = box[0]
    flat_shards = layout.wrapper == "fsdp1"  # FSDP1 holds plain flat shards, not distributed values
    share = fsdp1.share_bytes(b.model) if flat_shards else share_bytes(b.module.state_dict())
    with ReceiveMeter() as meter:
        c.iut.set_model_state_dict(b.model, data["model"], options=set_options(c.iut, "bcast"))
    fail_if(diff_values(want, _model_view(b), "model"), "broadcast load: values differ")
    if not flat_shards:
        not_dt = [f for f, p in b.named_parameters() if not tensors.is_distributed(p)]
        check(not not_dt, f"parameters are no longer distributed after the load: {not_dt[:5]}")
    if c.rank != 0:
        limit = max(largest_full, 1 << 20)
        check(meter.calls > 0, "no torch.distributed call delivered rank 0's tensors; the transfer cannot be checked")
        check(
            meter.largest <= limit,
            f"rank {c.rank} received {meter.largest} bytes in one call; at most one tensor ({largest_full} bytes, "
            f"or a 1 MiB bucket of small pieces) may be in flight",
        )
        bound = receive_bound(share, largest_full)
        check(
            meter.payload <= bound,
            f"rank {c.rank} received {meter.payload} bytes of tensors in all; its own share of the model is {share} "
            f"bytes, and with one tensor in flight ({largest_full} bytes) it may receive at most {bound}: "
            f"it was sent more than its shard",
        )


def share_bytes(state: dict) -> int:
    """The bytes a rank holds of a model's state dict: the local shard of
    each distributed value, each other tensor whole (what it loads into)."""
    return sum(tensors.local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))


def receive_bound(share: int, in_flight: int) -> int:
    """What a non-root rank may receive of tensors in a broadcast load
    (MODEL-3): its own share plus one tensor in flight. On the matrix's
    models that allowance also covers what a bucketed scatter pads (every
    rank's buffer as wide as the widest rank's pieces, on uneven shards),
    though not on models of a few bytes a rank (dimensions of 1, as
    generated scenarios draw), while a whole copy of every tensor exceeds it
    on every layout that shards."""
    return share + in_flight


def model_4(c, layout, mode):
    """A model built on the meta device, then sharded, loads full and broadcast dicts."""
    a = Setup(c, layout, "adamw")
    a.train(1)
    want = _model_view(a)
    saved = saving.save(c, a, mode, model="iut", optim=False)
    b = Setup(c, layout, "adamw", seed=1, meta=True, with_optimizer=False)
    saving.load(c, b, saved, optim=False)
    got = _model_view(b)
    on_meta = [k for k, v in got.items() if isinstance(v, torch.Tensor) and v.device.type == "meta"]
    check(not on_meta, f"still on the meta device after loading: {on_meta[:5]}")
    fail_if(diff_values(want, got, "model"), f"{mode}: loading into a meta-initialised model gave other values")
    if layout.world_size != 1 and layout.wrapper != "fsdp1":  # FSDP1 holds plain flat shards
        not_dt = [f for f, p in b.named_parameters() if not tensors.is_distributed(p)]
        check(not not_dt, f"parameters are not distributed after the load: {not_dt[:5]}")


def cases():
    yield from grid("MODEL-1", BASE, model_1, modes=MODES)
    for layout, variants in WRAPPERS.items():
        for wrappers in [w for w in variants if w]:
            for mode in ("sharded", "full"):
                yield make_case(
                    "MODEL-1", layout, model_1, mode=mode, variant="+".join(wrappers), wrappers=wrappers, deadline_s=120
                )
    yield from grid(
        "MODEL-1",
        ONE_RANK | HALVED | HYBRID,
        model_1,
        modes=("sharded", "full", "dcp"),
        variants={"tied": {"tie": True}},
    )
    # FSDP1 (SPEC §2, 1.3): every mode on both kinds of parameters, two on the others; wrappers.
    yield from grid("MODEL-1", FSDP1_FULL_SHARD, model_1, modes=MODES)
    yield from grid("MODEL-1", FSDP1_HYBRID, model_1, modes=("sharded", "bcast"))
    yield from grid("MODEL-1", FSDP1_SHARD_GRAD_OP, model_1, modes=("full", "dcp"))
    yield from grid(
        "MODEL-1",
        FSDP1_FULL,
        model_1,
        modes=("sharded", "full"),
        variants={"checkpoint+compile": {"wrappers": ("checkpoint", "compile")}},
        deadline_s=120,
    )
    strictness = {"strict": {"strict": True}, "nonstrict": {"strict": False}}
    yield from grid("MODEL-2", FSDP1_FULL, model_2, modes=("sharded", "full", "bcast", "file"), variants=strictness)
    # Optional: FSDP over tensor parallelism, the one such layout.
    yield from grid("MODEL-1", ("fsdp2xtp2",), model_1, modes=("sharded", "full", "bcast", "dcp"), profile="tp")
    for layout in HALVED:
        for kind in ("tensor", "dict", "object"):
            for mode in MODES:
                yield make_case("MODEL-5", layout, model_5, mode=mode, variant=kind, kind=kind)
    for i, layout in enumerate(FSDP1_FULL_SHARD):  # FSDP1 (SPEC §2, 1.3): every mode, kinds in turn
        for j, mode in enumerate(MODES):
            kind = ("tensor", "dict", "object")[(i + j) % 3]
            yield make_case("MODEL-5", layout, model_5, mode=mode, variant=kind, kind=kind)
    yield from grid("MODEL-2", DATA_PARALLEL, model_2, modes=("sharded", "full", "bcast", "file"), variants=strictness)
    yield from grid("MODEL-3", SHARDED | FSDP1_FULL_SHARD | FSDP1_HYBRID, model_3, modes=("bcast",))
    tiny = ModelConfig(vocab=2, dim=1, hidden=1, n_layers=1, aux_out=1)  # a few bytes a rank, shards uneven
    yield from grid("MODEL-3", HALVED | QUARTERS, model_3, modes=("bcast",), variants={"tiny": {"cfg": tiny}})
    yield from grid("MODEL-4", (SHARDED - THIRDS) | FSDP1_FULL_SHARD, model_4, modes=("full", "bcast"))


def _sharded(layout: Layout) -> bool:
    """Whether FSDP2 shards the model over more than one rank: a broadcast
    load there must send each rank its own shard, not the whole (MODEL-3)."""
    return layout.wrapper == "fsdp2" and layout.world_size > 1


CLAUSES = {
    "MODEL-1": Clause(
        contains=lambda s: True,
        check=lambda s: (model_1, {"layout": s.built_on, "mode": s.kind, "cfg": s.cfg()}),
        rank=60,
    ),
    "MODEL-2": Clause(
        contains=lambda s: bool(s.model_keys),
        check=lambda s: (
            model_2,
            {"layout": s.built_on, "mode": s.kind, "strict": s.model_keys == "strict", "cfg": s.cfg()},
        ),
        rank=30,
    ),
    "MODEL-3": Clause(
        contains=lambda s: s.kind.broadcast and s.kind.file and _sharded(s.built_on),
        check=lambda s: (model_3, {"layout": s.built_on, "cfg": s.cfg()}),
        rank=10,
    ),
    "MODEL-4": Clause(),
    "MODEL-5": Clause(
        contains=lambda s: bool(s.extra_state),
        check=lambda s: (model_5, {"layout": s.built_on, "mode": s.kind, "kind": s.extra_state, "cfg": s.cfg()}),
        rank=20,
    ),
}
