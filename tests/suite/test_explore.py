"""Exploration (python -m conformance explore): the strategy, tokens, replay,
shrinking against a planted bug, and found scenarios as cases."""

import json
import os

import pytest
from helpers import run_cli, runner_on, scaled
from hypothesis import HealthCheck, given, settings

from conformance.adapters import load_adapter
from conformance.exploring.findings import normalise
from conformance.exploring.strategy import choices, parse_budget, strategy
from conformance.running.generated import clause_cases, clauses_of, found_cases, load_found, scenario_case
from conformance.running.runner import undeclared
from conformance.world.layouts import parse_layout
from conformance.world.scenario import Scenario

PLANTED = "tools.perverse.faulty:halves_router_state"
# A bounded exploration: one round at world size 1, where a scenario takes
# well under a second on a quiet reference machine.
# One round ends once the planted bug is shrunk; the budget only bounds a round that a
# loaded machine slows down (a budget that ran out mid-shrink left the scenario unshrunk).
BUDGET_S = scaled(300)


def _declared_only_sharded():
    from dataclasses import replace

    return replace(load_adapter("hyperdsd"), name="sharded-only", modes=("sharded",), get_modes=None, load_modes=None)


@pytest.mark.parametrize("world_sizes", [[1, 2], [4]])
def test_the_strategy_draws_only_what_the_adapter_declares(world_sizes):
    adapter = _declared_only_sharded()
    ch = choices(adapter, world_sizes)
    seen = set()

    @settings(max_examples=150, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(strategy(ch))
    def drawn(s):
        s.validate()
        assert s.mode == "sharded"
        assert parse_layout(s.layout).world_size in world_sizes
        for case in clause_cases(s):
            assert not undeclared(adapter, case), (case.id, undeclared(adapter, case))
        seen.add(s.layout)

    drawn()
    assert seen == set(ch.layouts) and len(seen) > 1


def test_an_undeclared_pipeline_is_never_drawn():
    from dataclasses import replace

    adapter = replace(load_adapter("hyperdsd"), layouts=())
    ch = choices(adapter, [1, 2, 4])
    assert ch.layouts and not any(parse_layout(x).pp > 1 for x in ch.layouts)


def test_tokens_round_trip_and_bad_ones_are_named():
    s = Scenario(layout="fsdp2", mode="bcast", dim=3, router=True, router_group=True, empty_at=(0, 4), warm=2)
    assert Scenario.from_token(s.token) == s
    assert Scenario.from_dict(json.loads(s.to_json())) == s
    with pytest.raises(ValueError, match="not a scenario token"):
        Scenario.from_token("abc")
    with pytest.raises(ValueError, match="does not decode"):
        Scenario.from_token("s1.!!!!")
    with pytest.raises(ValueError, match="pipeline stages"):
        Scenario(layout="pp2", tie=True).validate()
    with pytest.raises(ValueError, match="unknown fields"):
        Scenario.from_dict({"layout": "single", "colour": "red"})


def test_a_scenario_runs_the_checks_of_the_clauses_it_contains():
    assert clauses_of(Scenario()) == ("MODEL-1", "OPT-PURE-2", "OPT-RT-1")
    assert clauses_of(Scenario(before=0)) == ("MODEL-1", "OPT-PURE-1", "OPT-RT-1")
    busy = Scenario(layout="fsdp2", mode="bcast", extra_state="dict", empty_at=(1,), scheduler=True, warm=1, before=0)
    assert clauses_of(busy) == ("MODEL-3", "MODEL-5", "OPT-EMPTY-1", "OPT-SCHED-2", "MODEL-1", "OPT-PURE-3", "OPT-RT-5")
    keys = Scenario(layout="fsdp2", mode="bcast", model_keys="nonstrict", reshard_to="single")
    assert clauses_of(keys) == ("MODEL-3", "MODEL-2", "MODEL-1", "OPT-PURE-2", "OPT-RT-1", "OPT-RESHARD-3")
    with pytest.raises(ValueError, match="model_keys are checked"):
        Scenario(layout="pp2", mode="bcast", model_keys="strict").validate()
    case = scenario_case(busy, "OPT-RT-5")
    assert case.id == f"OPT-RT-5[explore-{busy.digest}]" and str(case.mode) == "bcast" and case.world_sizes == (2,)


def test_groups_in_another_order():
    from conformance.world.groups import GroupSpec, reordered

    groups = [{"params": ["a", "b"]}, {"params": []}, {"params": ["c"]}, {"params": ["d", "e"], "lr": 2}]
    assert reordered(groups) == [
        {"params": ["e", "d"], "lr": 2},
        {"params": []},
        {"params": ["c"]},
        {"params": ["b", "a"]},
    ]
    assert reordered(reordered(groups)) == groups
    # Only the target's order differs: the OPT-KEYS-1 check, which loads, last before resharding.
    s = Scenario(layout="fsdp2", mode="dcp", group_order="reversed-target", reshard_to="fsdp4")
    assert clauses_of(s)[-2:] == ("OPT-KEYS-1", "OPT-RESHARD-1")
    keys = scenario_case(s, "OPT-KEYS-1")
    assert keys.needs.load == "dcp"  # OPT-KEYS-1's matrix cases only get; this one loads
    how = keys.phases[0].params["how"]
    assert dict(how.options)["groups"].target_reverse and not dict(s.recipe().options)["groups"].target_reverse
    assert Scenario(group_order="reversed").groups() == GroupSpec(reverse=True)
    assert clauses_of(Scenario(group_order="reversed")) == clauses_of(Scenario())
    with pytest.raises(ValueError, match="group_order"):
        Scenario(group_order="shuffled").validate()
    # A field added later is left out at its default: saved scenarios keep their tokens and IDs.
    assert "group_order" not in Scenario().to_dict() and Scenario.from_token(s.token) == s


def _replayed(pools, impl: str, s: Scenario):
    """A scenario's verdict as ``explore --replay`` gives it, on the module's rank pools, in this process."""
    from conformance.exploring.engine import ScenarioRunner

    with runner_on(pools, impl) as runner:
        return ScenarioRunner(runner).run(s)


def _statuses(verdict) -> dict:
    return {r.case.clause: r.status.value for r in verdict.results}


def test_a_load_that_pairs_groups_by_position_fails_keys_1_only(pools):
    s = Scenario(group_order="reversed-target")
    v = _replayed(pools, "tools.perverse.faulty:groups_by_position", s)
    assert (v.status.value, v.clause) == ("failed", "OPT-KEYS-1"), v.message
    assert "groups in reverse order" in v.message, v.message
    assert _statuses(v).get("OPT-RT-1") == "passed", _statuses(v)
    v = _replayed(pools, "hyperdsd", s)
    assert v.status.value == "passed" and _statuses(v).get("OPT-KEYS-1") == "passed", v.message


def test_a_load_that_skips_parameters_frozen_after_training_fails_part_3_only(pools):
    s = Scenario(freeze_after=True, warm=2, before=2)
    assert "OPT-PART-3" in clauses_of(s) and "freeze_after" not in Scenario().to_dict()
    assert Scenario.from_token(s.token) == s
    for bad in (Scenario(freeze_after=True, before=0), Scenario(freeze_after=True, layout="pp2")):
        with pytest.raises(ValueError, match="freeze_after"):
            bad.validate()
    v = _replayed(pools, "tools.perverse.faulty:frozen_keep_their_own_state", s)
    assert (v.status.value, v.clause) == ("failed", "OPT-PART-3"), v.message
    assert "frozen after training" in v.message, v.message


def test_messages_of_one_kind_share_a_signature():
    a = "rank 1 raised CheckFailure: full: x:\n  state['a.b']['step']: values differ (bitwise): max abs error 1e-3"
    b = "rank 0 raised CheckFailure: full: x:\n  params['c']: values differ (bitwise): max abs error 2 at (3, 4)"
    assert normalise(a) == normalise(b)
    assert normalise(a) != normalise(a.replace("full:", "sharded:"))


def test_budgets_parse():
    assert parse_budget("90") == 90 and parse_budget("2m") == 120 and parse_budget("1h") == 3600
    with pytest.raises(ValueError, match="budget"):
        parse_budget("ten minutes")


def test_a_found_file_that_does_not_load_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"clause": "MODEL-3", "scenario": Scenario().to_dict()}))
    with pytest.raises(ValueError, match=f"{bad}.*not one the scenario exercises"):
        load_found(str(bad))


