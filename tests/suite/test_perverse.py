"""What the implementation returns is input (SPEC §4, 1.3), and so is what it
does to the model and optimizers it is handed (1.4): a surprise in either is
the implementation's failure, never the suite's ``error``; and a soak
(``--repeat``) reports every verdict that changes between runs."""

import json

import pytest
import torch
import torch.nn as nn
from helpers import run_cli, slowness

from conformance.adapters import load_adapter
from conformance.cli import verdict_changes
from conformance.judging.handled import Handled, changes
from conformance.judging.received import Received
from conformance.running.registry import by_id
from conformance.running.runner import Runner
from hyperdsd.testing import PoolSet
from tools.perverse import twists
from tools.perverse.twists import PERVERSE

# Cases that read and edit what the implementation returned: model dicts
# popped and re-keyed (MODEL-2), file and DCP saves, the combined functions,
# the flat layout, and loop points, where a get must leave the gradients and
# a set's model and optimizer train on (LOOP-1, LOOP-2). One rank and two.
SLICE = (
    "MODEL-2[ddp-file-strict]",
    "MODEL-2[single-sharded-nonstrict]",
    "OPT-RT-1[single-adamw-dcp]",
    "OPT-KEYS-1[single-adamw-sharded]",
    "OPT-MPMD-3[single-adamw-flat]",
    "API-1[single-adamw-full]",
    "LOOP-1[single-full-accum]",
    "LOOP-1[single-file-grads]",
    "LOOP-2[single-file-grads]",
)


@pytest.fixture(scope="module")
def pools():
    pools = PoolSet()
    yield pools
    pools.kill()


@pytest.mark.parametrize("twist", list(PERVERSE))
def test_a_perverse_implementation_fails_and_never_errors(pools, twist):
    runner = Runner(load_adapter(f"tools.perverse.twists:{twist}"), pools, deadline_scale=slowness())
    try:
        results = {case_id: runner.run_case(by_id()[case_id]) for case_id in SLICE}
    finally:
        runner.close()
    errors = {k: r.message for k, r in results.items() if r.status == "error"}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    failed = [k for k, r in results.items() if r.status == "failed"]
    assert failed, f"{twist}: no case of the slice noticed the twist"


def _model_and_optimizer():
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    return model, optim


def _received(twist: str) -> list[str]:
    """What Received finds in the perverse implementation's output on a plain model."""
    model, optim = _model_and_optimizer()
    got = Received()
    if twist.endswith("_flat"):
        impl = getattr(twists, twist.removesuffix("_flat"))()
        options = impl.options(flatten_optimizer_state_dict=True)
        flat = impl.get_optimizer_state_dict(model, optim, options=options)
        got.note("get_optimizer_state_dict", (model, optim), {"options": options}, flat)
        return got.surprises()
    impl = getattr(twists, twist)()
    got.note("get_model_state_dict", (model,), {}, impl.get_model_state_dict(model))
    got.note("get_optimizer_state_dict", (model, optim), {}, impl.get_optimizer_state_dict(model, optim))
    got.note("get_state_dict", (model, optim), {}, impl.get_state_dict(model, optim))
    sd = load_adapter("hyperdsd").get_model_state_dict(model)
    got.note("set_model_state_dict", (model, sd), {}, impl.set_model_state_dict(model, sd))
    return got.surprises()


@pytest.mark.parametrize(
    "twist, needles",
    [
        ("prefixed", ["keys the model does not have: 'module.0.bias'", "FQNs naming no parameter"]),
        ("dropped", ["none of the model's '1.bias'"]),
        ("added", ["keys the model does not have: 'not.a.parameter'", "naming no parameter the optimizer steps"]),
        ("none", ["it is None, not a dict of FQN to value", "it is None, not a dict with 'state'"]),
        ("items", ["it is list, not a dict"]),
        ("tensors", ["holds Tensor where a dict belongs"]),
        ("no_groups", ["'param_groups' is None"]),
        ("no_groups_flat", ["no param_groups.<FQN>.<field> keys for '0.bias'"]),
        ("set_returns", ["set_model_state_dict returned what", "not the missing_keys and unexpected_keys"]),
    ],
)
def test_each_twist_is_named_by_what_came_back(twist, needles):
    found = "\n".join(_received(twist))
    for needle in needles:
        assert needle in found, f"{twist}: {needle!r} not in:\n{found}"


