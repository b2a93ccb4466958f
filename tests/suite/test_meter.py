"""The arithmetic behind the suite's memory bounds (conformance.judging.meter,
MODEL-3): what counts as state received, whose receive counts, and the
bound a non-root rank's broadcast load is held to."""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from conformance.judging.meter import ReceiveMeter, payload_bytes
from conformance.kit.damage import drop_from_dict
from conformance.sections.model import receive_bound, share_bytes


@dataclass
class _Meta:  # what a manifest sends in place of a tensor
    shape: tuple
    dtype: torch.dtype


def test_payload_counts_tensors_and_raw_bytes_wherever_they_travel_and_nothing_else():
    t = torch.zeros(3, 4)  # 48 bytes
    assert payload_bytes(t) == 48
    assert payload_bytes([{"w": t, "name": "layers.0.fc1.weight"}, (t.double(), 5)]) == 48 + 96
    assert payload_bytes({"blob": b"x" * 10, "meta": _Meta((3, 4), torch.float32)}) == 10
    assert payload_bytes(_Meta((1 << 20,), torch.float32)) == 0  # control: names, shapes, dtypes
    assert payload_bytes(type("Box", (), {})()) == 0
    box = type("Box", (), {})()
    box.inner = {"t": t}
    assert payload_bytes(box) == 48  # tensors inside an object's attributes are state too
    cyclic = [t]
    cyclic.append(cyclic)
    assert payload_bytes(cyclic) == 48
    assert payload_bytes([t, t]) == 48  # one object sent once


def test_a_rank_counts_what_it_receives_but_not_what_it_sends_as_root(monkeypatch):
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    meter = ReceiveMeter()
    meter.count(0, [torch.zeros(8), {"step": torch.zeros(())}])  # from rank 0: received
    meter.count(None, torch.zeros(2, dtype=torch.float64))  # an all-gather: every rank receives
    meter.count(1, torch.zeros(100))  # this rank is the root: it sent
    assert (meter.payload, meter.calls) == (32 + 4 + 16, 3)
    assert meter.total >= meter.payload  # objects count whole, pickled, in the total


def test_the_bound_is_the_share_plus_one_tensor_and_a_whole_copy_exceeds_it():
    # A model of fsdp2's kind: each rank holds half of every parameter.
    full = {"emb": torch.zeros(16, 8), "fc1": torch.zeros(12, 8), "b1": torch.zeros(12), "fc2": torch.zeros(8, 12)}
    half = {k: v[: (v.shape[0] + 1) // 2] for k, v in full.items()}
    share, largest = share_bytes(half), max(v.nbytes for v in full.values())
    assert share == sum(v.nbytes for v in half.values())
    assert receive_bound(share, largest) == share + largest
    assert share_bytes(full) > receive_bound(share, largest)  # every tensor whole: fails
    assert share_bytes({"w": torch.zeros(2), "extra": {"index": 3}}) == 8  # non-tensors hold no state bytes


def test_partly_present_state_is_cut_from_nested_and_flat_dicts_where_a_rank_has_it():
    class Saved:
        def __init__(self, optim):
            self.optim = optim

    nested = Saved({"state": {"w": {"exp_avg": 1, "exp_avg_sq": 2, "step": 3}}, "param_groups": []})
    drop_from_dict(nested, "w", "exp_avg_sq")
    assert nested.optim["state"]["w"] == {"exp_avg": 1, "step": 3}
    flat = Saved({"state.a.b.step": 1, "state.a.b.exp_avg": 2})
    drop_from_dict(flat, "a.b", "step")
    assert flat.optim == {"state.a.b.exp_avg": 2}
    empty = Saved({})  # full_cpu on a rank other than the root
    drop_from_dict(empty, "w", "step")
    assert empty.optim == {}
