"""Collected by ``pytest --pyargs conformance``: every case of the matrix."""

import pytest

from conformance.pytest_plugin import check_case
from conformance.running.registry import all_cases


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id, marks=pytest.mark.dsd_case(c.id)) for c in all_cases()])
def test_case(dsd_runner, case):
    check_case(dsd_runner, case)


@pytest.mark.dsd_explore
def test_explore(dsd_runner, request):
    """A bounded exploration of generated scenarios (--dsd-explore BUDGET)."""
    from conformance.pytest_plugin import check_exploration

    opt = request.config.getoption
    check_exploration(
        dsd_runner,
        opt("--dsd-explore"),
        opt("--dsd-explore-seed"),
        opt("--dsd-explore-world-sizes"),
        opt("--dsd-explore-rounds"),
    )
