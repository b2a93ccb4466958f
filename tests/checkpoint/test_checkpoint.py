"""hyperdsd.checkpoint: resuming through DCP with lazy optimizer state,
refusing partly missing state and other models' checkpoints, and the
one-call API with schedulers, extra Stateful objects and async saves.

Multi-rank cases run on real CPU ranks through the harness
(checkpoint_tasks); the planner's reading of a template is also tested in
one process, where DCP needs no process group.
"""

import copy
import os
import pickle

import checkpoint_tasks
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from helpers import run_task, same
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

import hyperdsd
from hyperdsd import StateDictError, checkpoint
from hyperdsd.checkpoint.load_template import Entry, judge, optimizer_entries, optimizer_roots

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(pools, world_size, fn, **kwargs):
    return run_task(pools, world_size, getattr(checkpoint_tasks, fn), **kwargs)


# -- on ranks --------------------------------------------------------------


@pytest.mark.parametrize("layout, world_size", [("single", 1), ("fsdp2", 2), ("pp2", 2)])
@pytest.mark.parametrize("way", ["planner", "one_call", "app_state"])
def test_lazy_state_resumes_and_stays_absent(pools, layout, world_size, way):
    assert run(pools, world_size, "lazy_resume", layout=layout, way=way) == [True] * world_size


def test_a_whole_never_stepped_group_resumes_on_uneven_shards(pools):
    assert run(pools, 3, "lazy_resume", layout="fsdp3", way="planner", own_group=True) == [True] * 3


@pytest.mark.parametrize(
    "layout, world_size, fqn, key",
    [
        ("single", 1, "layers.0.fc2.weight", "exp_avg_sq"),
        ("fsdp3", 3, "layers.0.fc2.weight", "step"),  # 8 rows on 3 ranks: uneven shards
        ("pp2", 2, "layers.1.fc1.weight", "exp_avg"),  # held by one stage; every rank raises
    ],
)
@pytest.mark.parametrize("way", ["planner", "one_call", "app_state"])
def test_partly_missing_state_is_refused_on_every_rank(pools, layout, world_size, fqn, key, way):
    results = run(pools, world_size, "partial_state_refused", layout=layout, way=way, fqn=fqn, key=key)
    assert len(results) == world_size
    if way == "one_call":  # one error, the same on every rank
        assert {name for name, _ in results} == {"StateDictError"}
        assert len({text for _, text in results}) == 1


@pytest.mark.parametrize(
    "kind, needle",
    [
        ("more_layers", "layers.2"),  # FQNs the checkpoint lacks
        ("fewer_layers", "model.layers.1."),  # FQNs the model does not have
        ("wider", "Size mismatch"),  # other shapes
        ("extra_group", "param_groups.3"),  # a param group more (empty): strict
    ],
)
def test_another_models_checkpoint_is_refused_alike_on_every_rank(pools, kind, needle):
    texts = run(pools, 2, "other_model_refused", layout="fsdp2", kind=kind)
    assert len(set(texts)) == 1, texts
    assert needle in texts[0] and "nothing was changed" in texts[0], texts[0]


@pytest.mark.parametrize("layout, world_size", [("single", 1), ("fsdp2", 2)])
def test_schedulers_and_extra_stateful_objects_round_trip(pools, layout, world_size):
    assert run(pools, world_size, "schedulers_and_extra", layout=layout) == [True] * world_size


@pytest.mark.parametrize("layout, world_size", [("single", 1), ("fsdp2", 2)])
def test_repeated_saves_load_with_plain_dcp(pools, layout, world_size):
    assert run(pools, world_size, "saves_that_plain_dcp_loads", layout=layout) == [True] * world_size


@pytest.mark.parametrize("layout, world_size", [("fsdp3", 3), ("halves2+2", 4), ("fsdp4+rep2", 4), ("pp2", 2)])
def test_bulk_plans_are_dcps_own(pools, layout, world_size):
    assert run(pools, world_size, "bulk_plans_match_dcp", layout=layout) == [True] * world_size


