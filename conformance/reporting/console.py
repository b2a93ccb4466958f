"""What ``python -m conformance`` prints while it runs and when it ends.

The conventions of pytest and cargo test: without ``-v``, progress (on a
terminal one line that updates itself, with counts and an estimate of the
time left; in a log at most one line per 5% of the run), one line per case
that failed or errored as it happens, then a summary that fits 100 columns:
clauses by layout family, the layouts where each clause failed, the counts,
and each distinct deviation once with its repro. ``-v`` prints a line per
case and every failure in full, as before. The complete clause by layout
grid is in ``report.md`` and ``report.html``.
"""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import time
from collections import Counter, defaultdict

from hyperdsd.testing import Status

from ..running.results import STATUSES, CaseResult
from ..world.layouts import FAMILIES
from . import deviations
from .reports import RunInfo, coverage, declaration_line, fault_counts, summary_counts, time_by_section

__all__ = ["ConsoleReporter", "family_table"]

LABEL = {
    Status.PASSED: "PASS",
    Status.FAILED: "FAIL",
    Status.XFAIL: "XFAIL",
    Status.XPASS: "XPASS",
    Status.NOT_APPLICABLE: "N/A",
    Status.ERROR: "ERROR",
}
WIDTH = 100  # what the summary's text wraps at
MAX_LINE = 120  # no line longer (a repro command excepted: it must stay whole to be copied)
_LOG_STEP = 5  # percent of the run between progress lines in a log
# A failed check says "rank 0 raised conformance.judging.oracle.CheckFailure: ...": one line has room for "rank 0: ...".
_CHECK = re.compile(r" raised (?:[\w.]+\.)?CheckFailure: ")


def _cut(line: str, width: int = MAX_LINE) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def _wrap(text: str, indent: str = "", width: int = WIDTH) -> list[str]:
    return textwrap.wrap(text, width, subsequent_indent=indent + "  ", break_on_hyphens=False) or [""]


def _wrap_items(head: str, items: list[str], width: int = WIDTH) -> list[str]:
    """``head`` then ``items`` joined by commas, lines broken between items only."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(line) + 1 + len(piece) > width and line.strip():
            lines.append(line)
            line = "  " + piece
        else:
            line = f"{line} {piece}" if line else piece
    return lines + [line]


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ConsoleReporter:
    """Progress while cases run, failures as they happen, then the summary."""

    def __init__(self, total: int, stream=None, verbose: bool = False, tty: bool | None = None):
        self.total = total
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.tty = self.stream.isatty() if tty is None else tty
        self.done = 0
        self.counts: Counter = Counter()
        self._started = time.monotonic()
        self._logged_step = 0  # the last multiple of _LOG_STEP percent a progress line was printed at
        self._live = False  # a progress line is on the terminal's last line

    def write(self, text: str = "") -> None:
        if self._live:
            self.stream.write("\r\x1b[K")
            self._live = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, info: RunInfo) -> None:
        h = info.header()
        self._started = time.monotonic()
        self.write(
            f"conformance {h['suite_version']} (spec {h['spec_version']}) "
            f"| impl {h['impl']['name']} {h['impl']['version']} | torch {h['torch_version']}"
        )
        sizes = ",".join(map(str, h["world_sizes"]))
        declared = declaration_line(h["declaration"])
        for line in _wrap(f"{self.total} cases | world sizes {sizes} | declared: {declared}", width=MAX_LINE):
            self.write(line)

    def case_done(self, result: CaseResult) -> None:
        self.done += 1
        self.counts[result.status] += 1
        if self.verbose:
            self._verbose_line(result)
            return
        if result.status.unexpected or result.status == Status.XPASS:
            self.write(self.failure_line(result))
        self._progress(result)

    def _verbose_line(self, result: CaseResult) -> None:
        width = len(str(self.total))
        line = (
            f"[{self.done:>{width}}/{self.total}] {LABEL[result.status]:<5} {result.case.id} "
            f"({result.duration_s:.2f} s) | {self._running()}"
        )
        self.write(line)
        if result.status.unexpected:
            self.write(self.failure_text(result, details=True))
        elif result.status == Status.XPASS:
            self.write(f"    unexpectedly passed; the xfail entry says: {result.xfail_reason}")
        elif result.status == Status.NOT_APPLICABLE:
            self.write(f"    {result.message}")

    def _running(self) -> str:
        return " ".join(f"{s.value} {self.counts[s]}" for s in STATUSES if self.counts[s])

    @staticmethod
    def failure_line(result: CaseResult) -> str:
        """One line for a case that did not pass as expected: verdict, ID, the message's first line."""
        if result.status == Status.XPASS:
            why = f"unexpectedly passed (xfail: {result.xfail_reason})"
        else:
            first = next((line.strip() for line in result.message.splitlines() if line.strip()), "")
            why = _CHECK.sub(": ", first)
        return _cut(f"{LABEL[result.status]:<5} {result.case.id} ({result.duration_s:.1f} s): {why}")

    def _progress(self, result: CaseResult) -> None:
        elapsed = time.monotonic() - self._started
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        percent = 100 * self.done // max(self.total, 1)
        eta = f"~{_clock(left)} left" if self.done < self.total else "done"
        line = f"[{self.done}/{self.total}] {percent}% | {self._running()} | {_clock(elapsed)}, {eta}"
        if self.tty:
            width = shutil.get_terminal_size((MAX_LINE, 24)).columns - 1
            self.stream.write("\r\x1b[K" + _cut(f"{line} | {result.case.id}", min(width, MAX_LINE)))
            self.stream.flush()
            self._live = True
        elif percent // _LOG_STEP > self._logged_step // _LOG_STEP or self.done == self.total:
            self._logged_step = percent
            self.write(line)

    @staticmethod
    def failure_text(result: CaseResult, details: bool = False) -> str:
        lines = [f"    clause {result.case.clause} on {result.case.layout}"]
        lines += ["    " + line for line in result.message.splitlines()]
        if details and result.details:
            lines += ["      " + line for line in result.details.splitlines()]
        lines.append(f"    repro: {result.repro}")
        return "\n".join(lines)

    def finish(self, results: list[CaseResult], elapsed_s: float, warnings: list[str]) -> None:
        self.write("")
        for line in family_table(results):
            self.write(line)
        counts = summary_counts(results)
        self.write("")
        self.write(" | ".join(f"{s}: {n}" for s, n in counts.items()) + f" | {elapsed_s:.1f} s")
        cov = coverage(results)
        head = f"coverage: {len(cov['exercised'])} of {cov['core_clauses']} core clauses exercised"
        for line in _wrap_items(head + ("; not exercised:" if cov["not_exercised"] else ""), cov["not_exercised"]):
            self.write(line)
        sections = time_by_section(results)
        if sections:
            items = [f"{k} {v['seconds']:.0f} s ({v['cases']})" for k, v in sections.items()]
            for line in _wrap_items("time by section:", items):
                self.write(line)
        faults = fault_counts(results)
        if faults:
            for line in _wrap_items("faults:", [f"{n} {k}" for k, n in faults.items()]):
                self.write(line)
        self.deviations(results)
        for w in warnings:
            for line in _wrap(f"warning: {w}"):
                self.write(line)

    def deviations(self, results: list[CaseResult]) -> None:
        """Each distinct deviation among ``results``, once, with its repro;
        also what an interrupted or aborted run prints of the cases it ran."""
        found = deviations.group(results)
        if not found:
            return
        bad = [r for r in results if r.unexpected]
        unexpected = [d for d in found if d.status.unexpected]
        self.write(
            f"\n{len(bad)} case(s) failed or errored: {len(unexpected)} distinct deviation(s)"
            + (f", and {len(found) - len(unexpected)} expected" if len(found) > len(unexpected) else "")
        )
        # Unexpected deviations in full; expected ones (--xfails) a line each: their cause is traced already.
        full = [d for d in found if d.status.unexpected]
        for line in deviations.render(full):
            self.write(line if line.lstrip().startswith("repro:") else _cut(line))
        for i, d in enumerate([d for d in found if not d.status.unexpected], len(full) + 1):
            what = f"known: {d.example.xfail_reason}" if d.example.xfail_reason else d.signature
            self.write(_cut(f"  D{i} {LABEL[d.status]} in {len(d.cases)} case(s) of {', '.join(d.clauses)}; {what}"))


