"""The suite's own transport of many small tensors: one buffer and an index
(conformance.judging.packed), in object exchanges, the files a resharding
case writes, and the DCP storage the many-key cases save through
(conformance.world.dcp_storage)."""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from conformance.judging import packed
from conformance.world.dcp_storage import BatchedReader, BatchedWriter

# DCP outside a process group says it assumes one process: it is one here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _tree():
    return {
        "params": {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.int64)},
        "state": {
            "a.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3).t(), "name": "kept", "n": 7},
            "half": {"m": torch.randn(2, 2, dtype=torch.bfloat16), "flag": torch.tensor([True, False])},
            "empty": {"m": torch.empty(0, 3)},
        },
        "groups": [{"params": ["a.weight"], "lr": 0.1, "betas": (0.9, 0.95)}],
    }


def _same(want, got, where="tree"):
    assert type(want) is type(got), where
    if isinstance(want, torch.Tensor):
        assert (want.dtype, want.shape) == (got.dtype, got.shape), where
        assert torch.equal(want, got), where
    elif isinstance(want, dict):
        assert list(want) == list(got), where
        for k in want:
            _same(want[k], got[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(want) == len(got), where
        for i, (w, g) in enumerate(zip(want, got)):
            _same(w, g, f"{where}[{i}]")
    else:
        assert want == got, where


def test_a_packed_tree_comes_back_as_it_was(tmp_path):
    tree = _tree()
    path = tmp_path / "tree.pt"
    torch.save(packed.pack(tree), path)
    _same(tree, packed.unpack(torch.load(path, weights_only=True)))


def test_packed_tensors_start_where_any_dtype_may_be_viewed():
    tensors = [torch.ones(3, dtype=torch.uint8), torch.ones(2, dtype=torch.float64), torch.ones(1, dtype=torch.int16)]
    blob = packed.blob(tensors)
    assert all(start % 16 == 0 for start, *_ in blob["index"])
    for want, got in zip(tensors, packed.unblob(blob)):
        assert torch.equal(want, got) and got.dtype == want.dtype


@pytest.mark.parametrize("items", [0, 1, 3000])
def test_dcp_through_the_batched_storage_round_trips(tmp_path, items):
    state = {
        "t": {f"w{i}": torch.randn(3) * i for i in range(items)},
        "fields": {"lr": 0.5, "name": "g", "ids": [1, 2]},
    }
    state["t"]["big"] = torch.randn(7, 5)
    path = str(tmp_path / "ckpt")
    dcp.save(state, checkpoint_id=path, storage_writer=BatchedWriter(path))
    # One file for the data of the one rank, beside DCP's metadata: not a file or a pickle per tensor.
    assert sorted(os.listdir(path)) == [".metadata", "rank0.pt"]
    target = {
        "t": {k: torch.zeros_like(v) for k, v in state["t"].items()},
        "fields": {"lr": 0.0, "name": "", "ids": []},
    }
    dcp.load(target, checkpoint_id=path, storage_reader=BatchedReader(path))
    _same(state, target)


def test_a_missing_key_is_dcps_error_as_with_its_own_storage(tmp_path):
    path = str(tmp_path / "ckpt")
    dcp.save({"a": torch.ones(2)}, checkpoint_id=path, storage_writer=BatchedWriter(path))
    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: b"):
        dcp.load({"a": torch.zeros(2), "b": torch.zeros(2)}, checkpoint_id=path, storage_reader=BatchedReader(path))
