"""conformance/known/torch-*.txt stay in step with the manifest.

Each file comes from a full run against that torch release (several
minutes, so not repeated here; `python -m tools.releases.trace_known` writes it):
every entry must still match a case and carry a reason, and no entry may
cover a clause torch's implementation passes.
"""

import pathlib

import pytest

from conformance.running.registry import all_cases
from conformance.running.xfails import Xfails

KNOWN = sorted((pathlib.Path(__file__).resolve().parents[2] / "conformance" / "known").glob("torch-*.txt"))
# Clauses torch 2.13 and 2.14 pass in every case: an entry covering one would hide a regression.
# (Not OPT-KEYS-2 nor OPT-RESHARD-1: on FSDP1, compile and activation checkpointing keep wrapper
# prefixes in the keys, and a DCP load into flat parameters fails; OPT-KEYS-3 but on FSDP1's flat
# parameters, where a DCP load of the tied model finds no load path for a rank's lazy state.)
KEYS_3 = tuple(f"OPT-KEYS-3[{layout}-" for layout in ("single", "ddp", "fsdp2", "fsdp4", "hsdp2x2", "fsdp1-2"))
PASSED_BY_TORCH = (
    "OPT-KEYS-1[",
    *KEYS_3,
    "OPT-RT-2[",
    "OPT-DT-1[",
    "OPT-DT-2[",
    "OPT-ATOM-3[",
    "OPT-PART-4[",
    "OPT-MESH-1[",
    "OPT-MPMD-1[",
    "OPT-MPMD-3[",
)


def test_there_is_a_file_per_traced_release():
    """One per minor release of pyproject's range, 2.6 to 2.14 (python -m tools.releases.torch_matrix runs them)."""
    assert {p.name for p in KNOWN} >= {f"torch-2.{minor}.txt" for minor in range(6, 15)}


@pytest.mark.parametrize("path", KNOWN, ids=lambda p: p.name)
def test_every_entry_matches_a_case_and_has_a_reason(path):
    xfails = Xfails.load(str(path))
    assert xfails.entries, "empty file"
    xfails.mark_selected([c.id for c in all_cases()])
    assert [e.pattern for e in xfails.unmatched()] == []
    assert all(len(e.reason) > 20 for e in xfails.entries), [e.pattern for e in xfails.entries if len(e.reason) <= 20]


# Where older releases fail one of those clauses, and the traced cause that shows there: before 2.10 a
# pipeline stage's file load raises on the stage it lacks (OPT-DT-2), and 2.6 also loads the flat
# layout's absent state as a KeyError (OPT-KEYS-3).
FAILED_BEFORE_2_10 = {
    "torch-2.6.txt": ("OPT-DT-2[", *KEYS_3),
    "torch-2.7.txt": ("OPT-DT-2[",),
    "torch-2.8.txt": ("OPT-DT-2[",),
    "torch-2.9.txt": ("OPT-DT-2[",),
}


@pytest.mark.parametrize("path", KNOWN, ids=lambda p: p.name)
def test_no_entry_covers_a_clause_torch_passes(path):
    xfails = Xfails.load(str(path))
    for passing in set(PASSED_BY_TORCH) - set(FAILED_BEFORE_2_10.get(path.name, ())):
        # Found cases are deviations an exploration found in torch: clauses it passes in every fixed case.
        fixed = [c for c in all_cases() if "[found-" not in c.id]
        covered = [c.id for c in fixed if c.id.startswith(passing) and xfails.match(c.id)]
        assert covered == [], covered


def _report(tmp_path, cases):
    import json

    path = tmp_path / "report.json"
    path.write_text(json.dumps({"cases": cases}))
    return str(path)


def _case(case_id, clause, layout, status, message=""):
    return {"id": case_id, "clause": clause, "layout": layout, "status": status, "message": message}


