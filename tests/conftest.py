"""Test-suite-wide fixtures, and figures that tests record as properties."""

import pytest


@pytest.fixture(scope="module")
def pools():
    """Rank pools for one test module, killed at its end."""
    from hyperdsd.testing import PoolSet

    ps = PoolSet()
    yield ps
    ps.kill()



def pytest_terminal_summary(terminalreporter):
    figures = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for name, value in getattr(report, "user_properties", ()):
                if name.startswith("bad_inputs_"):
                    figures[name] = value
    if figures:
        terminalreporter.write_line(
            f"bad-input property test: {figures.get('bad_inputs_passed', 0)} of {figures.get('bad_inputs_tried', 0)} "
            "malformed state dicts raised on every rank and changed nothing"
        )
