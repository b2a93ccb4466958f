"""The adapter guide's worked example runs, and the suite's verdict on it is what the guide says.

The example backend returns plain local shards in sharded mode. In memory
that round-trips; through DCP it cannot (DCP takes a plain tensor for a
replicated one and keeps one rank's shard), and OPT-DT-1 names the cause.
"""

import pytest

from conformance.adapters import load_adapter
from conformance.registry import by_id
from conformance.runner import Runner
from hyperdsd.testing import PoolSet

IMPL = "conformance.examples.vendor_adapter"
EXPECTED = {
    "OPT-KEYS-1[fsdp2-adamw-sharded]": "passed",  # FQN keys: fine
    "OPT-RT-1[fsdp2-adamw-sharded]": "passed",  # an in-memory round trip survives local shards
    "OPT-RT-1[single-adamw-dcp]": "passed",  # nothing is sharded on one rank
    "OPT-RT-1[fsdp3-adamw-dcp]": "failed",  # uneven local shards: DCP sees a size mismatch
    "OPT-DT-1[fsdp2-adamw-sharded]": "failed",  # the cause: state is not DTensor
    "OPT-KEYS-4[single-sharded]": "failed",  # the backend takes one optimizer
    "OPT-DT-4[single-adamw-sharded]": "passed",  # claimed 'inplace': loads into existing tensors
}


@pytest.fixture(scope="module")
def runner():
    pools = PoolSet()
    runner = Runner(load_adapter(IMPL), pools)
    yield runner
    pools.kill()
    runner.close()


@pytest.mark.parametrize("case_id, expected", sorted(EXPECTED.items()))
def test_verdict_on_the_example(runner, case_id, expected):
    result = runner.run_case(by_id()[case_id])
    assert result.status == expected, f"{case_id}: {result.status}\n{result.message}"
    if case_id.startswith("OPT-DT-1"):
        assert "expected a DTensor like its parameter" in result.message
    if case_id.startswith("OPT-KEYS-4"):
        assert "takes one optimizer" in result.message


def test_unclaimed_profile_is_not_applicable(runner):
    case = by_id()["OPT-DT-4[single-adamw-sharded]"]
    from dataclasses import replace

    assert load_adapter(IMPL).claims("inplace") and not load_adapter(IMPL).claims("multi-optimizer")
    result = Runner(load_adapter("torch"), runner.executor).run_case(replace(case))
    assert result.status == "n/a" and "does not claim the 'inplace' profile" in result.message
