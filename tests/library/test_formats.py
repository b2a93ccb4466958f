"""Message formats, each written out in full beside the code that makes it.

The expected text is inline (expecttest): after a deliberate format change,
``EXPECTTEST_ACCEPT=1 python -m pytest tests/library/test_formats.py`` rewrites the
literals in place, and the diff shows the new messages for review.
"""

import pytest
import torch
from expecttest import assert_expected_inline

from conformance.judging.oracle import CheckFailure, describe_tensor_difference, fail_if
from conformance.running.registry import case_id
from hyperdsd.errors import StateDictError
from hyperdsd.transport.collectives import raise_if_any


def test_case_ids_join_the_parts_that_are_given():
    assert_expected_inline(case_id("OPT-RT-1", "fsdp4", "adamw", None, "dcp"), """OPT-RT-1[fsdp4-adamw-dcp]""")
    assert_expected_inline(case_id("MODEL-KEYS-1", "single"), """MODEL-KEYS-1[single]""")


def test_a_problem_on_several_ranks_is_written_once_with_the_ranks_that_share_it():
    by_rank = [["missing key 'layers.0.weight'"], [], ["missing key 'layers.0.weight'"], ["unexpected key 'head.bias'"]]
    with pytest.raises(StateDictError) as info:
        raise_if_any(by_rank, "the state dict does not match the model")
    assert_expected_inline(
        str(info.value),
        """\
the state dict does not match the model
  on ranks 0,2:
    missing key 'layers.0.weight'
  on rank 3:
    unexpected key 'head.bias'""",
    )


def test_a_long_problem_list_is_cut_at_twenty():
    with pytest.raises(StateDictError) as info:
        raise_if_any([[f"missing key 'w{i}'" for i in range(23)]], "the state dict does not match the model")
    assert_expected_inline(
        str(info.value),
        """\
the state dict does not match the model
  on rank 0:
    missing key 'w0'
    missing key 'w1'
    missing key 'w2'
    missing key 'w3'
    missing key 'w4'
    missing key 'w5'
    missing key 'w6'
    missing key 'w7'
    missing key 'w8'
    missing key 'w9'
    missing key 'w10'
    missing key 'w11'
    missing key 'w12'
    missing key 'w13'
    missing key 'w14'
    missing key 'w15'
    missing key 'w16'
    missing key 'w17'
    missing key 'w18'
    missing key 'w19'
    ... and 3 more""",
    )


def test_no_problem_on_any_rank_raises_nothing():
    raise_if_any([[], [], []], "never shown")


def test_tensor_differences_name_what_differs():
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = a.clone()
    b[1, 2] += 0.5
    lines = [
        describe_tensor_difference(a, b, "layers.0.weight"),
        describe_tensor_difference(a, a * (1 + 1e-3), "layers.0.weight", rtol=1e-5),
        describe_tensor_difference(a, a.double(), "state.layers.0.weight.exp_avg"),
        describe_tensor_difference(a, a.reshape(3, 2), "state.layers.0.weight.exp_avg"),
        describe_tensor_difference(a, [1.0], "state.layers.0.weight.step"),
    ]
    assert_expected_inline(
        "\n".join(lines),
        """\
layers.0.weight: values differ (bitwise): max abs error 5.000e-01 at index (1, 2)
layers.0.weight: values differ (rtol 1e-05, atol 5e-05): max abs error 5.000e-03 at index (1, 2)
state.layers.0.weight.exp_avg: dtype torch.float64, expected torch.float32
state.layers.0.weight.exp_avg: shape (3, 2), expected (2, 3)
state.layers.0.weight.step: expected a tensor, got list""",
    )
    assert describe_tensor_difference(a, a.clone(), "layers.0.weight") is None
    assert describe_tensor_difference(a, a * (1 + 1e-7), "layers.0.weight", rtol=1e-5) is None


def test_a_long_difference_list_shows_twelve_and_counts_the_rest():
    with pytest.raises(CheckFailure) as info:
        fail_if([f"state.w{i}.exp_avg: missing" for i in range(15)], "optimizer state after the round trip")
    assert_expected_inline(
        str(info.value),
        """\
optimizer state after the round trip:
  state.w0.exp_avg: missing
  state.w1.exp_avg: missing
  state.w2.exp_avg: missing
  state.w3.exp_avg: missing
  state.w4.exp_avg: missing
  state.w5.exp_avg: missing
  state.w6.exp_avg: missing
  state.w7.exp_avg: missing
  state.w8.exp_avg: missing
  state.w9.exp_avg: missing
  state.w10.exp_avg: missing
  state.w11.exp_avg: missing
  ... and 3 more""",
    )
    fail_if([], "nothing differs")