@pytest.fixture(scope="module")
def explored(tmp_path_factory):
    """One bounded exploration against the planted bug, its JSON report and found cases."""
    folder = tmp_path_factory.mktemp("explore")
    report = folder / "explore.json"
    found = folder / "found"
    args = ["explore", "--impl", PLANTED, "--world-sizes", "1", "--budget", f"{BUDGET_S}s", "--seed", "3"]
    args += ["--rounds", "1", "--json", str(report), "--save-found", str(found)]
    proc, _ = run_cli(args, timeout=3 * BUDGET_S)
    assert report.exists(), proc.stdout + proc.stderr
    return proc, json.loads(report.read_text())["explore"], found


def _planted(findings):
    """The findings of the planted bug (state values halved where the model has routers)."""
    return [
        f
        for f in findings
        if f["scenario"]["router"] and f["clause"] in ("OPT-RT-1", "OPT-RT-5") and "values differ" in f["message"]
    ]


def test_exploration_finds_the_planted_bug_and_shrinks_it(explored):
    proc, section, _ = explored
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert section["ran"] > 0 and section["seed"] == 3 and section["budget_s"] == BUDGET_S
    planted = _planted(section["findings"])
    assert planted, json.dumps(section["findings"], indent=1)[:3000]
    s = planted[0]["scenario"]
    # Shrunk: only the feature the bug needs, and the smallest of everything else.
    base = Scenario()
    assert s["layout"] == "single" and s["n_layers"] == 1 and s["dim"] == 1 and s["hidden"] == 1
    assert not any(s[f] for f in ("tie", "lazy", "frozen", "adapter", "scheduler", "custom_fields", "one_group"))
    assert s["empty_at"] == [] and s["extra_state"] == "" and s["dtype"] == base.dtype
    assert planted[0]["token"] in proc.stdout and "--replay" in proc.stdout


