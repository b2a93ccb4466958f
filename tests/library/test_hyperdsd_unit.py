"""hyperdsd in one process, no process group: conversion, flat layout,
validation and in-place loading."""

import copy
import io
import operator
import pickle
import re
import types
import warnings

import hypothesis
import numpy
import pytest
import torch
import torch.nn as nn
from helpers import same
from parameterized import parameterized

import hyperdsd
from hyperdsd import StateDictError, StateDictOptions
from hyperdsd._compat import checkpoint_wrapper
from hyperdsd.state.keys import flat as flat_format
from hyperdsd.state.keys.fqn import ModelIndex
from hyperdsd.state.placeholders.marks import is_unwritten_placeholder


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Net(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.blocks = nn.ModuleDict({"0": Block(), "1": Block()})
        self.head = nn.Linear(4, 6, bias=False)
        self.unused = nn.Linear(4, 2)  # never gets a gradient
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(4), persistent=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x):
        h = self.emb(x) * self.scale
        for b in self.blocks.values():
            h = b(h)
        return self.head(h)


def make(seed=0, opt="adamw", empty_at=(), tie=True, **kw):
    torch.manual_seed(seed)
    model = Net(tie=tie)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if p.dim() >= 2], "lr": 0.01, "name": "mat"},
        {"params": [p for n, p in named if p.dim() < 2], "lr": 0.02, "name": "vec"},
    ]
    for i, pos in enumerate(empty_at):
        groups.insert(pos, {"params": [], "lr": 0.5 + i, "name": f"empty{i}"})
    cls = {"adamw": torch.optim.AdamW, "sgd": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)}[opt]
    return model, cls(groups, **kw) if opt == "adamw" else cls(groups)


def step(model, opt, n=1):
    for i in range(n):
        x = torch.tensor([[i % 6, (i + 1) % 6, 2]])
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()


def view(opt):
    """Everything an optimizer holds, deep-copied, for before/after comparisons."""
    return copy.deepcopy({"state": {id(p): v for p, v in opt.state.items()}, "groups": opt.param_groups})


# -- options ----------------------------------------------------------------


def test_torch_options_are_accepted():
    from torch.distributed.checkpoint.state_dict import StateDictOptions as TorchOptions

    model, opt = make()
    step(model, opt)
    ours = hyperdsd.get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    theirs = hyperdsd.get_optimizer_state_dict(model, opt, options=TorchOptions(flatten_optimizer_state_dict=True))
    assert same(ours, theirs) and "state.blocks.0.fc.weight.exp_avg" in ours


def test_contradictory_options_raise_value_error():
    model, opt = make()
    with pytest.raises(ValueError, match="broadcast_from_rank0=True requires full_state_dict=True"):
        hyperdsd.set_optimizer_state_dict(model, opt, {}, options=StateDictOptions(broadcast_from_rank0=True))


def test_non_bool_option_is_named():
    with pytest.raises(StateDictError, match="options.strict"):
        hyperdsd.get_model_state_dict(Net(), options=StateDictOptions(strict="yes"))


# -- FQNs -------------------------------------------------------------------


def test_wrapper_segments_are_not_in_canonical_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Net()
    model.blocks["0"] = checkpoint_wrapper(model.blocks["0"])
    compiled = torch.compile(model, backend="eager")  # nothing is compiled until a forward
    index = ModelIndex(compiled)
    assert index.fqn_of(model.blocks["0"].fc.weight) == "blocks.0.fc.weight"
    assert index.canonical_key("_orig_mod.blocks.0._checkpoint_wrapped_module.fc.weight") == "blocks.0.fc.weight"
    # the checkpoint wrapper's state-dict hook already dropped its segment:
    assert index.canonical_key("_orig_mod.blocks.0.fc.weight") == "blocks.0.fc.weight"
    assert set(hyperdsd.get_model_state_dict(compiled)) == set(Net().state_dict())


def test_fqn_modifiers_hide_children():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.wrapped = Inner()

        def _fqn_modifiers(self):
            return {"alias": "wrapped"}

    index = ModelIndex(Outer())
    assert set(index.param_of) == {"lin.weight", "lin.bias"}


def test_tied_parameter_has_one_canonical_name_and_both_aliases():
    model = Net()
    index = ModelIndex(model)
    assert index.fqn_of(model.head.weight) == "emb.weight"
    assert index.param_of["emb.weight"] is index.param_of["head.weight"] is model.head.weight
    assert [p for p in index.params if p is model.head.weight] == [model.head.weight]  # listed once
    assert index.canonical("head.weight") == "emb.weight"
    sd = hyperdsd.get_model_state_dict(model)
    assert "emb.weight" in sd and "head.weight" in sd and "cache" not in sd


# -- get is pure ------------------------------------------------------------


def test_get_on_a_fresh_optimizer_changes_nothing_and_gives_placeholders():
    model, opt = make()
    before = view(opt)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    osd = hyperdsd.get_optimizer_state_dict(model, opt)
    assert same(before, view(opt)) and len(opt.state) == 0
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    entry = osd["state"]["blocks.0.fc.weight"]
    assert set(entry) == {"step", "exp_avg", "exp_avg_sq"} and float(entry["step"]) == 0.0
    assert is_unwritten_placeholder(entry["exp_avg"])
    entry["exp_avg"].copy_(torch.ones(4, 4))  # what DCP does when it loads
    assert not is_unwritten_placeholder(entry["exp_avg"])


class TaggedAdamW(torch.optim.AdamW):
    """A subclass whose constructor wants more than its defaults hold."""

    def __init__(self, params, tag, **kw):
        super().__init__(params, **kw)
        self.tag = tag


@parameterized.expand(
    [("own_class", torch.optim.AdamW, {}), ("subclass_with_own_arguments", TaggedAdamW, {"tag": "t"})]
)
def test_a_fresh_optimizers_template_runs_none_of_its_hooks(_name, cls, extra):
    torch.manual_seed(0)
    model = Net()
    opt = cls(model.parameters(), lr=0.01, **extra)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("step"))
    opt.register_step_post_hook(lambda *a: calls.append("step"))
    opt.register_state_dict_post_hook(lambda *a: calls.append("state_dict"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # wraps opt.step on the instance
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a template built, not given up on
        osd = hyperdsd.get_optimizer_state_dict(model, opt)
    assert calls == ["state_dict"]  # the real optimizer's own state_dict, nothing from the scratch step
    assert len(opt.state) == 0 and sched.last_epoch == 0
    assert set(osd["state"]["blocks.0.fc.weight"]) == {"step", "exp_avg", "exp_avg_sq"}


def test_get_reads_the_state_in_place_exactly_as_state_dict_gives_it():
    """Without state-dict hooks, get reads optimizer.state in place; with one,
    through state_dict(). Both give the same dict, and a hook's change shows."""
    model, opt = make()
    step(model, opt, 2)
    plain = hyperdsd.get_optimizer_state_dict(model, opt)
    opt.register_state_dict_post_hook(lambda o, sd: sd)
    hooked = hyperdsd.get_optimizer_state_dict(model, opt)
    assert plain["param_groups"] == hooked["param_groups"]
    assert plain["state"].keys() == hooked["state"].keys()
    for fqn, entry in plain["state"].items():
        assert entry.keys() == hooked["state"][fqn].keys()
        assert all(entry[k] is hooked["state"][fqn][k] for k in entry), fqn  # the optimizer's own tensors
    opt.register_state_dict_post_hook(lambda o, sd: sd["param_groups"][0].update(note="from a hook"))
    assert hyperdsd.get_optimizer_state_dict(model, opt)["param_groups"][0]["note"] == "from a hook"


def test_a_get_reads_through_a_state_dict_patched_on_the_optimizer():
    """torch calls an optimizer's ``state_dict`` patched on the instance; a
    get reads the state through it too, not in place."""
    model, opt = make()
    step(model, opt, 1)
    plain = opt.state_dict

    def noted():
        sd = plain()
        sd["param_groups"][0]["note"] = "patched"
        return sd

    opt.state_dict = noted
    assert hyperdsd.get_optimizer_state_dict(model, opt)["param_groups"][0]["note"] == "patched"
    del opt.state_dict
    assert "note" not in hyperdsd.get_optimizer_state_dict(model, opt)["param_groups"][0]


class _Extra(nn.Linear):
    def get_extra_state(self):
        return {"note": 1}

    def set_extra_state(self, state):
        pass


@parameterized.expand([("plain", None), ("pre_hook", "pre"), ("post_hook", "post"), ("extra_state", "extra")])
def test_get_reads_the_modules_directly_exactly_as_state_dict_gives_them(_, variant):
    """Without hooks or extra state, get reads each module's parameters and
    buffers directly; with them, through state_dict(). Either way: the keys,
    in state_dict()'s order, and the same memory, detached."""
    model = Net()
    model.shared = model.blocks["0"]  # one module under two names
    model.blocks["1"].register_parameter("gone", None)
    seen = []
    if variant == "pre":
        model.blocks["1"].register_state_dict_pre_hook(lambda m, prefix, keep_vars: seen.append(prefix))
    elif variant == "post":
        model.blocks["1"].register_state_dict_post_hook(lambda m, sd, prefix, meta: seen.append(prefix))
    elif variant == "extra":
        model.blocks["1"].fc = _Extra(4, 4)
    expected = model.state_dict()
    seen.clear()
    got = hyperdsd.get_model_state_dict(model)
    assert list(got) == list(expected)
    assert "cache" not in got and "blocks.1.gone" not in got and "shared.fc.weight" in got
    for key, value in got.items():
        if key.endswith("_extra_state"):
            assert value == expected[key]
            continue
        assert value.data_ptr() == expected[key].data_ptr() and not value.requires_grad, key
    assert seen == (["blocks.1."] if variant in ("pre", "post") else [])


def test_a_save_patched_on_a_module_or_its_class_between_calls_is_what_get_reads():
    """torch calls a ``_save_to_state_dict`` patched on the instance, and the
    class's as it is now: a get reads through either, whatever it read the
    call before (the model's index is kept from call to call)."""

    class Box(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2))

    def plus_one(self, destination, prefix, keep_vars):
        for name, p in self._parameters.items():
            destination[prefix + name] = p.detach() + 1

    model = nn.Sequential(Box(), nn.Linear(2, 2))
    assert torch.equal(hyperdsd.get_model_state_dict(model)["0.w"], torch.zeros(2))
    model[1]._save_to_state_dict = types.MethodType(plus_one, model[1])
    got = hyperdsd.get_model_state_dict(model)
    assert torch.equal(got["1.weight"], model[1].weight.detach() + 1) and torch.equal(got["0.w"], torch.zeros(2))
    del model[1]._save_to_state_dict
    Box._save_to_state_dict = plus_one
    got = hyperdsd.get_model_state_dict(model)
    assert torch.equal(got["0.w"], torch.ones(2)) and torch.equal(got["1.weight"], model[1].weight.detach())
    assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in model.state_dict().items()}

    # A module's state_dict patched on it, which its parent's state_dict calls.
    del Box._save_to_state_dict
    plain = model[1].state_dict

    def doubled(*args, destination=None, prefix="", keep_vars=False):
        out = plain(destination=destination, prefix=prefix, keep_vars=keep_vars)
        out[prefix + "weight"] = out[prefix + "weight"] * 2
        return out

    model[1].state_dict = doubled
    got = hyperdsd.get_model_state_dict(model)
    assert torch.equal(got["1.weight"], model[1].weight.detach() * 2) and torch.equal(got["0.w"], torch.zeros(2))