def test_async_save_writes_a_checkpoint_that_loads(pools):
    assert run(pools, 2, "schedulers_and_extra", layout="fsdp2", async_save=True) == [True, True]


# -- in one process ------------------------------------------------------------


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = nn.Linear(4, 2)  # used under no_grad: never gets a gradient

    def forward(self, x):
        with torch.no_grad():
            g = self.gate(x).softmax(-1).amax(-1, keepdim=True)
        return self.fc(x) * g


def _trained(seed=0, steps=2):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_user_key_and_a_stateful_are_found_nested_and_flat():
    model, opt = _trained(steps=0)
    nested = hyperdsd.get_optimizer_state_dict(model, opt)
    flat = hyperdsd.get_optimizer_state_dict(
        model, opt, options=hyperdsd.StateDictOptions(flatten_optimizer_state_dict=True)
    )
    roots = optimizer_roots({"run": {"optimizer": nested}, "stages": [flat], "model": model.state_dict()})
    assert {path: kind for path, (kind, _) in roots.items()} == {("run", "optimizer"): "nested", ("stages", 0): "flat"}


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_entries_group_each_parameters_keys_and_know_placeholders(flat):
    model, opt = _trained(steps=0)
    osd = hyperdsd.get_optimizer_state_dict(
        model, opt, options=hyperdsd.StateDictOptions(flatten_optimizer_state_dict=flat)
    )
    planner = DefaultLoadPlanner()  # DCP's own flattening, as LoadPlanner sees it
    planner.set_up_planner({"optim": osd})
    entries = {e.fqn: e for e in optimizer_entries(planner.original_state_dict, planner.state_dict, planner.mappings)}
    assert sorted(entries) == ["fc.bias", "fc.weight", "gate.bias", "gate.weight"]
    gate = entries["gate.weight"]
    assert gate.placeholder and gate.prefix == "optim.state.gate.weight"
    assert sorted(gate.name(k) for k in gate.keys) == ["exp_avg", "exp_avg_sq", "step"]
    assert bool(gate.fields) == flat  # the flat layout carries group fields per parameter


def test_judge_drops_wholly_absent_placeholders_and_names_partial_state():
    keys = lambda fqn, *names: [f"optim.state.{fqn}.{n}" for n in names]  # noqa: E731
    lazy = Entry(
        "gate.weight", "optim.state.gate.weight", keys=keys("gate.weight", "step", "exp_avg"), placeholder=True
    )
    torn = Entry("fc.weight", "optim.state.fc.weight", keys=keys("fc.weight", "step", "exp_avg"), placeholder=True)
    real = Entry("fc.bias", "optim.state.fc.bias", keys=keys("fc.bias", "step"), placeholder=False)
    in_checkpoint = dict.fromkeys(keys("fc.weight", "exp_avg"))
    drop, problems = judge([lazy, torn, real], in_checkpoint, strict=True)
    assert drop == lazy.keys
    assert any("'fc.weight'" in p and "['step']" in p for p in problems), problems
    assert any("'fc.bias'" in p for p in problems), problems  # real state stays required
    drop, problems = judge([real], in_checkpoint, strict=False)
    assert (drop, problems) == ([], [])


def test_without_the_planner_dcp_stops_on_lazy_state_and_with_it_resumes(tmp_path):
    """The symptom users hit, and the one change that fixes it."""
    model, opt = _trained()
    msd, osd = hyperdsd.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    fresh, fresh_opt = _trained(seed=1, steps=0)
    msd, osd = hyperdsd.get_state_dict(fresh, fresh_opt)
    with pytest.raises(BaseException, match=r"Missing key in checkpoint state_dict: optim\.state\.gate\.weight\.step"):
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    assert not fresh_opt.state
    msd, osd = hyperdsd.get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), planner=checkpoint.LoadPlanner())
    hyperdsd.set_state_dict(fresh, fresh_opt, model_state_dict=msd, optim_state_dict=osd)
    assert fresh_opt.state.get(fresh.gate.weight) is None
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, value in opt.state.get(p, {}).items():
            assert torch.equal(value, fresh_opt.state[q][key]), key


