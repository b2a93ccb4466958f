"""The conformance matrix against hyperdsd: one test per case ID.

Every core case must pass; a case of an optional profile hyperdsd does not
claim is reported as skipped with that reason, never as passed.
"""

import pytest

from conformance.adapters import load_adapter
from conformance.registry import all_cases
from conformance.runner import Runner
from hyperdsd.testing import PoolSet

IMPL = "hyperdsd"


@pytest.fixture(scope="session")
def runner():
    pools = PoolSet()
    yield Runner(IMPL, pools=pools)
    pools.kill()


@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.id)
def test_case(runner, case):
    if not load_adapter(IMPL).claims(case.profile):
        pytest.skip(f"not applicable: {IMPL} does not claim the {case.profile!r} profile")
    result = runner.run_case(case)
    if result.status == "n/a":
        pytest.skip(f"not applicable here: {result.message}")
    assert result.status == "passed", f"{case.id}: {result.status}\n{result.message}\n{result.details}\nrepro: {result.repro}"