def test_trace_known_writes_a_section_per_cause_and_refuses_an_untraced_failure(tmp_path, monkeypatch, capsys):
    import sys

    from tools.releases import trace_known

    cases = [
        _case("OPT-DT-3[single-adamw-sharded]", "OPT-DT-3", "single", "failed", "rank 0 raised CheckFailure: dtype"),
        _case("OPT-DT-3[single-adamw-full]", "OPT-DT-3", "single", "failed", "rank 0 raised CheckFailure: dtype"),
        _case("OPT-DT-3[fsdp2-adamw-sharded]", "OPT-DT-3", "fsdp2", "passed"),
        _case("OPT-KEYS-1[single-adamw-sharded]", "OPT-KEYS-1", "single", "passed"),
    ]
    monkeypatch.setattr(sys, "argv", ["trace_known", _report(tmp_path, cases), "--torch", "9.9.0"])
    assert trace_known.main() == 0
    out = capsys.readouterr().out
    assert "## state cast to the parameter's dtype (2 cases)" in out
    # The failing cases share a layout no passing case has: one prefix covers both, and nothing else.
    assert "\nOPT-DT-3[single-  # state cast" in out and "OPT-DT-3[fsdp2" not in out

    cases.append(
        _case(
            "OPT-KEYS-1[fsdp2-adamw-sharded]",
            "OPT-KEYS-1",
            "fsdp2",
            "failed",
            "rank 1 raised ValueError: something new",
        )
    )
    monkeypatch.setattr(sys, "argv", ["trace_known", _report(tmp_path, cases), "--torch", "9.9.0"])
    assert trace_known.main() == 1
    assert "OPT-KEYS-1[fsdp2-adamw-sharded]" in capsys.readouterr().err


def test_check_judges_a_known_file_against_a_run(tmp_path):
    """Green means every failure listed, no listed case passing, no error and no entry matching nothing."""
    from tools.releases import trace_known

    known = tmp_path / "torch-9.9.txt"
    known.write_text("OPT-DT-3[single-  # cast\nOPT-GONE[x]  # stale\n")
    cases = [
        _case("OPT-DT-3[single-adamw-sharded]", "OPT-DT-3", "single", "failed"),
        _case("OPT-DT-3[single-adamw-full]", "OPT-DT-3", "single", "passed"),
        _case("OPT-KEYS-1[fsdp2-adamw-sharded]", "OPT-KEYS-1", "fsdp2", "failed"),
        _case("OPT-KEYS-1[single-adamw-sharded]", "OPT-KEYS-1", "single", "error"),
    ]
    result = trace_known.check(cases, str(known))
    assert result["unlisted"] == ["OPT-KEYS-1[fsdp2-adamw-sharded]"]
    assert result["xpass"] == ["OPT-DT-3[single-adamw-full]"]
    assert result["error"] == ["OPT-KEYS-1[single-adamw-sharded]"]
    assert result["stale"] == ["OPT-GONE[x]"]
    assert trace_known.known_file("2.13.0").endswith("conformance/known/torch-2.13.txt")


def _finding(clause, message, **scenario):
    base = {"layout": "single", "mode": "sharded", "optimizer": "adamw", "dtype": "float32", "before": 1}
    return {"clause": clause, "message": message, "scenario": {**base, **scenario}, "description": "scenario"}


@pytest.mark.parametrize(
    "finding, cause",
    [
        (
            _finding("OPT-RT-1", "AssertionError: Expected device to be set", optimizer="sgd_plain"),
            "plain SGD in full modes",
        ),
        (_finding("OPT-PURE-1", "get (sharded) changed the optimizer", before=0), "fake step in get"),
        (_finding("MODEL-1", "model keys differ", layout="pp2", mode="full_cpu"), "pipeline stages under full_cpu"),
        (
            _finding(
                "OPT-RT-1", "flat: the run differs:\n  state['aux.weight']: present, expected absent", mode="flat"
            ),
            "flat layout and absent state",
        ),
        (_finding("OPT-EMPTY-1", "IndexError: list index out of range", empty_at=[0]), "empty param groups"),
        (_finding("OPT-RT-1", "sharded: the resumed run differs", frozen=True), "frozen parameters' state dropped"),
        (
            _finding(
                "OPT-KEYS-1",
                "ValueError in set_optimizer_state_dict: loaded state dict contains a parameter group that doesn't "
                "match the size of optimizer's group",
                optimizer="sgd_plain",
                group_order="reversed-target",
            ),
            "groups paired by position without state",
        ),
        (
            _finding(
                "OPT-RT-5", "its own state remains:\n  state['a']['kind']: '<generator object ...>'", optimizer="custom"
            ),
            "nested state values",
        ),
        (_finding("OPT-RT-1", "sharded: the resumed run differs"), None),
    ],
)
def test_an_explored_deviation_is_traced_from_its_message_and_features(finding, cause):
    """A generated scenario is filed under the first clause whose check fails; its cause comes from what
    its shrunk scenario still holds. One no rule explains stays untraced (None), to be traced by hand."""
    from tools.releases import trace_known

    assert trace_known.explore_cause(finding) == cause
    if cause is not None:
        assert cause in {c.title for c in trace_known.CAUSES}


