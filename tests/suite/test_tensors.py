"""The suite reads distributed values through the adapter's protocol (SPEC 1.6), whatever their class.

A toy protocol stands in for a stack of its own: it takes plain tensors it
was told about for distributed values (their local data), with a layout it
keeps beside them. The oracle, the snapshot, the names in reports and the
adapter's declaration must all go through it.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from conformance import tensors
from conformance.adapters import Adapter, AdapterError, describe_declaration
from conformance.judging.naming import describe
from conformance.judging.oracle import describe_tensor_difference, held_entry, layout_problems

ROW = tensors.MeshDescription((0, 1), (2,), ("shard",))
GRID = tensors.MeshDescription((0, 1, 2, 3), (2, 2), ("replicate", "shard"))


class ToyProtocol(tensors.TensorProtocol):
    """Registered plain tensors are distributed values: their own data is their local part."""

    name = "ToyTensor"

    def __init__(self):
        self.layouts = {}

    def make(self, local, mesh, placements, shape):
        self.layouts[id(local)] = (local, mesh, tuple(placements), torch.Size(shape))
        return local

    def is_distributed(self, value):
        hit = self.layouts.get(id(value))
        return hit is not None and hit[0] is value

    def local(self, value):
        return value

    def global_shape(self, value):
        return self.layouts[id(value)][3]

    def placements(self, value):
        return self.layouts[id(value)][2]

    def mesh(self, value):
        return self.layouts[id(value)][1]

    def full(self, value):
        raise AssertionError("no collective in these tests")

    def like(self, value, local, shape=None):
        _, mesh, placements, own = self.layouts[id(value)]
        return self.make(local, mesh, placements, own if shape is None else shape)

    def from_torch(self, dtensor):
        raise AssertionError("not used here")

    def held(self, value, param):
        if self.is_distributed(param) and not self.is_distributed(value) and value.dim() > 0:
            return self.like(param, value)
        return value


@pytest.fixture
def toy():
    protocol = ToyProtocol()
    tensors.use(protocol)
    yield protocol
    tensors.use(None)


def test_a_mesh_description_places_each_rank_row_major():
    assert [GRID.coordinate(r) for r in GRID.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert GRID.coordinate(7) is None and GRID.size() == 4 and GRID.size(1) == 2
    assert ROW == tensors.MeshDescription((0, 1), (2,), ("shard",), torch_mesh=object())  # torch's mesh not compared


def test_values_of_the_same_layout_are_compared_by_their_local_data(toy):
    a = toy.make(torch.ones(2, 3), ROW, [Shard(0)], (4, 3))
    b = toy.make(torch.ones(2, 3), ROW, [Shard(0)], (4, 3))
    assert describe_tensor_difference(a, b, "x") is None
    c = toy.make(torch.zeros(2, 3), ROW, [Shard(0)], (4, 3))
    assert "values differ" in describe_tensor_difference(a, c, "x")


def test_a_layout_difference_is_named_placements_mesh_then_global_shape(toy):
    a = toy.make(torch.ones(2, 3), ROW, [Shard(0)], (4, 3))
    other_placements = toy.make(torch.ones(2, 3), ROW, [Replicate()], (4, 3))
    other_mesh = toy.make(torch.ones(2, 3), tensors.MeshDescription((2, 3), (2,), ("shard",)), [Shard(0)], (4, 3))
    other_shape = toy.make(torch.ones(2, 3), ROW, [Shard(0)], (3, 3))
    assert "placements (Replicate(),)" in describe_tensor_difference(a, other_placements, "x")
    assert "mesh" in describe_tensor_difference(a, other_mesh, "x")
    assert "global shape (3, 3), expected (4, 3)" in describe_tensor_difference(a, other_shape, "x")
    plain = torch.ones(2, 3)
    assert describe_tensor_difference(a, plain, "x") == "x: expected Tensor, got Tensor"


def test_state_held_as_plain_local_shards_is_read_like_its_parameter(toy):
    param = toy.make(torch.ones(2, 3), GRID, [Replicate(), Shard(0)], (4, 3))
    entry = held_entry({"exp_avg": torch.zeros(2, 3), "step": torch.tensor(3.0), "name": "x"}, param)
    assert toy.is_distributed(entry["exp_avg"]) and toy.mesh(entry["exp_avg"]) == GRID
    assert not toy.is_distributed(entry["step"]) and entry["name"] == "x"
    assert layout_problems({"w": entry}, {"w": param}, "state", local=True) == []
    unheld = {"exp_avg": torch.zeros(2, 3)}
    (problem,) = layout_problems({"w": unheld}, {"w": param}, "state", local=False)
    assert "a Tensor, expected a ToyTensor like its parameter" in problem


def test_block_start_follows_the_mesh_coordinate(toy):
    rows = toy.make(torch.ones(2, 3), GRID, [Replicate(), Shard(0)], (3, 3))  # chunks of 2 and 1 rows
    assert tensors.block_start(rows, 0) == tensors.block_start(rows, 2) == (0, 0)  # the first chunk, each replica
    last = toy.make(torch.ones(1, 3), GRID, [Replicate(), Shard(0)], (3, 3))
    assert tensors.block_start(last, 1) == tensors.block_start(last, 3) == (2, 0)
    assert tensors.block_start(rows, 1) is None  # two rows where this rank's chunk has one: not a block
    twice = toy.make(torch.ones(1, 3), GRID, [Shard(0), Shard(0)], (4, 3))
    assert tensors.block_start(twice, 0) is None


def test_reports_name_a_stacks_value_by_its_layout(toy):
    value = toy.make(torch.ones(2, 3), ROW, [Shard(0)], (4, 3))
    assert describe(value, "w") == "<Tensor 'w' shape=(4, 3) float32 cpu placements=(Shard(dim=0),) local=(2, 3)>"
    assert tensors.copied(value) is not value and toy.is_distributed(tensors.copied(value))


def _adapter(**fields):
    def nothing(*args, **kwargs):
        return None

    functions = dict.fromkeys(
        ("get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict"),
        nothing,
    )
    return Adapter(name="toy", options=dict, **functions, **fields)


def test_an_adapter_declares_its_tensors_and_checkpoint_and_a_torch_stack_reads_as_before():
    plain = _adapter()
    assert "tensors" not in plain.declaration() and "checkpoint" not in plain.declaration()
    own = _adapter(tensors=ToyProtocol(), save_checkpoint=print, load_checkpoint=print)
    assert own.declaration()["tensors"] == "ToyTensor" and own.declaration()["checkpoint"] == "own"
    assert describe_declaration(own.declaration()).endswith("; tensors ToyTensor; checkpoint own")
    with pytest.raises(AdapterError, match="save_checkpoint and load_checkpoint"):
        _adapter(save_checkpoint=print)
