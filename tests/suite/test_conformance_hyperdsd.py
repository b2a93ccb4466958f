"""The conformance matrix against hyperdsd: one test per case ID.

Every core case must pass; a case that does not apply here (an optional
profile hyperdsd does not claim, pinned memory without an accelerator) is
reported as skipped with its reason, never as passed.
"""

import pytest
from helpers import slowness

from conformance.adapters import load_adapter
from conformance.pytest_plugin import check_case
from conformance.running.registry import all_cases
from conformance.running.runner import Runner
from hyperdsd.testing import PoolSet


@pytest.fixture(scope="session")
def runner():
    pools = PoolSet()
    runner = Runner(load_adapter("hyperdsd"), pools, deadline_scale=slowness())
    yield runner
    pools.kill()
    runner.close()


@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.id)
def test_case(runner, case):
    check_case(runner, case)