def test_replay_gives_the_same_verdict_and_message(explored, tmp_path):
    _, section, _ = explored
    finding = _planted(section["findings"])[0]
    out = tmp_path / "replay.json"
    # The finding's repro names the clause it was filed under: exactly that check runs again.
    assert finding["repro"].endswith(f"--replay {finding['token']} --clause {finding['clause']}")
    args = ["--replay", finding["token"], "--clause", finding["clause"], "--json", str(out)]
    proc, _ = run_cli(["explore", "--impl", PLANTED, *args], timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    replayed = json.loads(out.read_text())["explore"]
    assert replayed["verdict"] == finding["status"]
    (again,) = replayed["findings"]
    assert (again["clause"], again["message"]) == (finding["clause"], finding["message"])


def test_found_scenarios_load_as_cases(explored):
    _, section, found = explored
    finding = _planted(section["findings"])[0]
    files = sorted(os.listdir(found))
    assert len(files) == len(section["findings"])
    os.environ["CONFORMANCE_FOUND"] = str(found)
    try:
        ids = {c.id for c in found_cases()}
    finally:
        del os.environ["CONFORMANCE_FOUND"]
    digest = Scenario.from_dict(finding["scenario"]).digest
    case_id = f"{finding['clause']}[found-{digest}]"
    assert case_id in ids
    env = {"CONFORMANCE_FOUND": str(found)}
    proc, _ = run_cli(["--impl", PLANTED, "-k", case_id, "--json", str(found / "run.json.out")], env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (result,) = json.loads((found / "run.json.out").read_text())["cases"]
    assert result["id"] == case_id and result["status"] == "failed"
    assert result["message"] == finding["message"]


def _pytest(tmp_path, *args, timeout):
    import subprocess
    import sys

    from helpers import ROOT, TESTS

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:conformance"]
    command += ["-p", "conformance.pytest_plugin", "--pyargs", "conformance", "-k", "test_explore", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]))
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(timeout))


def test_the_plugin_explores_only_when_asked(tmp_path):
    proc = _pytest(tmp_path, "--dsd-impl", PLANTED, timeout=300)
    assert "deselected" in proc.stdout and "passed" not in proc.stdout and "skipped" not in proc.stdout, proc.stdout
    # One round: it ends once the planted bug is found and shrunk; the budget only bounds a slow machine.
    args = ["--dsd-impl", PLANTED, "--dsd-explore", f"{scaled(300)}s", "--dsd-explore-rounds", "1"]
    args += ["--dsd-explore-world-sizes", "1", "--dsd-explore-seed", "3"]
    proc = _pytest(tmp_path, *args, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 failed" in proc.stdout and "deviations;" in proc.stdout and "--replay s1." in proc.stdout


def test_the_certificate_shows_an_exploration(explored, tmp_path):
    _, section, _ = explored
    report = tmp_path / "explore.json"
    report.write_text(json.dumps({"explore": section}))
    case = "OPT-KEYS-1[single-adamw-sharded]"
    args = ["--impl", "hyperdsd", "-k", case, "--report", str(tmp_path / "cert"), "--explore-report", str(report)]
    proc, _ = run_cli(args, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (tmp_path / "cert" / "report.md").read_text()
    assert "## Explored scenarios" in text and f"{section['ran']} generated scenarios" in text
    assert _planted(section["findings"])[0]["token"] in text
    assert json.loads((tmp_path / "cert" / "report.json").read_text())["explore"] == section


def test_a_certificate_refuses_what_is_not_an_explorations_report(tmp_path, capsys):
    from conformance.cli import main

    case = "OPT-KEYS-1[single-adamw-sharded]"
    assert main(["-k", case, "--report", str(tmp_path / "c2"), "--explore-report", os.devnull]) == 2
    assert "not an exploration's JSON report" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--budget", "soon"], "expected a budget"),
        (["--replay", "s1.xyz"], "does not decode"),
        (["--impl", "no_such_module_here"], "cannot import"),
        (["--clause", "OPT-RT-1"], "--clause goes with --replay"),
        (["--replay", Scenario().token, "--clause", "OPT-EMPTY-1"], "not a clause the scenario exercises"),
    ],
)
def test_explore_usage_errors(args, needle, capsys, monkeypatch):
    # In process: each is found before any rank starts (a started pool would show as processes left).
    from conformance.cli import main
    from hyperdsd.testing import PoolSet

    monkeypatch.setattr(PoolSet, "__init__", lambda *a, **k: pytest.fail("a usage error started rank pools"))
    assert main(["explore", *args]) == 2
    assert needle in capsys.readouterr().err