def test_well_formed_output_is_no_surprise():
    model, optim = _model_and_optimizer()
    impl = load_adapter("hyperdsd")
    got = Received()
    got.note("get_model_state_dict", (model,), {}, impl.get_model_state_dict(model))
    got.note("get_optimizer_state_dict", (model, optim), {}, impl.get_optimizer_state_dict(model, optim))
    options = impl.options(flatten_optimizer_state_dict=True)
    flat = impl.get_optimizer_state_dict(model, optim, options=options)
    got.note("get_optimizer_state_dict", (model, optim), {"options": options}, flat)
    got.note("get_state_dict", (model, optim), {}, impl.get_state_dict(model, optim))
    sd = impl.get_model_state_dict(model)
    got.note("set_model_state_dict", (model, sd), {}, impl.set_model_state_dict(model, sd))
    assert got.surprises() == []


@pytest.mark.parametrize(
    "twist, needles",
    [
        ("swapped_params", ["param_groups[0] holds 2 tensor(s) that are not the model's parameters", "'0.weight'"]),
        ("replaced_params", ["replaced the model's parameters '0.weight', '0.bias', '1.weight' and 1 more"]),
        ("dropped_group", ["removed param groups of the optimizer: it had 2, it has 1"]),
        ("added_group", ["added param groups", "param_groups[2] holds 1 tensor(s)", "<Parameter shape=(3,) float32"]),
        ("cleared_grads", ["changed whether these hold a gradient: '0.weight' (True -> False)"]),
        ("frozen", ["changed requires_grad of '0.weight' (True -> False), '0.bias'"]),
    ],
)
def test_each_side_effect_is_named_by_what_changed(twist, needles):
    model, _ = _model_and_optimizer()
    optim = torch.optim.AdamW([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    before = Handled.of(model, optim)
    PERVERSE[twist].after_set(model, optim)
    found = "; ".join(changes(before, Handled.of(model, optim)))
    for needle in needles:
        assert needle in found, f"{twist}: {needle!r} not in:\n{found}"


def test_hyperdsd_changes_nothing_it_is_handed():
    model, optim = _model_and_optimizer()
    impl = load_adapter("hyperdsd")
    before = Handled.of(model, optim)
    msd, osd = impl.get_state_dict(model, optim)
    impl.set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
    assert changes(before, Handled.of(model, optim)) == []


def test_an_empty_full_cpu_get_is_no_surprise_but_an_empty_sharded_one_is():
    # full_state_dict + cpu_offload: every rank but the root gets {} (torch's promise).
    model, optim = _model_and_optimizer()
    impl = load_adapter("hyperdsd")
    full_cpu = impl.options(full_state_dict=True, cpu_offload=True)
    got = Received()
    got.note("get_model_state_dict", (model,), {"options": full_cpu}, {})
    got.note("get_optimizer_state_dict", (model, optim), {"options": full_cpu}, {})
    got.note("get_state_dict", (model, optim), {"options": full_cpu}, ({}, {}))
    assert got.surprises() == []
    got.note("get_model_state_dict", (model,), {}, {})
    assert "none of the model's" in "\n".join(got.surprises())


def test_fsdp1_flat_parameters_are_named_by_their_original_parameters():
    from torch.distributed.fsdp._flat_param import FlatParameter

    from conformance import _compat

    flat = FlatParameter(torch.zeros(3), requires_grad=True)
    flat._fqns = ("fc.weight", "fc.bias")
    assert type(flat) is torch.nn.Parameter  # its metaclass tells it apart, not its type
    assert _compat.flat_param_fqns(flat) == ["fc.weight", "fc.bias"]
    assert _compat.flat_param_fqns(torch.nn.Parameter(torch.zeros(3))) is None


class _Result:
    def __init__(self, case_id, status):
        self.case = type("Case", (), {"id": case_id})()
        self.status = type("Status", (), {"value": status})()


def test_a_soak_reports_each_case_whose_verdict_changed():
    runs = [
        [_Result("A", "passed"), _Result("B", "failed")],
        [_Result("A", "passed"), _Result("B", "error")],
        [_Result("A", "passed"), _Result("B", "failed")],
    ]
    assert verdict_changes(runs) == {
        "runs": 3,
        "cases": 2,
        "changed": [{"id": "B", "verdicts": ["failed", "error", "failed"]}],
    }
    assert verdict_changes(runs[:1])["changed"] == []


def test_repeat_runs_the_selection_again_in_the_same_ranks(tmp_path):
    out = tmp_path / "report.json"
    proc, _ = run_cli(["--repeat", "2", "-k", "OPT-RT-1[single-adamw-sharded]", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "run 2 of 2" in proc.stdout and "0 changed their verdict between runs" in proc.stdout
    report = json.loads(out.read_text())
    assert report["soak"] == {"runs": 2, "cases": 1, "changed": []}
    assert [c["status"] for c in report["cases"]] == ["passed"]
