"""hyperdsd's DCP reader and writer, in one process: what the reader loads is what DCP's own reader and
torch.load load; what the writer writes is what torch.save writes, byte for byte."""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader

from hyperdsd.checkpoint import reader as dcp_reader
from hyperdsd.checkpoint.reader import Reader, tensor_from_bytes
from hyperdsd.checkpoint.writer import Writer, save_tensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _saved(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _base():
    return torch.arange(24, dtype=torch.float32).reshape(4, 6)


CASES = {
    "contiguous": lambda: torch.randn(3, 5),
    "bfloat16": lambda: torch.randn(7).to(torch.bfloat16),
    "0-d int64": lambda: torch.tensor(12),
    "bool": lambda: torch.tensor([True, False, True]),
    "complex": lambda: torch.randn(2, 2, dtype=torch.complex64),
    "column view": lambda: _base()[:, 1],
    "offset view": lambda: _base()[2:],
    "transposed": lambda: _base().t(),
    "empty": lambda: torch.empty(0, 3),
    "requires grad": lambda: torch.nn.Parameter(torch.randn(2, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_tensor_from_bytes_is_torch_load(case):
    data = _saved(CASES[case]())
    want = torch.load(io.BytesIO(data), weights_only=True)
    got = tensor_from_bytes(memoryview(data))
    assert type(got) is type(want)
    assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == (
        want.dtype,
        want.shape,
        want.stride(),
        want.storage_offset(),
    )
    assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
    assert torch.equal(got, want)


def test_anything_but_one_plain_tensor_goes_through_torch_load():
    value = {"a": torch.ones(2), "b": [torch.zeros(1)]}
    got = tensor_from_bytes(_saved(value))
    assert set(got) == {"a", "b"} and torch.equal(got["a"], value["a"]) and torch.equal(got["b"][0], value["b"][0])
    with pytest.raises(Exception):  # noqa: B017 - torch.load's own error for what is not an archive
        tensor_from_bytes(b"not a checkpoint")


def _state():
    g = torch.Generator().manual_seed(0)
    small = {f"w{i}": torch.randn(3, 4, generator=g) for i in range(300)}
    return {
        "small": small,
        "large": torch.randn(2**19, generator=g),  # 2 MiB: read on its own, from the file
        "view": torch.arange(40.0).reshape(8, 5)[:, 2],
        "step": 7,
        "name": "run-1",
    }


def _template():
    return {
        "small": {f"w{i}": torch.zeros(3, 4) for i in range(300)},
        "large": torch.zeros(2**19),
        "view": torch.zeros(8),
        "step": 0,
        "name": "",
    }


@pytest.mark.parametrize("span_bytes", [dcp_reader.SPAN_BYTES, 4096])
def test_reader_loads_what_dcps_reader_loads(tmp_path, monkeypatch, span_bytes):
    monkeypatch.setattr(dcp_reader, "SPAN_BYTES", span_bytes)
    state = _state()
    dcp.save(state, checkpoint_id=str(tmp_path))
    ours, theirs = _template(), _template()
    dcp.load(ours, storage_reader=Reader(str(tmp_path)))
    dcp.load(theirs, storage_reader=FileSystemReader(str(tmp_path)))
    assert ours["step"] == theirs["step"] == 7 and ours["name"] == theirs["name"] == "run-1"
    for key in ("large", "view"):
        assert torch.equal(ours[key], state[key]) and torch.equal(theirs[key], state[key]), key
    for key, value in state["small"].items():
        assert torch.equal(ours["small"][key], value), key


def test_reader_refuses_a_data_file_shorter_than_its_metadata(tmp_path):
    dcp.save(_state(), checkpoint_id=str(tmp_path))
    data = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    with pytest.raises(CheckpointException) as info:
        dcp.load(_template(), storage_reader=Reader(str(tmp_path)))
    error, _trace = info.value.failures[0]
    assert "ends before byte" in str(error)


def test_metadata_read_before_is_used_once_and_only_while_unchanged(tmp_path, monkeypatch):
    dcp.save(_state(), checkpoint_id=str(tmp_path))
    from hyperdsd.checkpoint import commit

    metadata = FileSystemReader(str(tmp_path)).read_metadata()
    stamp = commit.metadata_stamp(tmp_path)
    reader = Reader(str(tmp_path), metadata, stamp)
    assert reader.read_metadata() is metadata
    assert reader.read_metadata() is not metadata  # once
    stale = Reader(str(tmp_path), metadata, (0, 0, 0))
    assert stale.read_metadata() is not metadata


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_tensor_writes_what_torch_save_writes(case):
    value = CASES[case]()
    for _ in range(2):  # the first of a kind, then from the records kept for it
        ours = io.BytesIO()
        save_tensor(value, ours)
        assert ours.getvalue() == _saved(value)
    value.data.add_(1) if value.dtype != torch.bool else value.data.logical_not_()
    ours = io.BytesIO()
    save_tensor(value, ours)
    assert ours.getvalue() == _saved(value)


def test_writer_writes_what_dcps_writer_writes(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=Writer(str(tmp_path / "ours")))
    dcp.save(state, checkpoint_id=str(tmp_path / "theirs"))
    ours, theirs = (FileSystemReader(str(tmp_path / name)).read_metadata() for name in ("ours", "theirs"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert set(ours.storage_data) == set(theirs.storage_data)
    for name in ("ours", "theirs"):
        loaded = _template()
        dcp.load(loaded, storage_reader=FileSystemReader(str(tmp_path / name)))  # torch's reader
        assert loaded["step"] == 7 and loaded["name"] == "run-1"
        for key in ("large", "view"):
            assert torch.equal(loaded[key], state[key]), (name, key)
        for key, value in state["small"].items():
            assert torch.equal(loaded["small"][key], value), (name, key)
    files = lambda name: sorted(p.name for p in (tmp_path / name).iterdir())  # noqa: E731
    assert files("ours") == files("theirs")
