"""SPEC §3 DTensor retention (OPT-DT)."""

from __future__ import annotations

import torch

from ..kit import (
    ENDS,
    FSDP1_FULL_SHARD,
    HALVED,
    HYBRID,
    MODES,
    SHARDED,
    Clause,
    ModelConfig,
    NotApplicable,
    Setup,
    check,
    diff_values,
    fail_if,
    get_options,
    grid,
    layout_problems,
    make_case,
    optimizers_arg,
    saving,
    snapshot,
    tensors,
)


def dt_1(c, layout, opt):
    """Sharded get returns DTensor state with the parameter's global shape, mesh and placements."""
    s = Setup(c, layout, opt)
    s.train(2)
    osd = c.iut.get_optimizer_state_dict(s.model, optimizers_arg(s), options=get_options(c.iut, "sharded"))
    params = dict(s.named_parameters())
    fail_if(layout_problems(osd["state"], params, "state", local=False), "sharded get did not keep DTensor state")


def dt_2(c, layout, mode):
    """After set, state of DTensor parameters is DTensor: mesh, placements, local shape, device; step keeps its type."""
    a = Setup(c, layout, "adamw")
    a.train(2)
    saved = saving.save(c, a, mode)
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1)
    saving.load(c, b, saved)
    got = snapshot(b)
    params = dict(b.named_parameters())
    problems = layout_problems(got["state"], params, "state", local=True)
    for fqn, entry in want["state"].items():
        if "step" in entry and fqn in got["state"] and type(got["state"][fqn].get("step")) is not type(entry["step"]):
            problems.append(
                f"state[{fqn!r}]['step']: a {type(got['state'][fqn].get('step')).__name__}, "
                f"was a {type(entry['step']).__name__}"
            )
    fail_if(problems, f"{mode}: state after set is not laid out like its parameter")


def dt_3(c, layout, mode):
    """State in a dtype other than the parameter's (fp32 moments, bf16 parameters) keeps its dtype."""
    cfg = ModelConfig(dtype=torch.bfloat16)
    a = Setup(c, layout, "adamw", cfg=cfg)
    a.train(1)
    _moments_to_fp32(a)
    want = snapshot(a)
    check(
        any(v.dtype == torch.float32 for e in want["state"].values() for k, v in e.items() if k != "step"),
        "setup error: no fp32 state",
    )
    saved = saving.save(c, a, mode)
    b = Setup(c, layout, "adamw", seed=1, cfg=cfg)
    b.train(1)  # bf16 state of its own, to be replaced
    if mode.through_dcp:
        # DCP copies into the template it is given, in the template's dtype:
        # a resuming job has the same fp32 moments as the one that saved.
        _moments_to_fp32(b)
    saving.load(c, b, saved)
    got = snapshot(b)
    fail_if(diff_values(want["state"], got["state"], "state"), f"{mode}: state dtypes or values were not kept")


def _moments_to_fp32(s) -> None:
    with torch.no_grad():
        for opt in s.optimizers:
            for entry in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    entry[key] = entry[key].float()


def dt_4(c, layout, mode, pinned):
    """(inplace) Loading into existing state writes into the same tensors and storage."""
    if pinned and not torch.cuda.is_available():
        raise NotApplicable("pinned host memory needs an accelerator; this machine has none")
    a = Setup(c, layout, "adamw")
    a.train(2)
    saved = saving.save(c, a, mode)
    want = snapshot(a)
    b = Setup(c, layout, "adamw", seed=1)
    b.train(1)
    if pinned:
        with torch.no_grad():
            for opt in b.optimizers:
                for entry in opt.state.values():
                    for key in ("exp_avg", "exp_avg_sq"):
                        t = entry[key]
                        entry[key] = tensors.like(t, tensors.local(t).pin_memory())
    before = {}
    for opt in b.optimizers:
        for p, entry in opt.state.items():
            for key, t in entry.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    local = tensors.local(t)
                    before[(id(p), key)] = (
                        t,
                        local.untyped_storage().data_ptr(),
                        local.is_pinned() if pinned else False,
                    )
    saving.load(c, b, saved)
    problems = []
    fqn_of = b.fqn_of()
    for opt in b.optimizers:
        for p, entry in opt.state.items():
            for key, t in entry.items():
                old = before.get((id(p), key))
                if old is None:
                    continue
                where = f"state[{fqn_of[p]!r}][{key!r}]"
                local = tensors.local(t)
                if t is not old[0]:
                    problems.append(f"{where}: replaced by a new tensor object")
                elif local.untyped_storage().data_ptr() != old[1]:
                    problems.append(f"{where}: storage reallocated")
                if pinned and old[2] and not local.is_pinned():
                    problems.append(f"{where}: no longer pinned")
    fail_if(problems, f"{mode}: set did not load in place")
    fail_if(diff_values(want["state"], snapshot(b)["state"], "state"), f"{mode}: in-place load has other values")


def cases():
    yield from grid("OPT-DT-1", SHARDED, dt_1, opts=("adamw", "adam_amsgrad", "sgd", "adagrad"), modes=("sharded",))
    # Optional: FSDP over tensor parallelism (strided shards), the one such layout.
    yield make_case("OPT-DT-1", "fsdp2xtp2", dt_1, opt="adamw", mode="sharded", profile="tp")
    yield from grid("OPT-DT-2", SHARDED - HALVED, dt_2, opts=("adamw",), modes=MODES)
    # Optional: FSDP over tensor parallelism, as above.
    yield from grid(
        "OPT-DT-2", ("fsdp2xtp2",), dt_2, opts=("adamw",), modes=("sharded", "full", "bcast", "dcp"), profile="tp"
    )
    yield from grid("OPT-DT-3", ENDS | HYBRID | FSDP1_FULL_SHARD, dt_3, opts=("adamw",), modes=MODES)
    for layout in ENDS | HYBRID:
        for mode in MODES:
            yield make_case("OPT-DT-4", layout, dt_4, opt="adamw", mode=mode, profile="inplace", pinned=False)
        yield make_case(
            "OPT-DT-4", layout, dt_4, opt="adamw", mode="sharded", variant="pinned", profile="inplace", pinned=True
        )


CLAUSES = {"OPT-DT-1": Clause(side="get"), "OPT-DT-2": Clause(), "OPT-DT-3": Clause(), "OPT-DT-4": Clause()}
