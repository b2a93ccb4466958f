"""What ``python -m conformance`` prints (issue 47): a passing default run
fits about two screens of at most 120 columns; a failure is one line as it
happens and one deviation with its repro in the summary; on a terminal the
progress is one line that updates itself; ``-v`` keeps a line per case."""

import io

from conformance.reporting.console import MAX_LINE, ConsoleReporter, family_table
from conformance.reporting.reports import RunInfo
from conformance.running.registry import all_cases
from conformance.running.results import CaseResult
from conformance.world.layouts import FAMILIES
from hyperdsd.testing import Status

FAILED = {
    "OPT-RT-1[fsdp4-adamw-dcp]": "rank 1 raised KeyError in set_optimizer_state_dict: 'layers.0.fc1.weight'",
    "OPT-RT-1[hsdp2x2-adamw-dcp]": "rank 3 raised KeyError in set_optimizer_state_dict: 'layers.1.fc2.bias'",
    "MODEL-2[ddp-file-strict]": "rank 0 raised conformance.judging.oracle.CheckFailure: file: "
    + "the model differs after a strict load, in a message long enough to run past any terminal's width "
    + "several times over, " * 3
    + "\n  params['x']: shape (2,), expected (3,)",
}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(failed: dict[str, str] = {}, *, stream=None, verbose=False) -> tuple[str, list[CaseResult]]:
    cases = all_cases()
    stream = stream if stream is not None else io.StringIO()
    console = ConsoleReporter(len(cases), stream=stream, verbose=verbose)
    console.start(RunInfo("hyperdsd", "0.2.0", "hyperdsd", [1, 2, 3, 4], ["1", "2", "3", "4", "2x2"]))
    results = []
    for case in cases:
        message = failed.get(case.id, "")
        status = Status.FAILED if message else Status.PASSED
        r = CaseResult(case, status, 0.2, message, repro=f"python -m conformance --impl hyperdsd -k '{case.id}'")
        results.append(r)
        console.case_done(r)
    console.finish(results, 456.0, [])
    return stream.getvalue(), results


def test_a_passing_default_run_fits_two_screens_of_120_columns():
    out, results = _run()
    lines = out.splitlines()
    assert max(map(len, lines)) <= MAX_LINE, max(lines, key=len)
    assert len(lines) <= 110, f"{len(lines)} lines"
    progress = [line for line in lines if line.startswith("[")]
    assert 2 <= len(progress) <= 21, progress  # a line per 5% of the run at most, in a log
    assert progress[-1].startswith(f"[{len(results)}/{len(results)}] 100%")
    # Every clause has its row in the summary, and every count adds up.
    clauses = {r.case.clause for r in results}
    rows = {line.split()[0] for line in lines if line.split() and line.split()[0] in clauses}
    assert rows == clauses
    assert f"passed: {len(results)} | failed: 0" in out
    assert "PASS " not in out  # no line per case without -v


def test_failures_print_one_line_as_they_happen_and_each_deviation_once_with_its_repro():
    out, results = _run(FAILED)
    lines = out.splitlines()
    for case_id in FAILED:
        as_it_happens = [line for line in lines if line.startswith(f"FAIL  {case_id} ")]
        assert len(as_it_happens) == 1, case_id
    # The KeyErrors are one deviation (their names masked), the check another; each with its repro, once.
    assert "3 case(s) failed or errored: 2 distinct deviation(s)" in out
    assert sum(line.strip().startswith("repro: ") for line in lines) == 2
    assert "D1 FAIL in 2 case(s) of OPT-RT-1" in out
    # The failing layouts are named under the table.
    assert "failed or errored, by clause and layout:" in out
    assert "  OPT-RT-1: fsdp4 (1), hsdp2x2 (1)" in out and "  MODEL-2: ddp (1)" in out
    # A failed check reads "rank 0: ..." on its one line.
    assert "FAIL  MODEL-2[ddp-file-strict] (0.2 s): rank 0: file: the model differs" in out
    too_long = [line for line in lines if len(line) > MAX_LINE and not line.strip().startswith("repro: ")]
    assert not too_long, too_long


def test_on_a_terminal_progress_is_one_line_that_updates():
    out, results = _run(FAILED, stream=_Terminal())
    lines = out.split("\n")
    # Each update rewrites the line in place; a failure clears it, prints its line, and the progress resumes.
    assert out.count("\r\x1b[K") >= len(results)
    # What stays on the screen: what follows the last clearing on each line.
    printed = [line.rsplit("\r\x1b[K", 1)[-1] for line in lines]
    assert sum(p.startswith("FAIL  ") for p in printed) == 3
    assert not any(p.startswith("[") for p in printed), "a progress line was left on the screen"
    assert "~" in out and "left" in out  # an estimate of the time left


def test_expected_failures_take_a_line_each_and_no_list_of_layouts():
    cases = {c.id: c for c in all_cases()}
    results = [
        CaseResult(c, Status.PASSED, 0.1)
        if cid not in FAILED
        else CaseResult(c, Status.XFAIL, 0.1, FAILED[cid], repro="r", xfail_reason="a traced cause, with its link")
        for cid, c in cases.items()
    ]
    stream = io.StringIO()
    ConsoleReporter(len(results), stream=stream).finish(results, 1.0, [])
    out = stream.getvalue()
    assert "0 case(s) failed or errored: 0 distinct deviation(s), and 1 expected" in out
    assert "  D1 XFAIL in 3 case(s) of MODEL-2, OPT-RT-1; known: a traced cause, with its link" in out
    assert "repro:" not in out and "by clause and layout:" not in out


def test_verbose_prints_a_line_per_case_with_failures_in_full():
    out, results = _run(FAILED, verbose=True)
    assert sum(" PASS  " in line for line in out.splitlines()) == len(results) - len(FAILED)
    assert "    clause OPT-RT-1 on fsdp4" in out and "    repro: python -m conformance" in out


def test_every_layout_of_the_matrix_has_a_family_and_the_table_fits_100_columns():
    results = _run()[1]
    assert {r.case.layout.family for r in results} <= set(FAMILIES)
    assert max(len(line) for line in family_table(results)) <= 100