def test_sigterm_ends_an_exploration_with_a_report_and_no_rank_left(tmp_path):
    import signal
    import subprocess
    import sys
    import uuid

    from helpers import ROOT, TESTS, kill_marked, marked_processes, wait_for

    mark = uuid.uuid4().hex
    out, report = tmp_path / "out.txt", tmp_path / "explore.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, ROOT]), HYPERDSD_TEST_MARK=mark)
    # One world size: its pool starts with the first scenario, so the signal finds warm ranks.
    command = [sys.executable, "-u", "-m", "conformance", "explore", "--impl", PLANTED, "--world-sizes", "1"]
    command += ["--budget", "10m", "--json", str(report)]
    with open(out, "w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        # A few scenarios ran (a mark each, on the line after the one that starts the run).
        ran = lambda: sum(out.read_text().partition("modes\n")[2].count(m) for m in ".FEs") >= 3  # noqa: E731
        assert wait_for(ran, scaled(120)), out.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(60)) == 1, out.read_text()
        assert wait_for(lambda: not marked_processes(mark), scaled(30)), marked_processes(mark)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_marked(mark)
    section = json.loads(report.read_text())["explore"]
    assert section["complete"] is False and section["ran"] >= 1
    assert "exploration interrupted" in out.read_text()


class _ScriptedRunner:
    """A Runner stand-in: each clause's check fails with a set message, or passes; calls are counted."""

    impl = "scripted"

    def __init__(self, failures: dict[str, str]):
        self.failures, self.calls = failures, []

    def run_case(self, case):
        from conformance.running.results import CaseResult, Status

        self.calls.append(case.clause)
        message = self.failures.get(case.clause, "")
        return CaseResult(case, Status.FAILED if message else Status.PASSED, message=message)


def test_later_rounds_look_past_a_known_deviation_to_the_next_check():
    """A scenario whose first failing check deviates as an earlier finding did still counts for what its
    later checks show; each check runs once, however often hypothesis replays the scenario."""
    from conformance.exploring.engine import ScenarioRunner

    s = Scenario(empty_at=(0,), scheduler=True)
    assert clauses_of(s)[:2] == ("OPT-EMPTY-1", "OPT-SCHED-2")
    scripted = _ScriptedRunner({"OPT-EMPTY-1": "rank 0 raised IndexError", "OPT-SCHED-2": "initial_lr dropped"})
    sr = ScenarioRunner(scripted)
    first = sr.run(s)
    assert first.clause == "OPT-EMPTY-1" and scripted.calls == ["OPT-EMPTY-1"]
    sr.known.add(first.signature)
    second = sr.run(s)
    assert second.clause == "OPT-SCHED-2" and scripted.calls == ["OPT-EMPTY-1", "OPT-SCHED-2"]
    sr.known.add(second.signature)
    third = sr.run(s)
    # Every check ran once; every deviation is known, so the verdict's signature is one already found.
    assert scripted.calls == list(clauses_of(s))
    assert third.signature in sr.known and third.clause == "OPT-EMPTY-1"
    assert sr.run(s).signature == third.signature and scripted.calls == list(clauses_of(s))
    # A replay of one clause runs that check alone.
    alone = _ScriptedRunner(scripted.failures)
    assert ScenarioRunner(alone, only="OPT-SCHED-2").run(s).clause == "OPT-SCHED-2" and alone.calls == ["OPT-SCHED-2"]