_HEADS = {
    "plain": "plain",
    "ddp": "ddp",
    "fsdp2": "fsdp2",
    "hsdp": "hsdp",
    "pipeline": "pipeline",
    "fsdp1": "fsdp1",
    "meshes": "meshes",
    "policies": "policies",
    "reshard": "reshard",
    "other": "other",
}


def _cell(counter: Counter) -> str:
    """passed/ran; ``!`` something failed or errored, ``x`` expected failures; n/a when nothing ran."""
    if not counter:
        return "."
    ran = sum(counter.values()) - counter[Status.NOT_APPLICABLE]
    if ran == 0:
        return Status.NOT_APPLICABLE.value
    ok = counter[Status.PASSED] + counter[Status.XPASS]
    mark = "!" if counter[Status.FAILED] or counter[Status.ERROR] else ("x" if counter[Status.XFAIL] else "")
    return f"{ok}/{ran}{mark}"


def family_table(results: list[CaseResult]) -> list[str]:
    """Clauses by layout family (at most 100 columns), then, for each clause
    that failed or errored somewhere, the layouts where it did."""
    if not results:
        return ["(no cases ran)"]
    cells: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for r in results:
        cells[r.case.clause][r.case.layout.family][r.status] += 1
    families = [f for f in (*FAMILIES, "other") if any(f in row for row in cells.values())]
    cw = max(len("clause"), *(len(c) for c in cells))
    widths = [max(len(_HEADS[f]), *(len(_cell(row.get(f, Counter()))) for row in cells.values())) for f in families]
    lines = ["clause".ljust(cw) + " " + " ".join(_HEADS[f].rjust(w) for f, w in zip(families, widths))]
    for clause, row in cells.items():
        lines.append(
            clause.ljust(cw) + " " + " ".join(_cell(row.get(f, Counter())).rjust(w) for f, w in zip(families, widths))
        )
    lines += _wrap(
        "cells: passed/ran by layout family; ! failed or errored, x expected failures, . none; "
        "report.md and report.html have every layout"
    )
    lines += _where_not_passed(results)
    return lines


def _where_not_passed(results: list[CaseResult]) -> list[str]:
    bad: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        if r.status.unexpected:
            bad[r.case.clause][r.case.layout.name] += 1
    if not bad:
        return []
    out = ["", "failed or errored, by clause and layout:"]
    for clause, layouts in bad.items():
        text = ", ".join(f"{layout} ({n})" for layout, n in layouts.most_common())
        out += _wrap(f"  {clause}: {text}", indent="  ")
    return out
