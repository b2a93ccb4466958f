"""Reports name tensors, never print their values (SPEC §4, 1.4; issue 47):
the suite's own messages, an implementation's exceptions, and every report
file of a run whose failures are made of tensors."""

import json
import os

import pytest
import torch
from helpers import run_cli

from conformance.judging.naming import cut, describe, name_tensors, show
from tools.perverse.faulty import PLANTED


@pytest.mark.parametrize(
    "tensor, named",
    [
        (torch.nn.Parameter(torch.randn(3, 4)), "<Parameter shape=(3, 4) float32>"),
        (torch.randn(2, 3, dtype=torch.float64), "<tensor shape=(2, 3) float64>"),
        (torch.tensor(3.0), "<tensor shape=() float32>"),
        (torch.arange(5), "<tensor shape=(5,) int64>"),
        (torch.tensor([True, False]), "<tensor shape=(2,) bool>"),
        (torch.zeros(2, 0), "<tensor shape=(2, 0)>"),  # no values: nothing tells the default dtype
        (torch.randn(2, 2, requires_grad=True) * 2, "<tensor shape=(2, 2) float32>"),
        (torch.randn(40, 40), "<tensor values left out float32>"),  # torch summarises: no shape in the text
        (torch.randn(2, 2).to(torch.bfloat16), "<tensor shape=(2, 2) bfloat16>"),
    ],
)
def test_a_printout_in_text_becomes_a_description(tensor, named):
    text = f"KeyError: {tensor!r} was not found; {tensor!s}"
    got = name_tensors(text)
    assert got == f"KeyError: {named} was not found; {named}"


def test_a_dtensor_printout_keeps_its_mesh_and_placements():
    text = (
        "DTensor(local_tensor=tensor([[0.1000, 0.2000]]), device_mesh=DeviceMesh('cpu', [0, 1]), "
        "placements=(Shard(dim=0),))"
    )
    got = name_tensors(text)
    assert "0.1000" not in got and "<tensor shape=(1, 2) float32>" in got and "placements=(Shard(dim=0),)" in got


def test_words_that_only_look_like_a_printout_stay():
    assert name_tensors("a tensor(s) here") == "a tensor(s) here"


def test_show_names_tensors_and_cuts_what_is_long():
    p = torch.nn.Parameter(torch.full((3,), PLANTED))
    got = show({p: [torch.ones(2)] * 20, "s": "x" * 500, "n": 1}, names={id(p): "0.weight"})
    assert str(int(PLANTED)) not in got
    assert "<Parameter '0.weight' shape=(3,) float32 cpu>: [<Tensor shape=(2,) float32 cpu>" in got
    assert "… and 12 more]" in got and "…(+300 chars)" in got and "'n': 1" in got
    assert describe(p) == "<Parameter shape=(3,) float32 cpu>"


def test_cut_counts_what_it_left_out():
    text = "\n".join(f"line {i}" for i in range(100))
    assert cut(text, max_lines=3) == "line 0\nline 1\nline 2\n… (97 more lines cut)"
    assert cut("x" * 50, max_chars=10) == "x" * 10 + " … (+40 chars cut)"
    assert cut("short") == "short"


def test_no_report_of_a_run_shows_a_planted_tensors_values(tmp_path):
    """The implementation returns a tensor as a key and a wrong value, raises a
    KeyError on a parameter and an error whose text holds a tensor's printout:
    every report names them, none prints them."""
    cases = ["MODEL-1[single-sharded]", "OPT-RT-1[single-adamw-sharded]", "OPT-KEYS-1[single-adamw-full]"]
    args = ["--impl", "tools.perverse.faulty:tensor_messages", "--report", str(tmp_path)]
    proc, _ = run_cli(args + [a for c in cases for a in ("-k", c)], timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    outputs = {"stdout": proc.stdout, "stderr": proc.stderr}
    outputs.update({name: (tmp_path / name).read_text() for name in os.listdir(tmp_path)})
    assert set(outputs) >= {"report.json", "report.md", "report.html", "junit.xml"}
    for name, text in outputs.items():
        for printed in (f"{PLANTED:.4f}", f"{PLANTED:.2f}", str(int(PLANTED))):
            assert printed not in text, f"{name} shows the planted values ({printed})"
        assert "tensor([" not in text and "Parameter containing" not in text, name
    verdicts = {c["id"]: c for c in json.loads(outputs["report.json"])["cases"]}
    assert {c["status"] for c in verdicts.values()} == {"failed"}
    # Named instead: what it is, its shape and dtype.
    assert (
        "KeyError in get_optimizer_state_dict: '<Parameter shape=(16, 8) float32 cpu>'"
        in (verdicts["OPT-KEYS-1[single-adamw-full]"]["message"])
    )
    assert "cannot load <Parameter shape=(16, 8) float32> here" in verdicts["OPT-RT-1[single-adamw-sharded]"]["message"]
    assert '"<Parameter shape=(8,) float32>"' in verdicts["MODEL-1[single-sharded]"]["message"]
