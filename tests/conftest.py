"""Test-suite-wide fixtures, and figures that tests record as properties."""

import os

import pytest
from helpers import scaled, slowness


def pytest_sessionstart(session):
    slowness()  # measured once, before any test loads the machine (docs/TESTING.md)


def pytest_collection_modifyitems(config, items):
    """pytest-timeout's limit per test (pyproject.toml) is the reference
    machine's: scaled like every other limit, unless the command line or
    PYTEST_TIMEOUT sets one."""
    if not config.pluginmanager.hasplugin("timeout") or config.getoption("timeout", None) is not None:
        return
    ini = config.getini("timeout")
    if not ini or os.environ.get("PYTEST_TIMEOUT"):
        return
    limit = pytest.mark.timeout(scaled(float(ini)))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(limit)


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
