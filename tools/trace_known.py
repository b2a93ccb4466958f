"""Write an expected-failures file from a run against torch's implementation,
one section per traced cause.

Every failing case of the report must be explained by exactly one cause of
``CAUSES`` (the first that matches it); a case no cause explains stops the
tool, so a new deviation is traced by hand before it can be listed. Within a
cause, cases are written as the shortest ID prefixes that cover them and no
case that passes or has another cause.

    python -m tools.trace_known report.json --torch 2.13.0 > conformance/known/torch-2.13.txt
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from conformance.adapters import MODES
from conformance.reporting.deviations import signature
from conformance.running.results import Status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PIPELINE = ("pp2", "pp2xfsdp2")


def _mode(case: dict) -> str:
    """The mode a case's ID names after its layout (whose own name may hold a
    mode's word: ``fsdp1-4-flat``, FSDP1's flat parameters)."""
    body = case["id"].split("[", 1)[1].rstrip("]")
    layout = case.get("layout") or ""
    body = body[len(layout) + 1 :] if layout and body.startswith(layout + "-") else body
    return next((p for p in body.split("-") if p in MODES), "")


@dataclass(frozen=True)
class Cause:
    title: str
    reason: str
    matches: Callable[[dict, str], bool]  # (case, signature) -> bool


# What a missing stage looks like to the clauses that see it.
_STAGE_MISSING = (
    "differs from the uninterrupted",
    "absent on rank",
    "does not hold the full state",
    "Missing key(s) in state_dict",
    "symmetric difference",
    "does not reproduce the source",
    "after resharding",
    "with every feature at once",
    # 2.11: Adagrad's `sum` (made in its constructor) is gone from the stage that loaded nothing.
    "KeyError in training after set_optimizer_state_dict",
    # 2.7's code (verl's copy): the stage's parameters have no state in the checkpoint, a bare KeyError.
    "KeyError in set_optimizer_state_dict",
)

_KEY_ERROR = re.compile(r"raised KeyError in set_optimizer_state_dict: '([^']+)'")


def _set_key_error(case) -> str:
    """The key a KeyError raised by set_optimizer_state_dict names ('' when there is none). Before the
    strict check of later releases (torch 2.7's code), a parameter without state in the checkpoint is a
    bare KeyError naming its FQN; under the flat layout the key is ``state.FQN.NAME``."""
    m = _KEY_ERROR.search(case["message"] or "")
    return m.group(1) if m else ""


def _missing_param_state(case) -> bool:
    key = _set_key_error(case)
    return bool(key) and not key.startswith(("state.", "param_groups."))


def _pp_stage_only(case, sig) -> bool:
    pp = any(side in PIPELINE for side in case["layout"].split("_to_"))
    return (
        pp
        and _mode(case) in ("full_cpu", "bcast", "file")
        and any(p in sig for p in _STAGE_MISSING)
        and not case["clause"].startswith(("OPT-ATOM", "OPT-EMPTY", "OPT-SCHED-1", "OPT-SCHED-3", "MODEL-2"))
    )


def _fsdp1(case) -> bool:
    """Whether a side of the case is an FSDP1 layout (SPEC §2, 1.3)."""
    return any(side.startswith(("fsdp1-", "hsdp1-")) for side in case["layout"].split("_to_"))


# What a full load into modules a forward left unsharded raises, release by release.
_UNSHARDED_LOAD = (
    "got mixed torch.Tensor and DTensor",
    "with different meshes",
    "pointwise computation across different mesh",
    "Sharding propagation failed for Op(op=aten.copy_.default",  # 2.9
    "Cross device mesh comm not supported yet",  # 2.8
)


CAUSES: tuple[Cause, ...] = (
    Cause(
        "FSDP1 full model state under cpu_offload",
        "on an FSDP1 model, get_model_state_dict with full_state_dict + cpu_offload (full_cpu, and the bcast and "
        "file saves) kills rank 0 with SIGSEGV (use_orig_params=True, HYBRID_SHARD and SHARD_GRAD_OP alike) and, "
        "with flat parameters, raises 'setStorage: ... out of bounds for storage of size 0' on rank 0, while the "
        "other ranks wait in its collective; without cpu_offload (full) it passes",
        lambda c, s: _fsdp1(c) and "in get_model_state_dict" in s and ("SIGSEGV" in s or "setStorage" in s),
    ),
    Cause(
        "FSDP1 sharded model state of flat parameters over 4 ranks (2.6)",
        "torch 2.6: on an FSDP1 model with use_orig_params=False on 4 ranks, get_model_state_dict without "
        "full_state_dict (sharded, flat, dcp) raises NotImplementedError('Only single local shard is supported'): "
        "a flat parameter's piece of an original parameter spans more than one local shard; 2 ranks pass",
        lambda c, s: _fsdp1(c) and "in get_model_state_dict" in s and "Only single local shard is supported" in s,
    ),
    Cause(
        "wrapper prefixes on FSDP1",
        "on an FSDP1 model, torch.compile's _orig_mod. and, with flat parameters, activation checkpointing's "
        "_checkpoint_wrapped_module. stay in the optimizer state's keys: the load of the dict get returned raises "
        "a KeyError naming '_orig_mod.layers.0._orig_mod.norm.weight', or finds no state for "
        "'layers.0._checkpoint_wrapped_module.fc2.bias'; FSDP2 and DDP models under the same wrappers pass",
        lambda c, s: (
            _fsdp1(c)
            and c["clause"] == "OPT-KEYS-2"
            and any(w in (c["message"] or "") for w in ("'_orig_mod.", "._checkpoint_wrapped_module."))
        ),
    ),
    Cause(
        "Adagrad's state on FSDP1",
        "Adagrad makes state for every parameter in its constructor; on FSDP1, a load drops the entries of a "
        "rank that holds none of a parameter's elements (use_orig_params=True), which the uninterrupted run keeps, "
        "or writes another value into a flat shard's padding than Adagrad's initial sum (hyperdsd had the same "
        "deviation, fixed with tests/test_fsdp1.py's Adagrad test)",
        lambda c, s: (
            _fsdp1(c)
            and "-adagrad-" in c["id"]
            and c["clause"] in ("OPT-RT-1", "OPT-RT-5")
            and ("differs from the uninterrupted" in s or "does not reproduce the source" in s)
        ),
    ),
    Cause(
        "nested state on FSDP1",
        "torch's FSDP1 optimizer-state conversion unflattens per-element state at the top of an entry only: with "
        "the original parameters a get of per-element tensors nested in a dict or list raises 'The size of tensor "
        "a (...) must match the size of tensor b (...)'; with flat parameters it returns them as the flat shard's "
        "pieces (plain tensors of the shard's length), which DCP then cannot load into another layout; the flat "
        "layout refuses the string state",
        lambda c, s: (
            _fsdp1(c)
            and c["clause"] == "OPT-STATE-1"
            and any(m in s for m in ("must match the size of tensor b", "not laid out", "Flattening", "Size mismatch"))
        ),
    ),
    Cause(
        "FSDP1 unit split between optimizers",
        "on an FSDP1 model with its original parameters, two optimizers over disjoint parameters of one unit "
        "(OPT-KEYS-4): get_optimizer_state_dict raises 'norm.weight is not in the optimizer state. The "
        "FSDPParamInfo has the param keys [...] while the optimizer has the param keys [...]' in every mode; "
        "torch's FSDP1 path reads a unit's parameters from one optimizer",
        lambda c, s: _fsdp1(c) and "is not in the optimizer state. The FSDPParamInfo" in s,
    ),
    Cause(
        "extra state on FSDP1",
        "on an FSDP1 model whose blocks keep extra state (get_extra_state), get_model_state_dict raises "
        "AttributeError: 'ExtraStateBlock' object has no attribute '_extra_state' in every mode: FSDP1's state-dict "
        "hooks look the _extra_state key up as an attribute",
        lambda c, s: (
            _fsdp1(c)
            and c["clause"] == "MODEL-5"
            and "in get_model_state_dict" in s
            and "no attribute '_extra_state'" in (c["message"] or "")
        ),
    ),
    Cause(
        "FSDP1 full optimizer state under cpu_offload",
        "on an FSDP1 model with its original parameters, an optimizer state dict taken with full_state_dict + "
        "cpu_offload (full_cpu, bcast, file) resumes into other values on the first rank of each shard group: "
        "parameters differ after one step from the uninterrupted run, where the same round trip without "
        "cpu_offload (full) equals it; rank 0's dict holds other exp_avg values than the gathered shards (OPT-RT-3)",
        lambda c, s: (
            _fsdp1(c)
            and _mode(c) in ("full_cpu", "bcast", "file")
            and any(m in s for m in ("differs from the uninterrupted", "does not reproduce", "does not hold the full"))
        ),
    ),
    Cause(
        "FSDP1 flattened optimizer state",
        "flatten_optimizer_state_dict on FSDP1: loading into a stepped optimizer kills a rank with SIGABRT in "
        "set_optimizer_state_dict, and with flat parameters and plain SGD (no state) the load raises 'The state "
        "of _OptimStateKey(...) is empty. This should happen when use_orig_params=True'",
        lambda c, s: (
            _fsdp1(c)
            and _mode(c) == "flat"
            and "set_optimizer_state_dict" in s
            and ("SIGABRT" in s or "_OptimStateKey" in s)
        ),
    ),
    Cause(
        "pipeline stages under full_cpu",
        "with pipeline stages, full_state_dict + cpu_offload keeps on rank 0 only rank 0's own stage, so a "
        "consolidated checkpoint (full_cpu, bcast, file) lacks the other stage, which then loads nothing",
        _pp_stage_only,
    ),
    Cause(
        "fake step in get",
        "get on a never-stepped optimizer initialises its state by running a step (zero gradients), so the "
        "optimizer changes and a checkpoint taken before the first step holds step=1, "
        "https://github.com/pytorch/pytorch/issues/164929",
        lambda c, s: (
            "-step0" in c["id"]  # -step0], and -step0-frozen] (a warm DCP rollback with frozen parameters)
            or c["id"].endswith("-fresh]")
            or (c["clause"] in ("OPT-PART-6",) and "changed the optimizer" in s)
            or (
                c["clause"] == "OPT-PART-1"
                and ("failed strict load changed" in s or "expected fresh (absent) state" in s)
            )
        ),
    ),
    Cause(
        "model on part of the world",
        "two models on two halves of the world: full_state_dict + cpu_offload gives the full state to global "
        "rank 0 only, so the half without it gets nothing from its own model",
        lambda c, s: c["layout"] == "halves2+2" and "absent on rank" in s,
    ),
    Cause(
        "lazy state rejected",
        "strict set rejects a parameter that never had a gradient (it has no optimizer state) although the "
        "checkpoint lists it without state (torch 2.7's code: a bare KeyError naming it, strict or not), "
        "https://github.com/pytorch/pytorch/issues/132628",
        lambda c, s: (
            ("Missing optimizer state for parameter" in s or _missing_param_state(c)) and c["clause"] != "OPT-PART-1"
        ),
    ),
    Cause(
        "no DCP load path for lazy state",
        "torch documents no DCP load path for lazy state: with DCP's default planner, dcp.load into get's "
        "template stops with 'Missing key in checkpoint state_dict' for parameters that never had a "
        "gradient (the checkpoint rightly holds no state for them); no upstream issue found",
        lambda c, s: "Missing key in checkpoint state_dict" in s,
    ),
    Cause(
        "flat layout and absent state",
        "flat layout: the state of a parameter the checkpoint lacks is rebuilt as empty dicts, and "
        "Optimizer.load_state_dict fails with an opaque TypeError (torch 2.7's code: a KeyError naming the flat "
        "key), https://github.com/pytorch/pytorch/issues/192224",
        lambda c, s: (
            "float() argument must be a string or a real number" in s or _set_key_error(c).startswith("state.")
        ),
    ),
    Cause(
        "non-strict loads refuse absent state",
        "torch 2.7's code: strict=False with a checkpoint that has no state for a parameter (one added since) "
        "fails with a bare KeyError naming it; later releases skip that parameter",
        lambda c, s: c["clause"] == "OPT-PART-1" and c["id"].endswith("-nonstrict]") and _missing_param_state(c),
    ),
    Cause(
        "strict errors do not name what is missing",
        "strict=True with parameters the checkpoint lacks: the error names one parameter (or, through DCP, "
        "none); with pipeline stages nothing is raised",
        lambda c, s: c["clause"] == "OPT-PART-1" and "strict=True with parameters the checkpoint lacks" in s,
    ),
    Cause(
        "plain SGD in full modes",
        "plain SGD keeps no state tensor: the full and broadcast loads assert 'Expected device to be set' "
        "(a bare assert in torch 2.7's code)",
        lambda c, s: (
            "Expected device to be set" in s
            or ("sgd_plain" in c["id"] and "raised AssertionError in set_optimizer_state_dict: AssertionError()" in s)
        ),
    ),
    Cause(
        "nested state values",
        "set goes through Optimizer.load_state_dict, whose cast turns a list nested in a parameter's state "
        "into a generator object and float state into the parameter's dtype; the flat layout refuses "
        "non-tensor values other than int, float and dict",
        lambda c, s: c["clause"] == "OPT-STATE-1",
    ),
    Cause(
        "empty param groups",
        "empty param groups: at most one is supported (a ValueError otherwise, or with several optimizers), "
        "the flat layout fails with an IndexError, and groups after the first lose their fields "
        "(KeyError 'lr' at the next step) or keep the target's, https://github.com/pytorch/pytorch/issues/143828",
        lambda c, s: (
            "zero parameters" in s
            or "IndexError" in s
            # torch 2.6: the groups lose their fields, or a bare assert with several optimizers
            or (c["clause"] == "OPT-EMPTY-1" and "param groups without parameters did not survive" in s)
            or (c["id"].endswith("-2opt]") and "AssertionError in set_optimizer_state_dict" in s)
            or (c["clause"] == "OPT-RT-4" and ("KeyError in training" in s or "resumed run differs" in s))
        ),
    ),
    Cause(
        "validation is rank-local",
        "validation is rank-local: the rank with a bad value raises while the others load, or wait in a "
        "collective; a broadcast load changes rank 0's optimizer before it fails",
        lambda c, s: c["clause"] == "OPT-ATOM-4",
    ),
    Cause(
        "state cast to the parameter's dtype",
        "state is cast to the parameter's dtype on load (fp32 moments of bf16 parameters become bf16), "
        "https://github.com/pytorch/pytorch/issues/43706",
        lambda c, s: c["clause"] == "OPT-DT-3",
    ),
    Cause(
        "group fields the target lacks",
        "group fields the target's groups lack (initial_lr, custom fields) are dropped, or raise KeyError in "
        "the full modes; nested set replaces group fields wholesale instead of merging them, "
        "https://github.com/pytorch/pytorch/issues/140900",
        lambda c, s: c["clause"] in ("OPT-SCHED-1", "OPT-SCHED-3"),
    ),
    Cause(
        "frozen parameters' state dropped",
        "optimizer state of frozen parameters is dropped on set, https://github.com/pytorch/pytorch/issues/192202",
        lambda c, s: c["clause"] == "OPT-PART-3",
    ),
    Cause(
        "no validation of values",
        "no validation before loading: wrong shapes and non-tensor values load or fail later, and a "
        "parameter without state fails with a bare KeyError that names nothing",
        lambda c, s: c["clause"] == "OPT-ATOM-2",
    ),
    Cause(
        "get aliases the optimizer",
        "get returns the optimizer's own per-parameter state dicts: changing the result changes the optimizer",
        lambda c, s: c["clause"] == "OPT-PURE-2",
    ),
    Cause(
        "unknown FQNs and groups",
        "unknown FQNs and unknown, extra or missing param groups load without an error (or with one about "
        "empty groups that names none of them)",
        lambda c, s: c["clause"] == "OPT-ATOM-1",
    ),
    Cause(
        "model keys not reported",
        "model loads: non-strict full and broadcast loads fill missing keys from the model instead of "
        "reporting them, and strict errors name only the missing or only the unexpected keys (through "
        "DDP, only the first)",
        lambda c, s: c["clause"] == "MODEL-2",
    ),
    Cause(
        "broadcast loads send whole tensors",
        "a broadcast load (broadcast_from_rank0) sends every rank each whole tensor (_broadcast_coalesced) and "
        "each rank cuts its own shard from it: a non-root rank receives the whole model, not its share plus one "
        "tensor in flight; the full copy on every rank was raised in the review of "
        "https://github.com/pytorch/pytorch/pull/125338",
        lambda c, s: c["clause"] == "MODEL-3" and "sent more than its shard" in s,
    ),
    Cause(
        "partly present state loads",
        "in-memory loads, the consolidated file's included, take a parameter's state entry as it comes "
        "(Optimizer.load_state_dict): an entry without exp_avg_sq or step loads without an error, into a fresh "
        "or a stepped optimizer; only the DCP load path checks what the template expects; no upstream issue found",
        lambda c, s: c["clause"] == "OPT-PART-6" and "no error was raised" in s,
    ),
    Cause(
        "groups paired by position without state",
        "a checkpoint with no per-parameter state (plain SGD, or nothing stepped) is taken for one keyed by ids "
        "(_split_optim_state_dict tests all() over no keys) and goes unsplit to Optimizer.load_state_dict, which "
        "pairs its groups with the optimizer's by position: into an optimizer that lists its groups in another "
        "order it raises 'doesn't match the size of optimizer's group', or gives groups each other's fields; "
        "no upstream issue found",
        lambda c, s: c["clause"] == "OPT-KEYS-1" and "match the size of optimizer's group" in s,
    ),
    Cause(
        "get reshards what a forward left unsharded",
        "get calls model.state_dict(), whose FSDP2 pre-hook reshards every module a forward left unsharded "
        "(reshard_after_forward False or an int, unshard()): the values are right, but the modules' sharding "
        "state changes under the loop and the next forward gathers again; upstream not searched yet",
        lambda c, s: c["clause"] == "LOOP-1" and "changed the modules' sharding state" in s,
    ),
    Cause(
        "full loads into unsharded modules",
        "a full_state_dict set (full, full_cpu, bcast, file) into an FSDP2 model whose parameters a forward "
        "left unsharded distributes each full value against what the module holds, and fails copying a DTensor "
        "into it: the unsharded plain tensor ('got mixed torch.Tensor and DTensor'), or with an int "
        "reshard_after_forward the post-forward DTensor on the smaller mesh ('different meshes'; 2.11: 'Could "
        "not run pointwise computation across different mesh'; 2.9: 'Sharding propagation failed' for the copy; "
        "2.8: 'Cross device mesh comm not supported yet'); "
        "sharded, flat and DCP loads work there; upstream not searched yet",
        lambda c, s: c["clause"] == "LOOP-2" and any(m in (c["message"] or "") for m in _UNSHARDED_LOAD),
    ),
    Cause(
        "extra state objects in full modes",
        "extra state that is an arbitrary picklable object (neither a tensor nor a container of them): "
        "full_state_dict gathers raise ValueError 'Unexpected value type'; tensors and dicts round-trip",
        lambda c, s: c["clause"] == "MODEL-5" and "Unexpected value type" in s,
    ),
    Cause(
        "combined set leaves the broadcast's other ranks out of the model load",
        "set_state_dict computes optim_only=not model_state_dict on each rank: in a broadcast_from_rank0 load "
        "(full_cpu, bcast) the other ranks pass an empty model dict, skip the model's load and return while the "
        "root waits for them in the model's _broadcast_state_dict: the load hangs, and a strict load of a dict "
        "with an unexpected key raises on no rank but the root; the two set functions load the same dicts "
        "without a hang; no upstream issue found (pytorch/pytorch#157781, open, is a set_state_dict hang of a "
        "full load whose dicts only rank 0 holds, without broadcast_from_rank0)",
        lambda c, s: c["clause"] == "API-1" and _mode(c) in ("full_cpu", "bcast") and "set_state_dict" in s,
    ),
    Cause(
        "pipeline stages under full_cpu, through set_state_dict",
        "the consolidated file lacks the other stage (pipeline stages under full_cpu), and 2.7's code (verl's copy) "
        "raises a bare KeyError naming a parameter of that stage in set_state_dict, as it does in "
        "set_optimizer_state_dict; API-1 judges a raise of the combined set as it comes, so the stage's deviation "
        "shows there too",
        lambda c, s: (
            c["clause"] == "API-1"
            and c["layout"] in PIPELINE
            and _mode(c) == "file"
            and "KeyError in set_state_dict" in s
        ),
    ),
)


# A generated scenario (python -m conformance explore) is attributed to the
# first clause whose check fails, which need not be the clause the matrix
# files the same cause under; its shrunk scenario keeps only the features
# the deviation needs. So its cause is read from the message and those
# features: (title, test(finding, scenario, message)), first match wins.
_FULL_FILES = ("full_cpu", "bcast", "file")
EXPLORE_RULES: tuple[tuple[str, Callable[[dict, dict, str], bool]], ...] = (
    ("get reshards what a forward left unsharded", lambda f, s, m: "changed the modules' sharding state" in m),
    (
        "full loads into unsharded modules",
        lambda f, s, m: any(w in m for w in _UNSHARDED_LOAD),
    ),
    (
        "plain SGD in full modes",
        lambda f, s, m: (
            "Expected device to be set" in m
            or (s.get("optimizer") == "sgd_plain" and "AssertionError in set_optimizer_state_dict" in m)
        ),
    ),
    (
        "flat layout and absent state",
        lambda f, s, m: (
            "float() argument must be a string or a real number" in m or _set_key_error(f).startswith("state.")
        ),
    ),
    (
        "groups paired by position without state",
        lambda f, s, m: f["clause"] == "OPT-KEYS-1" and "match the size of optimizer's group" in m,
    ),
    ("no DCP load path for lazy state", lambda f, s, m: "Missing key in checkpoint state_dict" in m),
    ("lazy state rejected", lambda f, s, m: "Missing optimizer state for parameter" in m or _missing_param_state(f)),
    ("extra state objects in full modes", lambda f, s, m: "Unexpected value type" in m),
    # A checkpoint before the first step: what follows is the fake step's doing (state where none was).
    ("fake step in get", lambda f, s, m: s.get("before") == 0),
    # SGD's flat load: the empty dict rebuilt for a parameter without state loads as state.
    ("flat layout and absent state", lambda f, s, m: s["mode"] == "flat" and "present, expected absent" in m),
    (
        "empty param groups",
        lambda f, s, m: (
            s.get("empty_at")
            and (
                "zero parameters" in m
                or "IndexError" in m
                or "param groups without parameters" in m
                # behind OPT-EMPTY-1's check, in the round trips: a group kept the target's fields or lost them
                or re.search(r"group(s\[\d+\]| of \[\])\['\w+'\]: ", m) is not None
                or "KeyError in training" in m
            )
        ),
    ),
    ("broadcast loads send whole tensors", lambda f, s, m: f["clause"] == "MODEL-3" and "received" in m),
    ("get aliases the optimizer", lambda f, s, m: f["clause"] == "OPT-PURE-2" and "changed the optim" in m),
    (
        "pipeline stages under full_cpu",
        lambda f, s, m: (
            any(side in PIPELINE for side in (s["layout"], s.get("reshard_to") or "")) and s["mode"] in _FULL_FILES
        ),
    ),
    ("model keys not reported", lambda f, s, m: f["clause"] == "MODEL-2"),
    ("frozen parameters' state dropped", lambda f, s, m: s.get("frozen") and "differs" in m),
    (
        "nested state values",
        lambda f, s, m: (
            s.get("optimizer") == "custom"
            and ("differs" in m or "Flattening optimizer state_dict" in m or "generator object" in m)
        ),
    ),
    ("state cast to the parameter's dtype", lambda f, s, m: s.get("dtype") == "bfloat16" and "differs" in m),
    (
        "group fields the target lacks",
        lambda f, s, m: (s.get("scheduler") or s.get("custom_fields")) and ("differs" in m or "KeyError" in m),
    ),
)


def explore_cause(finding: dict) -> str | None:
    """The traced cause of a deviation found by ``python -m conformance explore --impl torch``, or None."""
    scenario, message = finding["scenario"], finding["message"] or ""
    return next((title for title, test in EXPLORE_RULES if test(finding, scenario, message)), None)


@functools.lru_cache(maxsize=1)
def _found_scenarios() -> dict[str, dict]:
    """The scenario of every found-scenario case the registry loads (conformance/found/), by case ID."""
    import glob

    from conformance.running.generated import found_dirs

    out = {}
    for directory in found_dirs():
        for path in glob.glob(os.path.join(directory, "*.json")):
            with open(path) as f:
                data = json.load(f)
            out[data["id"]] = data["scenario"]
    return out


def cause_of(case: dict, found: dict[str, dict] | None = None) -> str | None:
    """The traced cause of a failing case of a run: a found-scenario case by its scenario, like a
    finding of an exploration; any other by the matrix's causes."""
    if "[found-" in case["id"]:
        scenario = (found if found is not None else _found_scenarios()).get(case["id"])
        return None if scenario is None else explore_cause({**case, "scenario": scenario})
    sig = signature(case["message"] or "")
    return next((c.title for c in CAUSES if c.matches(case, sig)), None)


_FEATURES = (
    "tie", "lazy", "frozen", "adapter", "router", "extra_state", "one_group", "empty_at", "router_group",
    "custom_fields", "scheduler", "warm", "reshard_to", "model_keys", "group_order",
)  # fmt: skip


def _features(scenario: dict) -> int:
    """How many of a scenario's features are on: the simplest finding of a cause is the one to keep."""
    return sum(bool(scenario.get(k)) for k in _FEATURES)


def explore_table(path: str, save_found: str | None = None) -> int:
    """Each finding of an exploration's JSON report with its cause; the causes found of those traced.
    ``save_found``: write one found-scenario case per cause there (its smallest finding), so that the
    regression matrix holds each cause the exploration found once."""
    with open(path) as f:
        report = json.load(f)
    run = report.get("explore", report)
    findings = run.get("findings", [])
    found: dict[str, list[str]] = {}
    untraced = []
    for f in findings:
        cause = explore_cause(f)
        (found.setdefault(cause, []) if cause else untraced).append(
            f"{f['clause']}: {f['description'].splitlines()[0]}"
        )
    titles = [c.title for c in CAUSES]
    print(
        f"exploration: seed {run.get('seed')}, budget {run.get('budget_s')} s, world sizes {run.get('world_sizes')}, "
        f"{run.get('ran')} scenarios, {len(findings)} deviations"
    )
    for title in titles:
        mark = f"{len(found[title])} finding(s)" if title in found else "not found"
        print(f"  {title}: {mark}")
        for line in found.get(title, [])[:3]:
            print(f"      {line}")
    for line in untraced:
        print(f"  UNTRACED {line}")
    print(f"causes found: {len(found)} of {len(titles)} traced; untraced deviations: {len(untraced)}")
    if save_found and not untraced:
        from conformance.running.generated import found_record, write_found
        from conformance.world.scenario import Scenario

        impl = (report.get("impl") or {}).get("spec", "torch")
        for title in titles:
            mine = [f for f in findings if explore_cause(f) == title]
            if not mine:
                continue
            f = min(mine, key=lambda f: (_features(f["scenario"]), len(json.dumps(f["scenario"])), f["token"]))
            record = found_record(
                f["clause"], Scenario.from_dict(f["scenario"]), impl=impl, status=f["status"], message=f["message"]
            )
            print(f"  {title}: {write_found(save_found, record)}")
    return 1 if untraced else 0


def _covering(ids: list[str], others: list[str]) -> list[str]:
    """Shortest prefixes (clause, clause on a layout) covering ``ids`` and none of ``others``."""
    out, left = [], list(ids)
    clause = lambda i: i.split("[", 1)[0] + "["  # noqa: E731
    layout = lambda i: clause(i) + i.split("[", 1)[1].split("-", 1)[0] + "-"  # noqa: E731
    for level in (clause, layout):
        groups: dict[str, list[str]] = {}
        for i in left:
            groups.setdefault(level(i), []).append(i)
        left = []
        for prefix, members in groups.items():
            if prefix != members[0] and not any(o.startswith(prefix) for o in others):
                out.append(prefix)
            else:
                left += members
    return out + left


def check(cases: list[dict], known_path: str) -> dict:
    """How a known-failures file fares against a run's cases, as ``--xfails`` would judge them:
    failures it does not list, passes it lists (xpass), errors, and entries that match no case."""
    from conformance.running.xfails import Xfails

    known = Xfails.load(known_path)
    known.mark_selected([c["id"] for c in cases])
    listed = lambda c: known.match(c["id"]) is not None  # noqa: E731
    return {
        "file": os.path.relpath(known_path, ROOT),
        "unlisted": sorted(c["id"] for c in cases if c["status"] == Status.FAILED and not listed(c)),
        "xpass": sorted(c["id"] for c in cases if c["status"] == Status.PASSED and listed(c)),
        "error": sorted(c["id"] for c in cases if c["status"] == Status.ERROR),
        "stale": [e.pattern for e in known.unmatched()],
    }


_FAILING = (Status.FAILED, Status.ERROR, Status.XFAIL)


def _by_cause(cases: list[dict], found: dict | None) -> tuple[dict[str, list[str]], list[str]]:
    """The failing cases' IDs by their cause's title, and the failures no cause explains."""
    by_cause: dict[str, list[str]] = {}
    untraced = []
    for c in cases:
        if c["status"] not in _FAILING:
            continue
        cause = cause_of(c, found)
        if cause is None:
            untraced.append(f"{c['id']}: {signature(c['message'] or '')[:200]}")
        else:
            by_cause.setdefault(cause, []).append(c["id"])
    return by_cause, untraced


def _sections(path: str) -> tuple[str, dict[str, list[str]], dict[str, int]]:
    """A known-failures file's header, its entry lines by cause title (in file
    order) and each section's case count."""
    header: list[str] = []
    sections: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    current = None
    with open(path) as f:
        for line in f.read().splitlines():
            heading = re.match(r"## (.*) \((\d+) cases\)$", line)
            if heading:
                current = heading.group(1)
                sections[current], counts[current] = [], int(heading.group(2))
            elif current is None:
                header.append(line)
            elif line.strip():
                sections[current].append(line)
    return "\n".join(line for line in header if line.strip()), sections, counts


def merge(cases: list[dict], path: str, manifest: list[str], found: dict | None = None) -> list[str]:
    """Add the failures of ``cases`` (a run of cases added since ``path`` was
    written, whose full run's report is gone) under their causes, as prefixes
    that cover no other case of ``manifest``; the header's counts follow.
    Returns the untraced failures (then nothing is written)."""
    header, sections, counts = _sections(path)
    by_cause, untraced = _by_cause(cases, found)
    if untraced:
        return untraced
    reasons = {cause.title: cause.reason for cause in CAUSES}
    for title, ids in by_cause.items():
        others = [i for i in manifest if i not in set(ids)]
        sections.setdefault(title, [])
        sections[title] += [f"{p}  # {title}: {reasons[title]}" for p in _covering(ids, others)]
        counts[title] = counts.get(title, 0) + len(ids)
    tally = re.search(r"(?: and (\d+) run\(s\) of cases added since)?: \d+ failing cases, \d+ causes\.", header)
    runs = int(tally.group(1) or 0) + 1
    header = (
        header[: tally.start()]
        + f" and {runs} run(s) of cases added since: {sum(counts.values())} failing cases, {len(sections)} causes."
        + header[tally.end() :]
    )
    out = [header]
    for title in [cause.title for cause in CAUSES if cause.title in sections]:
        out += ["", f"## {title} ({counts[title]} cases)"] + sections[title]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return []


def known_file(version: str) -> str:
    """The known-failures file of a torch release (``2.13.0`` -> ``conformance/known/torch-2.13.txt``)."""
    return os.path.join(ROOT, "conformance", "known", f"torch-{'.'.join(version.split('.')[:2])}.txt")


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.trace_known", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("report")
    parser.add_argument("--torch", help="the torch version the report is from, for the header")
    parser.add_argument(
        "--explore",
        action="store_true",
        help="the report is an exploration's (python -m conformance explore --impl torch --json F): list each "
        "deviation with its traced cause, and which causes it found; exit 1 if one has no cause",
    )
    parser.add_argument(
        "--save-found",
        metavar="DIR",
        help="with --explore: write one found-scenario case per traced cause there (conformance/found ships them)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="judge the release's known-failures file against the report instead of writing one: "
        "exit 1 unless every failure is listed, no listed case passed, no case errored and every entry matches",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="the report is a run of cases added since the release's known-failures file was written: add "
        "their failures to that file under their causes (when the full run's report is gone)",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="REPORT",
        help="a later run of some cases (-k): its cases replace or add to the report's",
    )
    args = parser.parse_args()
    if args.explore:
        return explore_table(args.report, args.save_found)
    if not args.torch:
        parser.error("--torch is required")
    with open(args.report) as f:
        cases = json.load(f)["cases"]
    for path in args.also:
        with open(path) as f:
            later = {c["id"]: c for c in json.load(f)["cases"]}
        cases = [later.pop(c["id"], c) for c in cases] + list(later.values())
    if args.merge:
        from conformance.running.registry import all_cases

        untraced = merge(cases, known_file(args.torch), [c.id for c in all_cases()], _found_scenarios())
        if untraced:
            sys.stderr.write("untraced failures (add a cause):\n  " + "\n  ".join(untraced) + "\n")
            return 1
        args.check = True
    if args.check:
        result = check(cases, known_file(args.torch))
        for key in ("unlisted", "xpass", "error", "stale"):
            print(f"{result['file']}: {len(result[key])} {key}" + "".join(f"\n  {i}" for i in result[key][:20]))
        return 1 if any(result[k] for k in ("unlisted", "xpass", "error", "stale")) else 0
    bad = [c for c in cases if c["status"] in _FAILING]
    by_cause, untraced = _by_cause(bad, _found_scenarios())
    if untraced:
        sys.stderr.write("untraced failures (add a cause):\n  " + "\n  ".join(untraced) + "\n")
        return 1
    out = [
        f"# Expected failures of torch.distributed.checkpoint.state_dict (torch {args.torch}) on this suite,",
        "# from a full run (python -m conformance --impl torch --json ...)"
        + (f" and {len(args.also)} run(s) of cases added since" if args.also else "")
        + f": {len(bad)} failing cases, {len(by_cause)} causes.",
        "# Written by python -m tools.trace_known; each section is one cause, each line a case ID or prefix.",
        "#   python -m conformance --impl torch --xfails "
        f"conformance/known/torch-{'.'.join(args.torch.split('.')[:2])}.txt",
    ]
    for cause in CAUSES:
        ids = by_cause.get(cause.title)
        if not ids:
            continue
        others = [c["id"] for c in cases if c["id"] not in set(ids)]
        out += ["", f"## {cause.title} ({len(ids)} cases)"]
        out += [f"{p}  # {cause.title}: {cause.reason}" for p in _covering(ids, others)]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
