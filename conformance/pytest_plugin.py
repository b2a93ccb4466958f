"""The suite as a pytest plugin: ``pytest --pyargs conformance --dsd-impl X``.

One pytest test per case ID, so ``-k``, ``-n`` (pytest-xdist: every worker
keeps its own pools in private directories), ``--junitxml`` and
pytest-timeout work as usual. ``--dsd-xfails FILE`` marks matching cases as
expected failures: they still run and report XFAIL or XPASS.
``--dsd-explore 2m`` adds one test, ``test_explore``, that explores
generated scenarios for that long (``python -m conformance explore``) and
fails with each shrunk deviation and its replay command; without the
option that test is deselected, not skipped.

Installing hyperdsd registers this plugin in every pytest run of the
environment, so this module imports only the standard library and pytest:
torch, the case registry and the runner are imported by the fixture and the
check that run a case, never by a run that collects none.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from .running.registry import Case
    from .running.runner import Runner


def pytest_addoption(parser):
    group = parser.getgroup("conformance", "distributed state-dict conformance")
    group.addoption(
        "--dsd-impl",
        default=os.environ.get("CONFORMANCE_IMPL", "hyperdsd"),
        help="implementation under test (as python -m conformance --impl)",
    )
    group.addoption("--dsd-xfails", default=None, help="expected failures: lines 'CASE_ID_OR_PREFIX  # reason, link'")
    group.addoption(
        "--dsd-timeout", type=float, default=None, help="per-case deadline in seconds (default: each case's own)"
    )
    group.addoption(
        "--dsd-deadline-scale",
        type=float,
        default=1.0,
        help="multiply each case's own deadline (a slow or busy machine); ignored with --dsd-timeout",
    )
    group.addoption(
        "--dsd-explore",
        default=None,
        metavar="BUDGET",
        help="also explore generated scenarios for BUDGET (90s, 2m): test_explore fails on any deviation",
    )
    group.addoption("--dsd-explore-seed", type=int, default=0, help="the exploration's seed (default 0)")
    group.addoption(
        "--dsd-explore-rounds",
        type=int,
        default=None,
        help="stop after this many rounds (a round ends once hypothesis has shrunk what it found; default: the budget)",
    )
    group.addoption(
        "--dsd-explore-world-sizes",
        default="1,2,3,4",
        help="the world sizes exploration draws layouts of (default 1,2,3,4)",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "dsd_case(case_id): a conformance case")
    config.addinivalue_line("markers", "dsd_explore: the bounded exploration (runs with --dsd-explore only)")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--dsd-explore"):
        explore = [i for i in items if i.get_closest_marker("dsd_explore")]
        if explore:
            items[:] = [i for i in items if not i.get_closest_marker("dsd_explore")]
            config.hook.pytest_deselected(items=explore)
    path = config.getoption("--dsd-xfails")
    if not path:
        return
    from .running.xfails import Xfails

    xfails = Xfails.load(path)
    for item in items:
        marker = item.get_closest_marker("dsd_case")
        if marker is None:
            continue
        entry = xfails.match(marker.args[0])
        if entry is not None:
            entry.used = True
            item.add_marker(pytest.mark.xfail(reason=entry.reason or "listed in --dsd-xfails", strict=False))
    for entry in xfails.unmatched():
        item_ids = [i.get_closest_marker("dsd_case").args[0] for i in items if i.get_closest_marker("dsd_case")]
        if not any(cid.startswith(entry.pattern) for cid in item_ids):
            config.issue_config_time_warning(
                pytest.PytestConfigWarning(
                    f"{path}:{entry.line}: xfail entry {entry.pattern!r} matches no collected case"
                ),
                2,
            )


@pytest.fixture(scope="session")
def dsd_runner(request):
    """A runner with persistent pools for this pytest process (one per xdist worker)."""
    from hyperdsd.testing import PoolSet, environment_problems

    from .adapters import load_adapter
    from .running.runner import Runner

    for problem in environment_problems():
        raise pytest.UsageError(problem)
    impl = request.config.getoption("--dsd-impl")
    pools = PoolSet(preload=("conformance.running.runner",))
    options = request.config.getoption
    runner = Runner(
        load_adapter(impl),
        pools,
        timeout=options("--dsd-timeout"),
        deadline_scale=options("--dsd-deadline-scale"),
    )
    yield runner
    pools.kill()
    runner.close()


def check_case(runner: Runner, case: Case) -> None:
    """Run ``case`` and turn its verdict into a pytest outcome."""
    reason = runner.applicability(case)
    if reason:
        pytest.skip(f"not applicable: {reason}")
    from hyperdsd.testing import Status  # here, not at import: the plugin loads without torch

    result = runner.run_case(case)
    if result.status == Status.NOT_APPLICABLE:
        pytest.skip(f"not applicable: {result.message}")
    if result.status != Status.PASSED:
        pytest.fail(
            f"{case.id}: {result.status}\n{result.message}\nrepro: {result.repro}\n\n{result.details}", pytrace=False
        )


def check_exploration(runner: Runner, budget: str, seed: int, world_sizes: str, rounds: int | None = None) -> None:
    """Explore for ``budget`` (or ``rounds``, if fewer); fail with every shrunk deviation found."""
    from .exploring.engine import ScenarioRunner, explore
    from .exploring.findings import describe_finding
    from .exploring.strategy import ExploreUsageError, choices, parse_budget

    try:
        sizes = [int(x) for x in world_sizes.split(",") if x.strip()]
        report = explore(
            ScenarioRunner(runner),
            choices(runner.adapter, sizes),
            budget_s=parse_budget(budget),
            seed=seed,
            world_sizes=sizes,
            max_rounds=rounds,
        )
    except (ExploreUsageError, ValueError) as exc:
        raise pytest.UsageError(f"--dsd-explore: {exc}") from None
    summary = f"{report.ran} scenarios in {report.elapsed_s:.0f}s ({report.per_minute:.1f} per minute), seed {seed}"
    if report.findings:
        text = "\n\n".join(describe_finding(f, runner.impl) for f in report.findings)
        pytest.fail(f"{len(report.findings)} deviations; {summary}\n\n{text}", pytrace=False)
