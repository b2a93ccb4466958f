"""Property-based: malformed state dicts make set_* raise on every rank, within
the deadline, and leave model and optimizer bit-identical (2 ranks, FSDP2).

Hypothesis is derandomized, so every run tries the same inputs; the number
tried and passed is printed in the test summary (and kept as a JUnit property).
"""

import bad_input_tasks
import pytest
from helpers import scaled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyperdsd.testing import PoolSet, Task

OPTIM_NESTED = [
    "no_state",
    "no_groups",
    "state_not_dict",
    "entry_not_dict",
    "group_without_params",
    "params_not_strings",
    "unknown_fqn",
    "unknown_state",
    "missing_fqn",
    "missing_key",
    "wrong_shape",
    "wrong_dtype",
    "non_tensor",
    "non_tensor_step",
    "wrong_mesh",
]
OPTIM_FLAT = [
    "unknown_key",
    "wrong_shape",
    "wrong_dtype",
    "non_tensor",
    "non_tensor_step",
    "wrong_mesh",
    "missing_fqn",
    "nested_under_value",
]
OPTIM_BCAST = [
    "wrong_shape",
    "wrong_dtype",
    "non_tensor",
    "unknown_state",
    "missing_fqn",
    "entry_not_dict",
    "group_without_params",
]
MODEL = ["missing_key", "extra_key", "wrong_shape", "wrong_dtype", "non_tensor", "wrong_mesh"]
MODEL_BCAST = ["missing_key", "extra_key", "wrong_shape", "wrong_dtype", "non_tensor"]
JUNK = st.sampled_from(["garbage", 1.5, None, [1, 2], {"x": 1}])


def specs():
    common = {"pick": st.integers(0, 50), "junk": JUNK, "where": st.sampled_from(["one", "all"])}
    return st.one_of(
        st.fixed_dictionaries(
            {"target": st.just("optim"), "mode": st.just("sharded"), "kind": st.sampled_from(OPTIM_NESTED), **common}
        ),
        st.fixed_dictionaries(
            {"target": st.just("optim"), "mode": st.just("flat"), "kind": st.sampled_from(OPTIM_FLAT), **common}
        ),
        st.fixed_dictionaries(
            {"target": st.just("optim"), "mode": st.just("bcast"), "kind": st.sampled_from(OPTIM_BCAST), **common}
        ),
        st.fixed_dictionaries(
            {"target": st.just("model"), "mode": st.just("sharded"), "kind": st.sampled_from(MODEL), **common}
        ),
        st.fixed_dictionaries(
            {"target": st.just("model"), "mode": st.just("bcast"), "kind": st.sampled_from(MODEL_BCAST), **common}
        ),
    )


@pytest.fixture(scope="module")
def pools():
    ps = PoolSet(gloo_timeout_s=scaled(20))
    yield ps
    ps.kill()


def test_malformed_input_raises_everywhere_and_changes_nothing(pools, record_property):
    tally = {"tried": 0, "passed": 0}

    @settings(
        derandomize=True,
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(specs())
    def check(spec):
        tally["tried"] += 1
        outcome = pools.run(2, Task(bad_input_tasks.bad_input, {"spec": spec}), scaled(30))
        assert outcome.status == "passed", f"{spec}: {outcome.describe()}"
        for rank, value in enumerate(outcome.values):
            assert value["raised"] is not None, f"{spec}: rank {rank} did not raise"
            assert value["unchanged"], f"{spec}: rank {rank} changed its model or optimizer: {value['raised']}"
        tally["passed"] += 1

    try:
        check()
    finally:
        record_property("bad_inputs_tried", tally["tried"])
        record_property("bad_inputs_passed", tally["passed"])