def test_an_exploration_keeps_one_found_case_per_cause_the_simplest(tmp_path, capsys):
    import json

    from conformance.running.generated import load_found
    from conformance.world.scenario import Scenario
    from tools.releases import trace_known

    def finding(**features):
        s = Scenario(**features)
        return {
            "clause": "OPT-RT-1",
            "status": "failed",
            "message": "rank 0 raised AssertionError in set_optimizer_state_dict: Expected device to be set",
            "scenario": s.to_dict(),
            "token": s.token,
            "description": s.describe(),
        }

    simple, busy = finding(optimizer="sgd_plain", mode="full"), finding(optimizer="sgd_plain", mode="full", tie=True)
    report = tmp_path / "explore.json"
    report.write_text(json.dumps({"impl": {"spec": "torch"}, "explore": {"findings": [busy, simple], "ran": 2}}))
    assert trace_known.explore_table(str(report), str(tmp_path / "found")) == 0
    assert "causes found: 1 of" in capsys.readouterr().out
    (path,) = (tmp_path / "found").iterdir()
    assert load_found(str(path)).id == f"OPT-RT-1[found-{Scenario.from_dict(simple['scenario']).digest}]"


def test_merge_adds_a_later_runs_failures_under_their_causes(tmp_path):
    """A run of cases added since a release's file was written (its full run's report gone): each
    failure goes under its cause, by prefixes that cover no other case of the manifest, with the
    counts in the headings and the header; merging the same run again adds nothing; an untraced
    failure stops it and nothing is written."""
    from tools.releases import trace_known

    known = tmp_path / "torch-9.9.txt"
    known.write_text(
        "# Expected failures of torch.distributed.checkpoint.state_dict (torch 9.9.0) on this suite,\n"
        "# from a full run (python -m conformance --impl torch --json ...): 1 failing cases, 1 causes.\n"
        "\n## state cast to the parameter's dtype (1 cases)\nOPT-DT-3[fsdp2-  # state cast: old\n"
    )
    manifest = ["OPT-DT-3[single-adamw-sharded]", "OPT-DT-3[single-adamw-full]", "OPT-DT-3[ddp-adamw-sharded]"]
    cases = [
        _case(manifest[0], "OPT-DT-3", "single", "failed", "rank 0 raised CheckFailure: dtype"),
        _case(manifest[1], "OPT-DT-3", "single", "failed", "rank 0 raised CheckFailure: dtype"),
    ]
    assert trace_known.merge(cases, str(known), manifest) == []
    text = known.read_text()
    assert "and 1 run(s) of cases added since: 3 failing cases, 1 causes." in text
    assert (
        "## state cast to the parameter's dtype (3 cases)\nOPT-DT-3[fsdp2-  # state cast: old\nOPT-DT-3[single-" in text
    )
    assert trace_known.check(cases, str(known))["unlisted"] == []
    assert trace_known.merge(cases, str(known), manifest) == [] and known.read_text() == text

    strange = [
        _case("OPT-KEYS-1[fsdp2-adamw-sharded]", "OPT-KEYS-1", "fsdp2", "failed", "rank 1 raised ValueError: new")
    ]
    assert trace_known.merge(strange, str(known), manifest) and known.read_text() == text