class _WithX(nn.Module):
    def __init__(self):
        super().__init__()
        self.x = nn.Parameter(torch.zeros(2))


@parameterized.expand([("replaced",), ("moved",), ("module_replaced",)])
def test_a_model_changed_by_an_optimizer_load_hook_is_loaded_as_it_is_then(change):
    """set_state_dict applies the optimizer's load, runs its load post-hooks,
    then the model's load, planned before: where a hook replaced a parameter
    or a whole module, or moved a parameter to the front of the next module's
    registry (names and objects in the same order), each value goes where
    ``load_state_dict`` puts it in the model as it is then."""

    def alter(model):
        if change == "replaced":
            model[0].weight = nn.Parameter(torch.zeros(2, 2))
        elif change == "module_replaced":
            model[0] = nn.Linear(2, 2)
        else:
            bias, rest = model[0]._parameters.pop("bias"), dict(model[1]._parameters)
            model[1]._parameters.clear()  # (the registry itself, as a plan keeps it)
            model[1]._parameters.update({"bias": bias, **rest})

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), _WithX())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    msd = {k: torch.full_like(v, i + 1.0) for i, (k, v) in enumerate(model.state_dict().items())}
    osd = hyperdsd.get_optimizer_state_dict(model, opt)
    expected = copy.deepcopy(model)
    alter(expected)
    expected.load_state_dict(msd, strict=False)
    opt.register_load_state_dict_post_hook(lambda optimizer: alter(model))
    hyperdsd.set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    got = {k: v.tolist() for k, v in model.state_dict().items()}
    assert got == {k: v.tolist() for k, v in expected.state_dict().items()}


def test_a_lazy_module_is_initialized_by_a_set_as_load_state_dict_does():
    """A lazy module's uninitialized parameters take the loaded tensors'
    shapes and values, as ``load_state_dict`` gives them; a value that is not
    a tensor is refused by name, and the module stays uninitialized."""
    torch.manual_seed(0)
    sd = nn.Sequential(nn.Linear(3, 4)).state_dict()
    model, reference = nn.Sequential(nn.LazyLinear(4)), nn.Sequential(nn.LazyLinear(4))
    assert hyperdsd.set_model_state_dict(model, dict(sd)) == reference.load_state_dict(dict(sd))
    assert type(model[0].weight) is nn.Parameter and model[0].weight.shape == (4, 3)
    assert all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    assert all(torch.equal(model.state_dict()[k], reference.state_dict()[k]) for k in sd)

    model = nn.Sequential(nn.LazyLinear(4))
    with pytest.raises(StateDictError, match=r"model\['0.bias'\]: the model's is uninitialized .* got int"):
        hyperdsd.set_model_state_dict(model, {"0.weight": torch.ones(4, 3), "0.bias": 3})
    assert isinstance(model[0].weight, nn.parameter.UninitializedParameter)


@parameterized.expand([("warm", float), ("cold", float), ("warm_int", int), ("warm_numpy", numpy.float32)])
def test_a_step_saved_as_a_number_loads_as_the_optimizers_tensor(target, number):
    """Checkpoints of torch before 1.12 hold ``step`` as a Python number, which
    the optimizers' own load makes a tensor: so does a set, of the dtype and
    device the optimizer keeps, into a fresh optimizer or one that stepped."""
    model, opt = make()
    step(model, opt, 3)
    osd = hyperdsd.get_optimizer_state_dict(model, opt)
    for entry in osd["state"].values():
        entry["step"] = number(entry["step"].item())
    model2, opt2 = make(seed=1)
    if target.startswith("warm"):
        step(model2, opt2, 1)
    hyperdsd.set_optimizer_state_dict(model2, opt2, osd)
    for (p, entry), p2 in zip(opt.state.items(), opt2.state):
        loaded = opt2.state[p2]["step"]
        assert type(loaded) is torch.Tensor and loaded.dtype == entry["step"].dtype and loaded.item() == 3.0
    step(model2, opt2, 1)  # (the optimizer steps with what was loaded)
    assert all(s["step"].item() == 4.0 for s in opt2.state.values())


def test_a_batch_norm_dict_saved_before_num_batches_tracked_loads_as_load_state_dict_does():
    """A batch norm's ``num_batches_tracked`` absent from a dict without version
    metadata (saved before the buffer existed, or converted) is filled in by
    the module's own load, not missing: it keeps its value, the rest loads. In
    a dict whose metadata says version 2 it is missing, as torch says."""
    import collections

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        model(torch.randn(4, 2))  # (running stats and num_batches_tracked move)
        return model

    sd = {k: v + 1 for k, v in build().state_dict().items() if not k.endswith("num_batches_tracked")}
    model, reference = build(), build()
    assert hyperdsd.set_model_state_dict(model, dict(sd)) == reference.load_state_dict(dict(sd))
    got, want = model.state_dict(), reference.state_dict()
    assert {k: v.tolist() for k, v in got.items()} == {k: v.tolist() for k, v in want.items()}
    assert got["1.num_batches_tracked"].item() == 1 and torch.equal(got["1.running_mean"], sd["1.running_mean"])

    versioned = collections.OrderedDict(sd)
    versioned._metadata = {"1": {"version": 2}}
    with pytest.raises(StateDictError, match="num_batches_tracked"):
        hyperdsd.set_model_state_dict(build(), versioned)
    with pytest.raises(RuntimeError, match="num_batches_tracked"):
        build().load_state_dict(versioned)

    # Under activation checkpointing's wrapper, whose keys leave its child's name out.
    wrapped = nn.Sequential(nn.Linear(2, 2), checkpoint_wrapper(nn.BatchNorm1d(2)))
    assert hyperdsd.set_model_state_dict(wrapped, dict(sd)) == ([], [])
    assert torch.equal(wrapped.state_dict()["1.running_var"], sd["1.running_var"])


