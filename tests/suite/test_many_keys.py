"""The many-key model of SPEC SCALE (conformance.world.many_keys): the count
and the places of its hard parts are what SPEC §2 says they are."""

import torch

from conformance.world import many_keys
from conformance.world.groups import GroupSpec, param_groups
from conformance.world.models import ToyModel, batch, loss_fn


def _model(pipeline=False):
    torch.manual_seed(0)
    return ToyModel(many_keys.config(pipeline=pipeline))


def test_the_count_and_the_groups_end_where_no_block_would():
    named = list(_model().named_parameters())
    groups = param_groups(named, GroupSpec(cuts=many_keys.CUTS))
    sizes = [len(g["params"]) for g in groups]
    assert len(named) == 2133 and sizes == [1037, 523, 573]
    assert max(sizes) > 1024 and all(size % 64 for size in sizes)
    for block in (64, 128, 256, 512):  # a block of each size ends inside every group, twice or more for these
        assert all(size // block >= 1 and size % block for size in sizes) and max(sizes) // block >= 2
    assert len({g["lr"] for g in groups}) == 3
    assert len(list(_model(pipeline=True).named_parameters())) == 2134  # the head untied


def test_the_hard_parts_sit_where_the_docstring_says():
    names = [n for n, _ in _model().named_parameters()]
    lazy = [names[p] for p in many_keys.LAZY_AT]
    frozen = [names[p] for p in many_keys.FROZEN_AT]
    assert lazy == ["layers.0.lanes.0.weight", "layers.1.lanes.119.weight", "layers.3.lanes.115.weight"] + [
        "layers.4.lanes.0.weight",
        "layers.5.lanes.111.weight",
        "layers.7.lanes.129.weight",
    ]
    assert names[511].endswith(".weight") and names[512] == names[511].replace("weight", "bias")  # across 511-512
    assert names[1036] == "layers.3.lanes.115.bias" and names[1037] == "layers.3.lanes.116.weight"  # group 0's end
    assert names[1559] == "layers.5.lanes.111.weight" and names[1560] == "layers.5.lanes.111.bias"  # across the cut
    assert frozen == [f for f in many_keys.FROZEN if f.endswith(".weight")]
    assert names[1037] in many_keys.FROZEN  # the first of group 1
    block = {n for n, p in _model().named_parameters() if p.dtype == torch.float64}
    assert block == {n for n in names if n.startswith(f"layers.{many_keys.OTHER_DTYPE_BLOCK}.")}
    assert [names.index(n) for n in sorted(block, key=names.index)][::265] == [1065, 1330]


def test_every_lane_that_runs_gets_a_gradient_of_its_own_and_the_lazy_ones_none():
    model = _model()
    tokens, targets = batch(0, 0, model.cfg)
    loss_fn(model(tokens), targets).backward()
    lazy = set(many_keys.lane_fqns(many_keys.LAZY_AT))
    lanes = [(n, p) for n, p in model.named_parameters() if ".lanes." in n]
    assert all((p.grad is None) == (n in lazy) for n, p in lanes)
    grads = [tuple(p.grad.flatten().tolist()) for n, p in lanes if n not in lazy and n.endswith(".weight")]
    assert len(set(grads)) == len(grads), "two lanes share a gradient: state filed under the wrong lane would not show"
