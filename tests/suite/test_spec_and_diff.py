"""The shipped SPEC and the manifest agree; ``python -m conformance diff`` tells regressions."""

import json

from conformance import spec
from conformance.running.registry import all_cases


def test_every_clause_has_cases_and_every_case_a_clause():
    clauses = spec.clauses()
    assert spec.version() == "1.6"
    used = {c.clause for c in all_cases()}
    assert sorted(set(clauses) - used) == [], "clauses without a case"
    assert sorted(used - set(clauses)) == [], "cases of clauses SPEC does not have"


def _report(path, statuses, deviations=()):
    cases = [
        {
            "id": cid,
            "clause": cid.split("[")[0],
            "status": st,
            "message": f"{st} because" if st in ("failed", "error") else "",
        }
        for cid, st in statuses.items()
    ]
    data = {
        "impl": {"name": "demo", "version": "1"},
        "torch_version": "2.13.0",
        "suite_version": "0.2.0",
        "cases": cases,
        "deviations": list(deviations),
    }
    path.write_text(json.dumps(data))
    return str(path)


def _diff(*args, capsys):
    """``python -m conformance diff`` in process (it reads two JSON files): (exit status, stdout, stderr)."""
    from conformance.cli import main

    status = main(["diff", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_diff_lists_changes_by_clause_and_exits_1_on_a_regression(tmp_path, capsys):
    old = _report(
        tmp_path / "old.json",
        {"OPT-RT-1[a]": "passed", "OPT-RT-1[b]": "failed", "OPT-DT-1[a]": "passed", "OPT-DT-1[b]": "passed"},
    )
    new = _report(
        tmp_path / "new.json",
        {"OPT-RT-1[a]": "passed", "OPT-RT-1[b]": "passed", "OPT-DT-1[a]": "error", "OPT-PART-5[a]": "passed"},
        [{"signature": "x", "status": "error", "clauses": ["OPT-DT-1"], "count": 1, "message": "error because"}],
    )
    status, out, err = _diff(old, new, capsys=capsys)
    assert status == 1, out + err
    assert "fixed: OPT-RT-1[b]: failed -> passed" in out
    assert "REGRESSED: OPT-DT-1[a]: passed -> error" in out
    assert "REGRESSED: OPT-DT-1[b]: was passed, not in the new run" in out
    assert "+ 1 new case(s): 1 passed" in out
    assert "+ error in 1 case(s) of OPT-DT-1: error because" in out
    assert out.rstrip().endswith("2 regressed, 1 fixed")
    status, out, _ = _diff(old, old, capsys=capsys)
    assert status == 0 and "every case has the same status" in out
    status, _, err = _diff(old, str(tmp_path / "missing.json"), capsys=capsys)
    assert status == 2 and "cannot read" in err


def test_a_shortened_message_keeps_its_tail_only_when_it_is_an_exception_line():
    from conformance.reporting.deviations import signature

    head = (
        "ranks 0,1 raised CheckFailure: the message does not name ['adapter.bias']: "
        "CheckpointException ranks:dict_keys([0, 1])"
    )
    torch_a = signature(head + " ... local_plan = plan")
    torch_b = signature(
        head + ' ... File "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/state_dict_loader.py", lin'
    )
    assert torch_a == torch_b  # the same cause, cut from two tracebacks
    kept = signature(head + " ... RuntimeError: Missing key in checkpoint state_dict: optim.state.aux.weight.step.")
    assert (
        kept.endswith("RuntimeError: Missing key in checkpoint state_dict: optim.state.aux.weight.step.")
        and kept != torch_a
    )


def test_expected_failures_group_by_their_traced_cause():
    from conformance.reporting.deviations import group
    from conformance.running.registry import all_cases
    from conformance.running.results import CaseResult
    from hyperdsd.testing import Status

    a, b, c = list(all_cases())[:3]
    results = [
        CaseResult(
            a,
            Status.XFAIL,
            message="rank 0 raised KeyError in set_optimizer_state_dict: 'lr'",
            xfail_reason="empty groups lose fields, #1",
        ),
        CaseResult(
            b,
            Status.XFAIL,
            message="rank 1 raised CheckFailure: params['x']: values differ",
            xfail_reason="empty groups lose fields, #1",
        ),
        CaseResult(c, Status.FAILED, message="rank 1 raised CheckFailure: params['x']: values differ"),
    ]
    deviations = group(results)
    assert sorted(len(d.cases) for d in deviations) == [1, 2]
    assert any(d.signature == "known: empty groups lose fields, #1" for d in deviations)