def test_asgd_state_saved_as_numbers_loads_as_its_tensors():
    """ASGD keeps ``step``, ``eta`` and ``mu`` as 0-d tensors, which torch
    before 1.12 saved as numbers: each loads as the optimizer's own tensor."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.ASGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    osd = hyperdsd.get_optimizer_state_dict(model, opt)
    for entry in osd["state"].values():
        entry.update({k: entry[k].item() for k in ("step", "eta", "mu")})
    model2 = nn.Linear(3, 2)
    opt2 = torch.optim.ASGD(model2.parameters(), lr=0.1)
    hyperdsd.set_optimizer_state_dict(model2, opt2, osd)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("step", "eta", "mu"):
            want, got = opt.state[p][key], opt2.state[p2][key]
            assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.equal(got, want), key


def test_changing_what_get_returned_does_not_reach_the_optimizer():
    model, opt = make()
    step(model, opt, 2)
    before = view(opt)
    osd = hyperdsd.get_optimizer_state_dict(model, opt)
    for entry in osd["state"].values():
        entry.clear()
    osd["param_groups"][0]["lr"] = 99.0
    osd["param_groups"][0]["params"].clear()
    assert same(before, view(opt))


def test_keys_follow_the_optimizers_order_and_lazy_state_stays_absent():
    model, opt = make()
    step(model, opt)
    osd = hyperdsd.get_optimizer_state_dict(model, opt)
    assert osd["param_groups"][0]["params"] == [
        "emb.weight",
        "blocks.0.fc.weight",
        "blocks.1.fc.weight",
        "unused.weight",
    ]
    assert "unused.weight" not in osd["state"] and "unused.bias" not in osd["state"]


# -- set ----------------------------------------------------------------------


def test_round_trip_into_a_fresh_optimizer_matches_uninterrupted_training():
    a, oa = make(0)
    step(a, oa, 2)
    msd, osd = hyperdsd.get_state_dict(a, oa)
    msd, osd = copy.deepcopy(msd), copy.deepcopy(osd)
    b, ob = make(1)
    hyperdsd.set_state_dict(b, ob, model_state_dict=msd, optim_state_dict=osd)
    assert b.unused.weight not in ob.state and b.unused.bias not in ob.state
    step(a, oa)
    step(b, ob)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    state_a = [oa.state.get(p) for p in a.parameters()]
    state_b = [ob.state.get(p) for p in b.parameters()]
    assert same(state_a, state_b)


def test_set_copies_into_existing_state_in_place():
    a, oa = make(0)
    step(a, oa, 2)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    b, ob = make(1)
    step(b, ob)
    p = b.blocks["0"].fc.weight
    held = ob.state[p]["exp_avg"]
    ptr = held.untyped_storage().data_ptr()
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert ob.state[p]["exp_avg"] is held and held.untyped_storage().data_ptr() == ptr
    assert torch.equal(held, oa.state[a.blocks["0"].fc.weight]["exp_avg"])


def test_state_keeps_its_own_dtype():
    model, opt = make()
    step(model, opt)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(model, opt))
    osd["state"]["blocks.0.fc.weight"]["exp_avg"] = osd["state"]["blocks.0.fc.weight"]["exp_avg"].double()
    b, ob = make(1)
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert ob.state[b.blocks["0"].fc.weight]["exp_avg"].dtype == torch.float64


BAD_INPUTS = [
    ("unknown_fqn", lambda o: o["state"].__setitem__("ghost.w", {"exp_avg": torch.zeros(1)}), "ghost.w"),
    (
        "wrong_shape",
        lambda o: o["state"]["blocks.0.fc.weight"].__setitem__("exp_avg", torch.zeros(3, 4)),
        "blocks.0.fc.weight",
    ),
    ("non_tensor", lambda o: o["state"]["blocks.0.fc.weight"].__setitem__("exp_avg", "x"), "exp_avg"),
    ("non_tensor_step", lambda o: o["state"]["blocks.0.fc.weight"].__setitem__("step", "3"), "step"),
    ("no_state", lambda o: o.pop("state"), "'state'"),
    ("group_without_params", lambda o: o["param_groups"][0].pop("params"), "params"),
    (
        "missing_fqn",
        lambda o: [o["state"].pop("emb.weight"), o["param_groups"][0]["params"].remove("emb.weight")],
        "emb.weight",
    ),
    ("int_keys", lambda o: o["state"].__setitem__(0, {}), "0"),
]


@parameterized.expand(BAD_INPUTS)
def test_bad_input_raises_naming_it_and_changes_nothing(name, damage, needle):
    a, oa = make(0)
    step(a, oa, 2)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    damage(osd)
    b, ob = make(1)
    step(b, ob)
    before = view(ob)
    with pytest.raises(StateDictError) as err:
        hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert needle in str(err.value)
    assert same(before, view(ob))


def test_strict_false_loads_the_rest_and_keeps_new_parameters_fresh():
    a, oa = make(0)
    step(a, oa)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    osd["state"].pop("blocks.1.fc.weight")
    for g in osd["param_groups"]:
        if "blocks.1.fc.weight" in g["params"]:
            g["params"].remove("blocks.1.fc.weight")
    b, ob = make(1)
    hyperdsd.set_optimizer_state_dict(b, ob, osd, options=StateDictOptions(strict=False))
    assert b.blocks["1"].fc.weight not in ob.state
    assert torch.equal(ob.state[b.blocks["0"].fc.weight]["exp_avg"], oa.state[a.blocks["0"].fc.weight]["exp_avg"])


def test_group_fields_merge_initial_lr_restored_target_only_kept():
    a, oa = make(0)
    torch.optim.lr_scheduler.StepLR(oa, step_size=1)
    step(a, oa)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    b, ob = make(1)
    ob.param_groups[0]["mine"] = "kept"
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert ob.param_groups[0]["initial_lr"] == 0.01 and ob.param_groups[0]["mine"] == "kept"


@parameterized.expand([("nested", False), ("flat", True)])
def test_empty_groups_survive(name, flat):
    a, oa = make(0, empty_at=(0, 2, 5))
    step(a, oa)
    opts = StateDictOptions(flatten_optimizer_state_dict=flat)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa, options=opts))
    b, ob = make(1, empty_at=(0, 2, 5))
    for g in ob.param_groups:
        if not g["params"]:
            g["lr"] = -1.0  # the target's own value
    hyperdsd.set_optimizer_state_dict(b, ob, osd, options=opts)
    empties = [g["lr"] for g in ob.param_groups if not g["params"]]
    assert empties == ([-1.0] * 3 if flat else [0.5, 1.5, 2.5])
    assert [g["name"] for g in ob.param_groups] == [g["name"] for g in oa.param_groups]
    step(b, ob)


@parameterized.expand(
    [
        ("extra_empty", (), (1,), "the checkpoint's param_groups[1] (empty, name 'empty0') matches no group"),
        ("missing_empty", (1,), (), "the optimizer's param_groups[1] (empty, name 'empty0') has no group"),
    ]
)
def test_strict_counts_empty_groups_and_non_strict_merges(name, target_empty, source_empty, needle):
    a, oa = make(0, empty_at=source_empty)
    step(a, oa)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    b, ob = make(1, empty_at=target_empty)
    step(b, ob)
    before = view(ob)
    with pytest.raises(StateDictError) as err:
        hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert needle in str(err.value) and "empty groups counted" in str(err.value)
    assert same(before, view(ob))
    hyperdsd.set_optimizer_state_dict(b, ob, osd, options=StateDictOptions(strict=False))
    assert len(ob.param_groups) == 2 + len(target_empty)  # the optimizer's own groups, merged
    assert [g["lr"] for g in ob.param_groups if g["params"]] == [0.01, 0.02]


def test_strict_refuses_a_merged_group_naming_both():
    a, oa = make(0)
    step(a, oa)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    last = osd["param_groups"].pop()
    osd["param_groups"][0]["params"] += last["params"]
    b, ob = make(1)
    before = view(ob)
    with pytest.raises(
        StateDictError, match=r"param_groups\[0\] \(.*\) holds the parameters of the optimizer's groups \[0, 1\]"
    ):
        hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert same(before, view(ob))


# -- the flat layout -------------------------------------------------------------


def test_flatten_and_unflatten_with_dotted_and_nested_keys():
    nested = {
        "state": {"a.b": {"step": 1, "m": {"x": torch.ones(1)}}, "a.bc": {"v": torch.zeros(2)}},
        "param_groups": [{"params": ["a.b", "a.bc"], "lr": 0.1}, {"params": [], "lr": 9.0}],
    }
    flat = flat_format.flatten(nested)
    assert set(flat) == {
        "state.a.b.step",
        "state.a.b.m.x",
        "state.a.bc.v",
        "param_groups.a.b.lr",
        "param_groups.a.bc.lr",
    }
    state, fields, unknown, _ = flat_format.unflatten({**flat, "state.zz.q": 1}, {"a.b", "a.bc"})
    assert state["a.b"]["m"]["x"] is flat["state.a.b.m.x"] and state["a.bc"]["v"] is flat["state.a.bc.v"]
    assert fields == {"a.b": {"lr": 0.1}, "a.bc": {"lr": 0.1}} and unknown == ["state.zz.q"]


def test_group_fields_are_kept_whole_whatever_their_names():
    """A group field's name may hold dots or end in an index; state keys after
    it, and fields after nested state, still land under their parameter."""
    flat = {
        "state.w.step": 1,
        "state.w.m[0]": 2,
        "state.w.v": 3,
        "param_groups.w.lr": 0.1,
        "param_groups.w.sched.warmup": 5,
        "param_groups.w.x[0]": 6,
        "param_groups.w.betas": (0.9, 0.99),
        "param_groups.u.x[0]": 7,
    }
    state, fields, unknown, _ = flat_format.unflatten(flat, {"w", "u"})
    assert state == {"w": {"step": 1, "m": [2], "v": 3}} and unknown == []
    assert fields == {
        "w": {"lr": 0.1, "sched.warmup": 5, "x[0]": 6, "betas": (0.9, 0.99)},
        "u": {"x[0]": 7},
    }


def test_lists_in_nested_state_round_trip_through_the_flat_layout():
    t0, t1, t2 = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    entry = {"pre": {"traces": [t0, t1], "0": 5, "rows": [[t2]], "none": []}, "kind": "matrix", "pair": (1, 2)}
    flat = flat_format.flatten({"state": {"a.b": entry}, "param_groups": [{"params": ["a.b"], "lr": 0.1}]})
    assert {"state.a.b.pre.traces[0]", "state.a.b.pre.traces[1]", "state.a.b.pre.0", "state.a.b.pre.rows[0][0]"} <= set(
        flat
    )
    assert flat["state.a.b.pre.none"] == [] and flat["state.a.b.pair"] == (1, 2)
    state, _, unknown, _ = flat_format.unflatten(flat, {"a.b"})
    back = state["a.b"]
    assert (
        unknown == []
        and back["pre"]["traces"][0] is t0
        and back["pre"]["traces"][1] is t1
        and back["pre"]["rows"][0][0] is t2
    )
    # a dict key that is a number stays a dict key; list items come back as a list, in order
    assert back["pre"]["0"] == 5 and isinstance(back["pre"]["traces"], list) and back["kind"] == "matrix"


def test_nested_placeholders_follow_their_entry():
    from hyperdsd.state.placeholders.marks import mark_placeholder, unwritten_keys

    entry = {
        "step": mark_placeholder(torch.zeros(())),
        "pre": {"traces": [mark_placeholder(torch.zeros(2))]},
        "count": 0,
        "kind": "x",
    }
    assert unwritten_keys(entry) == ({"step", "pre", "count", "kind"}, False)  # nobody wrote: all of it is absent
    entry["pre"]["traces"][0].copy_(torch.ones(2))  # DCP loaded the nested tensor, not the step
    assert unwritten_keys(entry) == ({"step"}, False)


def test_flat_keys_match_torchs_layout():
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict as torch_get

    model, opt = make(tie=False)
    step(model, opt)
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    ours = hyperdsd.get_optimizer_state_dict(model, opt, options=opts)
    theirs = torch_get(model, opt, options=opts)
    assert set(ours) == set(theirs)
    assert all(same(ours[k], theirs[k]) for k in ours)


# -- model ------------------------------------------------------------------------


def test_model_strict_errors_change_nothing_and_non_strict_reports():
    a = Net()
    sd = copy.deepcopy(hyperdsd.get_model_state_dict(a))
    sd.pop("blocks.0.fc.bias")
    sd["ghost"] = torch.zeros(1)
    b = Net()
    before = copy.deepcopy(b.state_dict())
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "blocks.0.fc.bias"'):
        hyperdsd.set_model_state_dict(b, sd)
    assert same(before, b.state_dict())
    missing, unexpected = hyperdsd.set_model_state_dict(b, sd, options=StateDictOptions(strict=False))
    assert missing == ["blocks.0.fc.bias"] and unexpected == ["ghost"]
    assert torch.equal(b.blocks["1"].fc.weight, a.blocks["1"].fc.weight)


def test_model_wrong_shape_is_named():
    sd = copy.deepcopy(hyperdsd.get_model_state_dict(Net()))
    sd["blocks.0.fc.weight"] = torch.zeros(5, 4)
    with pytest.raises(StateDictError, match=r"blocks.0.fc.weight.*shape \(5, 4\)"):
        hyperdsd.set_model_state_dict(Net(), sd)


def test_a_model_of_plain_modules_loads_in_place_without_load_state_dict(monkeypatch):
    """Values of the tensors' own dtype are copied straight into them: the
    module tree's load_state_dict filters every key once per sibling of each
    module above it, thousands of times on a module with thousands of children."""
    src, dst = (
        nn.Sequential(*[nn.Linear(2, 2) for _ in range(300)]),
        nn.Sequential(*[nn.Linear(2, 2) for _ in range(300)]),
    )
    sd = copy.deepcopy(hyperdsd.get_model_state_dict(src))
    own = [p for p in dst.parameters()]
    calls = []
    real = nn.Module.load_state_dict
    monkeypatch.setattr(nn.Module, "load_state_dict", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    hyperdsd.set_model_state_dict(dst, sd)
    assert calls == []
    assert [p for p in dst.parameters()] == own
    assert same(dst.state_dict(), src.state_dict())
    sd["0.weight"] = sd["0.weight"].double()  # another dtype: converted by the module's own loading
    hyperdsd.set_model_state_dict(dst, sd)
    assert calls == [1]
    assert dst[0].weight.dtype == torch.float32 and torch.equal(dst[0].weight, src[0].weight)


class _Scaled(nn.Linear):
    """Extra state held in a tensor that get_extra_state hands out as it is."""

    def __init__(self):
        super().__init__(2, 2)
        self.scale = torch.ones(2)
        self.restored = 0

    def get_extra_state(self):
        return self.scale

    def set_extra_state(self, state):
        self.scale = state.clone()
        self.restored += 1


def test_extra_state_is_restored_through_set_extra_state():
    src, dst = nn.Sequential(_Scaled()), nn.Sequential(_Scaled())
    src[0].scale.fill_(3.0)
    hyperdsd.set_model_state_dict(dst, copy.deepcopy(hyperdsd.get_model_state_dict(src)))
    assert dst[0].restored == 1 and torch.equal(dst[0].scale, src[0].scale)


@pytest.mark.parametrize("how", ["overridden", "swap_tensors"])
def test_a_model_that_loads_otherwise_is_loaded_through_load_state_dict(how, monkeypatch):
    """A root that overrides load_state_dict, or torch told to swap tensors
    (each parameter's own module_load), gets every value through it."""
    calls = []

    class Counting(nn.Sequential):
        def load_state_dict(self, *args, **kwargs):
            calls.append(1)
            return super().load_state_dict(*args, **kwargs)

    src = nn.Sequential(nn.Linear(2, 2))
    dst = (Counting if how == "overridden" else nn.Sequential)(nn.Linear(2, 2))
    sd = copy.deepcopy(hyperdsd.get_model_state_dict(src))
    if how == "swap_tensors":
        real = nn.Module.load_state_dict
        monkeypatch.setattr(nn.Module, "load_state_dict", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    try:
        torch.__future__.set_swap_module_params_on_conversion(how == "swap_tensors")
        hyperdsd.set_model_state_dict(dst, sd)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    assert calls == [1]
    assert torch.equal(dst[0].weight, src[0].weight)


class _Halving(nn.Linear):
    """A module whose own loading converts what it reads."""

    def _load_from_state_dict(self, state_dict, prefix, *args):
        state_dict = {k: v / 2 if k.startswith(prefix) else v for k, v in state_dict.items()}
        super()._load_from_state_dict(state_dict, prefix, *args)


@pytest.mark.parametrize("how", ["override", "pre_hook", "parent_pre_hook", "post_hook"])
def test_modules_that_extend_their_loading_are_loaded_through_it(how):
    """Their own loading, or a module's above them (which sees the entries below
    it); with a load post-hook anywhere, every module (a post-hook sees the keys
    of the whole load)."""
    src = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    dst = nn.Sequential(_Halving(3, 3) if how == "override" else nn.Linear(3, 3), nn.Linear(3, 3))
    seen = []
    if how in ("pre_hook", "parent_pre_hook"):

        def pre_hook(module, state_dict, prefix, *args):
            key = prefix + ("0.weight" if how == "parent_pre_hook" else "weight")
            state_dict[key] = state_dict[key] / 2

        (dst if how == "parent_pre_hook" else dst[0])._register_load_state_dict_pre_hook(pre_hook, with_module=True)
    elif how == "post_hook":
        # (handed the incompatible keys of the whole load: none missing, the modules without hooks' included)
        dst[1].register_load_state_dict_post_hook(
            lambda module, keys: seen.append((module, list(keys.missing_keys), list(keys.unexpected_keys)))
        )
    hyperdsd.set_model_state_dict(dst, copy.deepcopy(hyperdsd.get_model_state_dict(src)))
    if how == "post_hook":
        assert seen == [(dst[1], [], [])]
        assert torch.equal(dst[0].weight, src[0].weight)
    else:
        assert torch.allclose(dst[0].weight, src[0].weight / 2)
    assert torch.equal(dst[1].weight, src[1].weight)


@pytest.mark.parametrize("fresh", [(), ("0.weight",), ("0.weight", "0.bias", "1.weight", "1.bias")])
def test_a_load_post_hook_sees_the_whole_load_as_torch_shows_it(fresh):
    """A module's load post-hook runs once and sees no key missing, whether
    the values are the model's own tensors (a get's dict set back), some of
    them, or none."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    seen = []
    model[1].register_load_state_dict_post_hook(
        lambda module, keys: seen.append((keys.missing_keys, keys.unexpected_keys))
    )
    sd = hyperdsd.get_model_state_dict(model)
    sd.update({k: sd[k] + 1 for k in fresh})
    expected = {k: v.clone() for k, v in sd.items()}
    hyperdsd.set_model_state_dict(model, sd)
    assert seen == [([], [])]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


def test_meta_model_is_materialised_by_a_full_load():
    src = Net()
    with torch.device("meta"):
        dst = Net()
    hyperdsd.set_model_state_dict(
        dst, hyperdsd.get_model_state_dict(src), options=StateDictOptions(full_state_dict=True)
    )
    assert dst.blocks["0"].fc.weight.device.type == "cpu"
    assert torch.equal(dst.blocks["0"].fc.weight, src.blocks["0"].fc.weight)
    assert dst.head.weight is dst.emb.weight or torch.equal(dst.head.weight, src.head.weight)


def test_aliases_are_the_same_functions():
    assert hyperdsd.get_optim_state_dict is hyperdsd.get_optimizer_state_dict
    assert hyperdsd.set_optim_state_dict is hyperdsd.set_optimizer_state_dict


def test_submodules_argument_is_refused_clearly():
    with pytest.raises(StateDictError, match="submodules"):
        hyperdsd.get_model_state_dict(Net(), submodules={nn.Linear(1, 1)})


def test_an_optimizer_over_parameters_the_model_lacks_is_refused_clearly():
    model, _ = make()
    stray = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(StateDictError, match="not a parameter of the model"):
        hyperdsd.get_optimizer_state_dict(model, stray)
    mixed = torch.optim.SGD([next(model.parameters()), nn.Parameter(torch.ones(2))], lr=0.1)
    with pytest.raises(StateDictError, match=re.escape("param_groups[0]['params'][1] (shape (2,))")):
        hyperdsd.get_optimizer_state_dict(model, mixed)
    with pytest.raises(StateDictError, match="not the model's"):
        hyperdsd.set_optimizer_state_dict(
            model, stray, {"state": {}, "param_groups": []}, options=StateDictOptions(strict=False)
        )


def test_packed_needs_send_each_distinct_region_once():
    import pickle

    from hyperdsd.transport.needs import Need, PackedNeeds

    needs = [Need(((0, 2), (0, 4))), None, Need.whole((3,))] * 5000
    packed = pickle.loads(pickle.dumps(PackedNeeds(needs)))
    assert len(packed) == len(needs)
    assert [packed[i] for i in range(len(needs))] == needs
    assert len(packed.table) == 2
    # A few bytes per tensor on the wire, not a pickled object each.
    assert len(pickle.dumps(PackedNeeds(needs))) < 8 * len(needs)


def test_a_run_need_cuts_elements_in_order_across_rows():
    # An FSDP1 flat shard holds a run of a parameter's elements, whole rows or not.
    from hyperdsd.transport.needs import Need

    full = torch.arange(12.0).view(3, 4)
    need = Need.run(2, 7)
    assert need.shape() == [5] and need.numel() == 5
    assert torch.equal(need.cut(full), torch.tensor([2.0, 3, 4, 5, 6]))
    stacked = torch.stack([full, full + 100])
    assert torch.equal(need.cut_each(stacked), torch.stack([need.cut(full), need.cut(full + 100)]))
    assert need != Need(((2, 7),))  # a region of a 1-D tensor's rows is another need
    rows = Need(((1, 3), (0, 4)))
    assert torch.equal(rows.cut_each(stacked), stacked[:, 1:3])


# -- checkpoints taken before the first step ---------------------------------


def _saved(osd, how):
    if how == "deepcopy":
        return copy.deepcopy(osd)
    buf = io.BytesIO()
    torch.save(osd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_saved_never_stepped_template_loads_as_no_state(how, warm):
    a, oa = make(0)
    msd, osd = hyperdsd.get_state_dict(a, oa)
    msd, osd = _saved(msd, how), _saved(osd, how)
    b, ob = make(1)
    if warm:
        step(b, ob, 2)
    hyperdsd.set_state_dict(b, ob, model_state_dict=msd, optim_state_dict=osd)
    assert len(ob.state) == 0  # a warm target's own state is gone too
    step(a, oa)
    step(b, ob)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert same([oa.state.get(p) for p in a.parameters()], [ob.state.get(p) for p in b.parameters()])


def test_step_zero_with_values_of_its_own_is_real_state():
    a, oa = make(0)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    osd["state"]["blocks.0.fc.weight"]["exp_avg_sq"].fill_(0.5)
    b, ob = make(1)
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert list(ob.state) == [b.blocks["0"].fc.weight]
    assert float(ob.state[b.blocks["0"].fc.weight]["step"]) == 0.0
    assert bool((ob.state[b.blocks["0"].fc.weight]["exp_avg_sq"] == 0.5).all())


def test_state_a_constructor_makes_is_real_at_step_zero():
    """Adagrad's never-stepped state (step 0, ``sum`` filled) is what its
    constructor makes, not a template: it loads, and the target steps."""
    torch.manual_seed(0)
    a = Net()
    oa = torch.optim.Adagrad(a.parameters(), lr=0.1, initial_accumulator_value=0.25)
    osd = _saved(hyperdsd.get_optimizer_state_dict(a, oa), "torch_save")
    b = Net()
    ob = torch.optim.Adagrad(b.parameters(), lr=0.1, initial_accumulator_value=0.25)
    step(b, ob, 2)
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert len(ob.state) == len(list(b.parameters()))
    assert all(float(s["step"]) == 0.0 and bool((s["sum"] == 0.25).all()) for s in ob.state.values())
    step(b, ob)


def _sgd(seed):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)


@pytest.mark.parametrize("how", ["deepcopy", "torch_save", "flat"])
@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_saved_never_stepped_sgd_template_loads_as_no_state(how, warm):
    """SGD's momentum has no ``step``: its template (zero buffers) is told by
    all of the optimizer's buffers holding it; then it resumes as a fresh
    optimizer, dampening's first step included."""
    a, oa = _sgd(0)
    flat = StateDictOptions(flatten_optimizer_state_dict=True) if how == "flat" else None
    osd = _saved(hyperdsd.get_optimizer_state_dict(a, oa, options=flat), "torch_save" if how == "flat" else how)
    b, ob = _sgd(1)
    b.load_state_dict(a.state_dict())
    if warm:
        step(b, ob, 2)
        b.load_state_dict(a.state_dict())
    hyperdsd.set_optimizer_state_dict(b, ob, osd, options=flat)
    assert len(ob.state) == 0  # a warm target's own buffers are gone too
    step(a, oa, 2)
    step(b, ob, 2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_a_real_zero_momentum_buffer_among_real_ones_loads():
    """One zero buffer (a parameter whose gradients were all zero) in a
    checkpoint with real buffers is real state, and so are the others."""
    a, oa = _sgd(0)
    step(a, oa)
    osd = _saved(hyperdsd.get_optimizer_state_dict(a, oa), "torch_save")
    zeroed = "blocks.0.fc.weight"
    osd["state"][zeroed]["momentum_buffer"].zero_()
    b, ob = _sgd(1)
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert len(ob.state) == len(oa.state)
    assert not ob.state[b.blocks["0"].fc.weight]["momentum_buffer"].any()
    assert all(s["momentum_buffer"].any() for p, s in ob.state.items() if p is not b.blocks["0"].fc.weight)


def test_zero_buffers_other_than_the_template_load():
    """Zero buffers whose keys differ from the optimizer's template are not its template: they load."""
    a, oa = _sgd(0)
    osd = _saved(hyperdsd.get_optimizer_state_dict(a, oa), "torch_save")
    for entry in osd["state"].values():
        entry["other"] = torch.zeros(())
    b, ob = _sgd(1)
    hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert len(ob.state) == len(osd["state"])


def test_a_partly_present_entry_for_a_stateless_parameter_of_a_warm_optimizer_is_refused():
    """OPT-PART-6 in a stepped optimizer, for a parameter it holds no state
    for (frozen or never reached since): what its state would be is worked
    out as for a fresh optimizer, so an entry lacking keys is refused and
    nothing changes."""
    a, oa = make(0)
    step(a, oa, 2)
    osd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    fqn, dropped = "blocks.0.fc.weight", "exp_avg_sq"
    del osd["state"][fqn][dropped]
    b, ob = make(1)
    step(b, ob, 1)
    ob.state.pop(b.blocks["0"].fc.weight)
    before = copy.deepcopy(ob.state_dict())
    with pytest.raises(StateDictError, match=rf"state\['{fqn}'\] lacks \['{dropped}'\]"):
        hyperdsd.set_optimizer_state_dict(b, ob, osd)
    assert same(ob.state_dict(), before)
    # Whole, it loads; and where the parameter's whole state is absent, the parameter keeps none.
    whole = copy.deepcopy(hyperdsd.get_optimizer_state_dict(a, oa))
    hyperdsd.set_optimizer_state_dict(b, ob, whole)
    assert same(ob.state[b.blocks["0"].fc.weight], oa.state[a.blocks["0"].fc.weight])


def test_a_run_is_not_cut_into_a_dest_of_another_shape():
    """An out= op would resize it (and the parameter it belongs to)."""
    from hyperdsd import _compat

    dests = [torch.zeros(1, 4) for _ in range(5)] + [torch.zeros(4)]
    with pytest.raises(RuntimeError):
        _compat.copy_each_of_run(dests, torch.arange(24.0).view(6, 1, 4))
    assert [tuple(t.shape) for t in dests] == [(1, 4)] * 5 + [(4,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["one-call", "dests-of-another-dtype"])
def test_a_run_lands_in_ordinary_tensors(dtype):
    """Each piece of a run lands in its dest (cut in one call where every
    dest has the piece's shape, one by one otherwise): parameters stay
    leaves autograd tracks, state stays updatable in place, and every dest's
    version is bumped as by any in-place write (placeholder state is told by
    it)."""
    from hyperdsd import _compat

    params = [torch.nn.Parameter(torch.zeros(1, 4, dtype=dtype)) for _ in range(3)]
    state = [torch.zeros(1, 4, dtype=dtype) for _ in range(3)]
    versions = [t._version for t in params + state]
    run = torch.arange(24.0).view(6, 1, 4)
    _compat.copy_each_of_run(params + state, run)
    assert all(torch.equal(t, piece.to(dtype)) for t, piece in zip(params + state, run.unbind(0)))
    assert all(t._version > v for t, v in zip(params + state, versions))
    assert not any(t.is_inference() for t in params + state)
    (params[0] * 2).sum().backward()  # still a leaf autograd tracks
    state[0].mul_(2)  # and state an optimizer can update in place
    assert torch.equal(params[0].grad, torch.full((1, 4), 2.0, dtype=dtype))


@pytest.mark.parametrize("uniform", [False, True], ids=["entries-of-other-keys", "entries-all-of-one-keys"])
def test_a_broadcast_manifest_describes_a_column_as_it_describes_each_tensor(uniform):
    """describe() takes a dict of tensors, or of entries of tensors, a column
    at a time; a dict holding anything else goes value by value. Both give
    the same stand-ins, indices, fills and shared (shape, dtype) objects,
    whether every entry holds the same keys or not."""
    from hyperdsd.agreement import describe, stand_ins_of
    from hyperdsd.state.loading.plan import TensorMeta
    from hyperdsd.tree import leaves

    def manifest(state_dict: dict) -> tuple:
        sent, fulls, metas, fills, problems = describe(state_dict)
        sent = pickle.loads(pickle.dumps((sent, metas, fills)))  # as the other ranks receive it
        return stand_ins_of(*sent), fulls, metas, problems

    def state_dicts(odd: bool) -> dict:
        model = {f"w{i}": torch.full((2, i % 3 + 1), float(i)) for i in range(6)}
        state = {f"w{i}": {"step": torch.tensor(float(i % 2)), "exp_avg": torch.zeros(2, i % 3 + 1)} for i in range(5)}
        if not uniform:
            state["w5"] = {}
        if odd:  # a value that is not a tensor: the value-by-value walk
            model["n"] = 7
            state["w6"] = {"count": 1}
        return {"model": model, "optim": {"state": state, "param_groups": [{"params": sorted(state), "lr": 0.1}]}}

    column, by_value = manifest(state_dicts(False)), manifest(state_dicts(True))
    assert column[0]["model"].keys() == state_dicts(False)["model"].keys()
    assert column[0]["optim"]["state"].get("w5") == (None if uniform else {})
    entries = list(column[0]["optim"]["state"].items())
    assert entries == list(by_value[0]["optim"]["state"].items())[: len(entries)] and len(entries) == 5 + (not uniform)
    stand_ins = [v for _, v in leaves(column[0]) if type(v) is TensorMeta]
    assert stand_ins == [v for _, v in leaves(by_value[0]) if type(v) is TensorMeta]
    assert [m.index for m in stand_ins] == list(range(16))
    # the state of never-stepped entries (w0, w2, w4) carries its one value
    assert [m.fill for m in stand_ins[6:]] == [0.0, 0.0, None, None] * 2 + [0.0, 0.0]
    assert column[2] == by_value[2] and len({id(p) for p in column[2]}) == len(set(column[2]))
    assert len(column[1]) == 16 and all(map(torch.equal, column[1], by_value[1]))
    assert column[3] == by_value[3] == []


def test_receiver_columns_need_whole_plain_tensors_and_land_in_their_dests():
    """Where every receiver is a column's, each root tensor's need comes with
    the tensor its piece lands in; a root tensor two columns receive, or a
    receiver beside the columns, takes the receiver-by-receiver path, with
    the same needs."""
    from hyperdsd.state.loading.plan import Prepared, ReceiverColumn, TensorMeta
    from hyperdsd.transport.delivery import needs_for
    from hyperdsd.transport.needs import Need, PackedNeeds

    metas = [TensorMeta((2, 3), torch.float32, i) for i in range(4)]
    dests = [torch.zeros(2, 3) for _ in range(4)]

    def column(rows: list[int]) -> ReceiverColumn:
        picked = [dests[i] for i in rows]
        return ReceiverColumn([metas[i] for i in rows], [None] * len(rows), picked, picked, None, rows)

    needs, users, cut, landing = needs_for([], metas, [column([0, 1]), column([2, 3])])
    assert list(needs) == [Need.whole((2, 3))] * 4 and not cut and users == [None] * 4
    assert type(needs) is PackedNeeds and list(pickle.loads(pickle.dumps(needs))) == list(needs)  # (as sent)
    assert all(map(operator.is_, landing, dests))

    _, users, _, landing = needs_for([], metas, [column([0, 1]), column([1, 2])])  # tensor 1 twice
    assert landing is None and type(users[1]) is tuple and len(users[1]) == 2
    extra = Prepared(None, torch.device("cpu"), meta=metas[3], dest=dests[3])
    needs, users, _, landing = needs_for([extra], metas, [column([0, 1, 2])])
    assert landing is None and needs == [Need.whole((2, 3))] * 4
    assert users[3] is extra and all(type(u) is Prepared and u.dest is dests[i] for i, u in enumerate(users[:3]))


def test_receiver_columns_ask_every_local_shape_of_dtensors():
    """A column of DTensors lands only where every local tensor has its
    layout's local shape, not the first of each signature only: a DTensor
    made with ``run_check=False`` can hold another, and a piece copied out=
    into it would resize it."""
    from types import SimpleNamespace

    from hyperdsd.state.loading.checks import Verdict
    from hyperdsd.state.loading.in_place import ColumnVerdicts, column_receivers
    from hyperdsd.state.loading.plan import TensorMeta

    layout = SimpleNamespace(local_shape=(2, 3))
    verdicts = ColumnVerdicts({0: Verdict("", layout, False, True)}, [0, 0, 0])  # one signature
    metas = [TensorMeta((4, 3), torch.float32, i) for i in range(3)]

    def existing(*shapes):
        return [SimpleNamespace(_local_tensor=torch.zeros(shape)) for shape in shapes]

    fine = existing((2, 3), (2, 3), (2, 3))
    column = column_receivers(metas, fine, verdicts, None, [0, 1, 2])
    assert column is not None and all(d is e._local_tensor for d, e in zip(column.dests, fine))
    odd = existing((2, 3), (1, 3), (2, 3))  # one signature, the second not its shape
    assert column_receivers(metas, odd, verdicts, None, [0, 1, 2]) is None


def test_receiver_columns_expand_into_the_plans_they_stand_for():
    """A plan that goes value by value (an FSDP1 twin's landing, a model whose
    tensors changed) makes each column's receivers: the model's under their
    keys, delivered or not; the optimizer's into copies of its loads' entries,
    the manifest's entries left as they were."""
    from hyperdsd.state.loading.plan import ModelLoadPlan, OptimizerLoadPlan, ParamLoad, ReceiverColumn, TensorMeta

    metas = [TensorMeta((2,), torch.float32, i) for i in range(2)]
    dests = [torch.zeros(2), torch.ones(2)]
    plan = ModelLoadPlan(values={"a": metas[0], "b": metas[1]})
    plan.columns = [ReceiverColumn(metas, [None, None], dests, dests, None, ["a", "b"])]
    plan.expand(delivered=True)
    assert not plan.columns and [p.local for p in plan.tensors()] == dests
    assert [p.meta for p in plan.tensors()] == metas and plan.tensors()[1].dest is dests[1]

    entries = [{"exp_avg": metas[0]}, {"exp_avg": metas[1]}]
    loads = [ParamLoad(None, torch.zeros(2), f"p{i}", entries[i], {"exp_avg": dests[i]}) for i in range(2)]
    optim = OptimizerLoadPlan(params=loads)
    assert optim.tensors() == []  # (in place, received by the columns)
    optim.columns = [ReceiverColumn(metas, [None, None], dests, dests, [torch.device("cpu")] * 2, loads, "exp_avg")]
    optim.expand()
    assert entries == [{"exp_avg": metas[0]}, {"exp_avg": metas[1]}]
    assert all(load.received and load.entry["exp_avg"].dest is d for load, d in zip(loads, dests))
    assert [p.local for p in optim.tensors()] == [None, None]  # (not delivered yet)


@pytest.mark.parametrize(
    "values",
    [[3.0] * 5, [3.0, 3.0, 4.0, 3.0, 3.0], [float("nan")] * 5, [0.0, -0.0, 0.0], [7.0]],
    ids=["alike", "one-differs", "nan", "signed-zeros", "one"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["run-of-their-dtype", "run-of-another-dtype"])
def test_a_run_of_0d_values_lands_in_each(values, dtype):
    """0-d values (an optimizer's steps): each dest takes its own bit for bit
    (-0.0 too), converted to its dtype, and stays an ordinary tensor with its
    version bumped (values all alike go as one value copied into each)."""
    from hyperdsd import _compat

    dests = [torch.zeros((), dtype=torch.float32) for _ in values]
    versions = [t._version for t in dests]
    run = torch.tensor(values, dtype=dtype)
    _compat.copy_each_of_run(dests, run)
    expected = run.to(torch.float32)
    assert [t.view(torch.int32).item() for t in dests] == [v.view(torch.int32).item() for v in expected]
    assert all(t.shape == () and t._version > v for t, v in zip(dests, versions))
    dests[0].add_(1)  # each its own tensor, not a view of the run or of another dest
    assert len(dests) == 1 or dests[-1].view(torch.int32).item() == expected[-1].view(torch.int32).item()
    torch.testing.assert_close(run, torch.tensor(values, dtype=dtype), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError):  # (a run of another length than its dests is refused, as it was)
        _compat.copy_each_of_run(dests + [torch.zeros(())], run)


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(3.0),
        torch.tensor(-0.0),
        torch.tensor(1e-3, dtype=torch.bfloat16),
        torch.tensor(0.1, dtype=torch.float64),
        torch.tensor(2**62 + 1),
        torch.tensor(True),
        torch.tensor(1 + 2j, dtype=torch.complex64),
    ],
    ids=["float", "minus-zero", "bf16", "double", "int64", "bool", "complex"],
)
def test_a_summary_sends_0d_state_as_its_value(value):
    """An FSDP1 unit's summary of a parameter's state (sent to every rank)
    holds a 0-d tensor as its value, dtype and device, which give the tensor
    back bit for bit (a NaN's payload aside); it pickles without a tensor (torch pickles each through
    a storage archive of its own)."""
    import pickle

    from hyperdsd.fsdp1.summaries import HeldValue, summarize

    summary = summarize({"step": value, "exp_avg": torch.zeros(4), "nested": {"count": value}}, per_element=4)
    sent = pickle.loads(pickle.dumps(summary))
    assert b"torch._utils" not in pickle.dumps(summary)
    for held in (sent["step"][1], sent["nested"][1]["count"]):
        assert isinstance(held, HeldValue)
        back = held.tensor()
        assert back.dtype == value.dtype and back.shape == () and back.device == value.device
        assert torch.equal(back.reshape(1).view(torch.uint8), value.reshape(1).view(torch.uint8))
    assert sent["exp_avg"][0] == "rows"


def test_summaries_of_state_stepped_alike_share_a_key_and_no_other_does():
    """Equal summaries are sent as one object (hyperdsd.fsdp1.summaries.summary_key):
    two parameters' state stepped alike share a key; a step that differs in
    value, sign of zero, dtype or device, a per-element tensor of another
    dtype, or another key set does not; nested state is not keyed."""
    from hyperdsd.fsdp1.summaries import summarize, summary_key

    def key(step, exp_avg=torch.zeros(4), **extra):
        return summary_key(summarize({"step": step, "exp_avg": exp_avg, **extra}, per_element=4))

    same = key(torch.tensor(3.0))
    assert same is not None and hash(same) == hash(key(torch.tensor(3.0))) and same == key(torch.tensor(3.0))
    others = [
        key(torch.tensor(4.0)),
        key(torch.tensor(3.0, dtype=torch.float64)),
        key(torch.tensor(3)),
        key(torch.tensor(3.0), exp_avg=torch.zeros(4, dtype=torch.bfloat16)),
        key(torch.tensor(3.0), exp_avg_sq=torch.zeros(4)),
    ]
    assert all(other != same for other in others)
    assert key(torch.tensor(0.0)) != key(torch.tensor(-0.0))
    assert key(torch.tensor(3.0), nested={"count": torch.tensor(1.0)}) is None


_QUICK_VALUES = [
    torch.tensor(3.0),
    torch.tensor(-0.0),
    torch.tensor(0.0),
    torch.tensor(float("nan")),
    torch.tensor(3.0, dtype=torch.float64),
    torch.tensor(3),
    torch.tensor(True),
    torch.tensor(1 + 2j),
    torch.zeros(4),
    torch.zeros(4, dtype=torch.bfloat16),
    torch.zeros(5),
    torch.zeros(2, 2),
    torch.empty((), device="meta"),
    torch.nn.Parameter(torch.zeros(4)),
    1.5,
    [torch.zeros(4)],
    {"count": torch.tensor(1.0)},
]


@hypothesis.settings(deadline=None)
@hypothesis.given(
    hypothesis.strategies.dictionaries(
        hypothesis.strategies.sampled_from(["step", "exp_avg", "exp_avg_sq", "momentum"]),
        hypothesis.strategies.sampled_from(_QUICK_VALUES),
    )
)
def test_a_summary_key_read_straight_from_an_entry_is_the_summarys(entry):
    """hyperdsd.fsdp1.summaries.quick_summary_key, which finds a summary already
    made for parameters stepped alike, gives the key of the entry's summary
    wherever it gives one (and gives one for every entry of plain tensors
    whose summary has a key)."""
    from hyperdsd.fsdp1.summaries import quick_summary_key, summarize, summary_key

    quick, full = quick_summary_key(entry, 4), summary_key(summarize(entry, 4))
    assert quick is None or quick == full
    plain = all(type(v) is torch.Tensor for v in entry.values())
    assert quick is not None or not plain or full is None


@hypothesis.settings(deadline=None)
@hypothesis.given(
    hypothesis.strategies.lists(
        hypothesis.strategies.one_of(
            hypothesis.strategies.none(),
            hypothesis.strategies.dictionaries(
                hypothesis.strategies.sampled_from(["step", "exp_avg", "exp_avg_sq", "momentum"]),
                hypothesis.strategies.sampled_from([*_QUICK_VALUES, None, torch.ones(2, 3), (torch.ones(3), 2)]),
            ),
        ),
        max_size=5,
    )
)
def test_a_units_per_element_paths_are_every_entrys_walked(entries):
    """hyperdsd.fsdp1.summaries.entry_paths, which looks a key's tensor up once
    for a unit's entries, finds the paths and dtypes a walk of every value of
    every entry finds (the first entry's dtype where they differ), sorted."""
    from hyperdsd.fsdp1.summaries import entry_paths
    from hyperdsd.tree import leaves

    walked: dict = {}
    for entry in entries:
        for key, value in (entry or {}).items():
            for path, leaf in leaves(value, (key,)):
                if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                    walked.setdefault(path, leaf.dtype)
    assert entry_paths(entries) == sorted(walked.items(), key=lambda item: str(item[0]))


def _grouped_one_by_one(codes, columns, positions):
    """The scatter's grouping as a dict of tuples builds it: the oracle."""
    runs: dict = {}
    for code, i in zip(codes, positions):
        runs.setdefault((code, tuple(column[i] for column in columns)), []).append(i)
    return list(runs.values())


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(data=hypothesis.strategies.data())
def test_tensors_needed_alike_group_as_a_key_per_tensor_groups_them(data):
    """The scatter's runs (tensors of one shape every rank needs alike) are
    grouped a column at a time; the groups, their order and each one's order
    are those of a key per tensor, on every positions and widths of needs,
    including keys wider than 64 bits folded together."""
    from array import array

    from hyperdsd.transport.needs import alike_groups

    st = hypothesis.strategies
    total = data.draw(st.integers(0, 60))
    width = data.draw(st.sampled_from([2, 5, 3000]))
    columns = data.draw(st.lists(st.lists(st.integers(-1, width), min_size=total, max_size=total), max_size=9))
    columns = [array("i", column) for column in columns]
    if data.draw(st.booleans()):
        positions = range(total)
    else:
        positions = data.draw(st.lists(st.integers(0, max(total - 1, 0)), unique=True)) if total else []
    codes = data.draw(st.lists(st.integers(0, 4), min_size=len(positions), max_size=len(positions)))
    assert alike_groups(codes, columns, positions) == _grouped_one_by_one(codes, columns, positions)


def test_a_broadcasts_claimed_names_go_as_a_range_where_a_rank_loads_all():
    from hyperdsd.agreement import _positions, _unclaimed

    names = ["a", "b", "c"]
    assert _positions(names, {"a", "b", "c", "x"}) == range(3)
    assert _positions(names, {"c", "a"}) == [0, 2]
    assert _unclaimed(names, [[0, 2], range(3)]) == []
    assert _unclaimed(names, [[0], [2], []]) == ["b"]
    assert _unclaimed(names, [range(2), [0]]) == ["c"]  # (a range of fewer names claims those)


def test_receiver_columns_numbered_by_layout_need_what_their_layouts_say():
    """A column whose planner numbered its layouts (a handful, each number one
    layout) gets the needs and landings of the same column without numbers;
    a root tensor received twice still takes the receiver-by-receiver path."""
    from types import SimpleNamespace

    from hyperdsd.state.loading.plan import ReceiverColumn, TensorMeta
    from hyperdsd.transport.delivery import needs_for
    from hyperdsd.transport.needs import Need

    def layout(start, stop):
        return SimpleNamespace(
            simple=True, mesh="mesh", placements=(start,), shape=(4, 3), local_slices=lambda: (slice(start, stop),)
        )

    top, bottom = layout(0, 2), layout(2, 4)
    metas = [TensorMeta((4, 3), torch.float32, i) for i in range(4)]
    dests = [torch.zeros(2, 3) for _ in range(4)]

    def column(rows, numbered):
        layouts = [top if i % 2 == 0 else bottom for i in rows]
        codes = [i % 2 for i in rows] if numbered else None
        by_code = {0: top, 1: bottom} if numbered else None
        picked = [dests[i] for i in rows]
        return ReceiverColumn([metas[i] for i in rows], layouts, picked, picked, None, rows, None, codes, by_code)

    numbered = needs_for([], metas, [column([0, 1], True), column([2, 3], True)])
    plain = needs_for([], metas, [column([0, 1], False), column([2, 3], False)])
    assert list(numbered[0]) == list(plain[0]) == [Need(((0, 2),)), Need(((2, 4),))] * 2
    assert all(map(operator.is_, numbered[3], dests)) and all(map(operator.is_, plain[3], dests))
    _, users, _, landing = needs_for([], metas, [column([0, 1], True), column([1, 2], True)])  # tensor 1 twice
    assert landing is None and type(users[1]) is tuple and len(users[1]) == 2


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8])
def test_blocks_cover_a_column_once_in_order(n, monkeypatch):
    import hyperdsd.blocks

    monkeypatch.setattr(hyperdsd.blocks, "BLOCK", 3)
    column = list(range(n))
    parts = [column[block] for block in hyperdsd.blocks.blocks(n)]
    assert sum(parts, []) == column
    assert all(1 <= len(part) <= 3 for part in parts)


class IndexedSGD(torch.optim.SGD):
    """State that depends on a parameter's place in its group, not on the parameter alone."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                self.state[p]["index"] = torch.tensor(float(i))


# Kinds in one group that differ in dtype alone, and in shape alone.
PARAMS = (
    [((3, 4), torch.float32)] * 3 + [((3, 4), torch.float64), ((5,), torch.float64)] + [((3, 4), torch.float32)] * 3
)
OPTIMIZERS = [
    (torch.optim.AdamW, {"amsgrad": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.Adagrad, {"initial_accumulator_value": 0.3}),
    (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
    (IndexedSGD, {"lr": 0.1, "momentum": 0.9}),
]


def _groups(params):
    return [{"params": params[:5], "lr": 0.1}, {"params": params[5:], "lr": 0.2, "weight_decay": 0.5}]


@pytest.mark.parametrize("which", range(5), ids=["adamw", "sgd", "adagrad", "rmsprop", "subclass"])
def test_the_scratch_step_by_kind_of_parameter_gives_what_a_step_over_each_gives(which):
    """A never-stepped optimizer's placeholder state comes from a scratch step
    over one stand-in per kind of parameter in a group (torch's per-parameter
    optimizers): each parameter's state is what a step over every parameter
    gives, its own tensors; other optimizers step a stand-in per parameter."""
    from hyperdsd.state.placeholders.scratch import _PER_PARAMETER, scratch_step

    cls, kwargs = OPTIMIZERS[which]
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(*shape, dtype=dtype)) for shape, dtype in PARAMS]
    params[2].requires_grad_(False)  # frozen: a load still checks its state against a step's
    opt = cls(_groups(params), **kwargs)
    got, eager = scratch_step(opt, warn=False)
    # The same step, a stand-in per parameter: the optimizer over zeros with zero gradients.
    stand_ins = [nn.Parameter(torch.zeros_like(p)) for p in params]
    for s in stand_ins:
        s.grad = torch.zeros_like(s)
    reference = cls(_groups(stand_ins), **kwargs)
    made_by_constructor = {id(s) for s in stand_ins if reference.state.get(s)}
    reference.step()
    assert list(got) == params
    for p, s in zip(params, stand_ins):
        assert list(got[p]) == list(reference.state[s]), p.shape
        for key, value in got[p].items():
            want = reference.state[s][key]
            assert type(value) is type(want) and (value.dtype, value.shape) == (want.dtype, want.shape), key
            assert torch.equal(value, want), key
        assert (p in eager) == (id(s) in made_by_constructor)
    tensors = [t for entry in got.values() for t in entry.values()]
    assert len({id(t) for t in tensors}) == len(tensors), "parameters share state tensors"
    assert (type(opt) in _PER_PARAMETER) == (which != 4)


@hypothesis.settings(deadline=None)
@hypothesis.given(data=hypothesis.strategies.data())
def test_a_units_landings_are_each_parameters_own_slice(data):
    """hyperdsd.fsdp1.places.Places.in_shard, which cuts the views a broadcast
    lands a unit's pieces in, gives each parameter the
    slice of this rank's flat shard that holds its elements (gaps between
    parameters and padding after them too), and the run of its elements; a
    parameter the shard holds none of lands nowhere."""
    from hyperdsd.fsdp1.places import NOWHERE, Places
    from hyperdsd.transport.needs import Need

    strategies = hypothesis.strategies
    numels = data.draw(strategies.lists(strategies.integers(1, 9), min_size=1, max_size=8))
    gaps = data.draw(strategies.lists(strategies.integers(0, 3), min_size=len(numels), max_size=len(numels)))
    offsets, at = [], 0
    for numel, gap in zip(numels, gaps):
        offsets.append(at + gap)
        at += gap + numel
    size = data.draw(strategies.integers(1, 4))
    shard = -(-at // size)
    index = data.draw(strategies.integers(0, size - 1))
    lo, hi = index * shard, (index + 1) * shard
    spans = {
        i: (max(o, lo), min(o + n, hi)) for i, (o, n) in enumerate(zip(offsets, numels)) if max(o, lo) < min(o + n, hi)
    }
    unit = types.SimpleNamespace(
        index=index, shard=shard, fqns=[f"p{i}" for i in range(len(numels))], own_spans=spans,
        unit=types.SimpleNamespace(offsets=offsets),
    )  # fmt: skip
    ids = data.draw(strategies.permutations(range(len(numels))))
    buffer = torch.arange(shard, dtype=torch.float32)
    for i, landing in zip(ids, Places([unit]).in_shard(0, ids, buffer)):
        if i not in spans:
            assert landing is NOWHERE
            continue
        a, b = spans[i]
        assert landing.need == Need.run(a - offsets[i], b - offsets[i])
        assert landing.into.data_ptr() == buffer[a - lo :].data_ptr() and landing.into.numel() == b - a