@pytest.mark.parametrize("target", ["fresh", "stateless_in_stepped"])
def test_one_call_error_names_the_parameter_and_changes_nothing(tmp_path, target):
    """A checkpoint whose entry for one parameter lacks a key is refused
    before anything is read: into a fresh optimizer, and in a rollback into
    a stepped one that holds no state for that parameter (frozen, or no
    gradient since)."""
    model, opt = _trained()
    checkpoint.save(str(tmp_path), model, opt)
    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    del metadata.state_dict_metadata["optim.state.fc.weight.exp_avg_sq"]
    with open(os.path.join(tmp_path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
    b, b_opt = _trained(seed=1, steps=0 if target == "fresh" else 2)
    if target == "stateless_in_stepped":
        b_opt.state.pop(b.fc.weight)
    before = copy.deepcopy((b.state_dict(), b_opt.state_dict()))
    with pytest.raises(StateDictError, match=r"(?s)nothing was changed.*'fc\.weight'.*lacks \['exp_avg_sq'\]"):
        checkpoint.load(str(tmp_path), b, b_opt)
    assert same((b.state_dict(), b_opt.state_dict()), before)


def test_extra_cannot_take_the_reserved_names(tmp_path):
    model, opt = _trained(steps=0)
    with pytest.raises(StateDictError, match="optim"):
        checkpoint.save(str(tmp_path), model, opt, extra={"optim": {}})


def _with_gate_state(seed=0):
    """A trained model whose optimizer has state for every parameter, the gate included."""
    model, opt = _trained(seed)
    model(torch.randn(3, 4)).sum().backward()
    for p in model.gate.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    return model, opt


def _load_the_plain_way(path, model, opt, flat):
    options = hyperdsd.StateDictOptions(flatten_optimizer_state_dict=flat)
    msd, osd = hyperdsd.get_state_dict(model, opt, options=options)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=str(path), planner=checkpoint.LoadPlanner())
    hyperdsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)


@pytest.mark.parametrize("way", ["plain", "plain-flat", "one-call"])
def test_a_stepped_optimizer_takes_state_for_a_parameter_it_has_none_for(tmp_path, way):
    """The gate never had a gradient in the target, so its stepped optimizer has no entry for it;
    the checkpoint's state for it is the optimizer's own parameter's, and loads."""
    model, opt = _with_gate_state()
    flat = way == "plain-flat"
    checkpoint.save(str(tmp_path), model, opt, options=hyperdsd.StateDictOptions(flatten_optimizer_state_dict=flat))
    target, target_opt = _trained(seed=1)
    assert target.gate.weight not in target_opt.state
    if way == "one-call":
        checkpoint.load(str(tmp_path), target, target_opt)
    else:
        _load_the_plain_way(tmp_path, target, target_opt, flat)
    for p, q in zip(model.parameters(), target.parameters()):
        assert opt.state[p].keys() == target_opt.state[q].keys()
        for key, value in opt.state[p].items():
            assert torch.equal(value, target_opt.state[q][key]), key
            assert value.device == target_opt.state[q][key].device


@pytest.mark.parametrize("way", ["plain", "plain-flat", "one-call"])
def test_a_checkpoint_taken_before_the_first_step_rolls_a_stepped_optimizer_back_to_none(tmp_path, way):
    """Saved templates of a never-stepped optimizer, the gate's included, which the stepped
    target has no entry for: after the load no parameter has state (OPT-RT-5)."""
    model, opt = _trained(steps=0)
    flat = way == "plain-flat"
    checkpoint.save(str(tmp_path), model, opt, options=hyperdsd.StateDictOptions(flatten_optimizer_state_dict=flat))
    target, target_opt = _trained(seed=1)
    assert target_opt.state and target.gate.weight not in target_opt.state
    if way == "one-call":
        checkpoint.load(str(tmp_path), target, target_opt)
    else:
        _load_the_plain_way(tmp_path, target, target_opt, flat)
    assert not any(target_opt.state.values())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters()))
