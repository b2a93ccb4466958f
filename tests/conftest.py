"""Test-suite-wide fixtures, and figures that tests record as properties."""

import pytest

from helpers import slowness


def pytest_sessionstart(session):
    slowness()  # measured once, before any test loads the machine (docs/TESTING.md)


def pytest_report_header(config):
    return f"machine slowness: {slowness():.1f}x the reference machine (limits that runs must meet are scaled by it)"


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
