"""Distinct deviations: failing cases grouped by their cause.

One bug in an implementation usually fails many cases (every layout, every
optimizer, every mode it touches). A report that lists hundreds of cases
hides the dozen bugs behind them. Cases whose messages are the same once
case-specific names and numbers are masked (ranks, FQNs and keys, numbers,
mode prefixes) share a cause; each group keeps its clauses, its cases, one
representative message and one repro command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hyperdsd.testing import Status

from ..adapters import MODES
from ..running.results import CaseResult

_RULES = [
    (re.compile(r"\branks? [\d,]+"), "rank(s) *"),
    (re.compile(r"^phase \d+/\d+ on \d+ ranks: "), ""),
    # A file or directory of the case's own (a checkpoint's path in the message).
    (re.compile(r"(?<![\w.])(?:/[\w.+-]+){2,}/?"), "<path>"),
    (re.compile(r"'[^']*'|\"[^\"]*\""), "'…'"),
    (re.compile(r"\b(?:%s|flat_dcp)\b:" % "|".join(MODES)), "<mode>:"),
    (re.compile(r"\[[^\[\]]*\]"), "[…]"),
    (re.compile(r"\b0x[0-9a-f]+\b"), "N"),
    (re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"), "N"),
    (re.compile(r"\(N(?:, ?N)*,?\)"), "(N…)"),
    (re.compile(r"\s+"), " "),
]


def mask(line: str) -> str:
    for pattern, replacement in _RULES:
        line = pattern.sub(replacement, line)
    return line.strip()


def _excerpt_tail(line: str) -> str:
    """Of a shortened message (``head ... tail``), the tail only when it is
    an exception's own line: a tail cut from a traceback (a source line, a
    file path) differs between torch builds for the same cause."""
    head, sep, tail = line.partition(" ... ")
    if not sep:
        return line
    found = re.search(r"\b\w+(?:Error|Exception): .*$", tail)
    return f"{head} ... {found.group(0)}" if found else f"{head} ..."


def signature(message: str) -> str:
    """The cause a message names: its first line and, for a check, the kind
    of its first difference, with case-specific names and numbers masked."""
    lines = [line for line in message.splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    sig = mask(_excerpt_tail(lines[0]))
    if len(lines) > 1 and lines[1].startswith((" ", "\t")):
        sig += " | " + mask(lines[1])
    return sig


@dataclass
class Deviation:
    signature: str
    status: Status
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def clauses(self) -> list[str]:
        return sorted({r.case.clause for r in self.cases}, key=_clause_order)

    @property
    def example(self) -> CaseResult:
        return self.cases[0]

    def to_json(self) -> dict:
        return {
            "signature": self.signature,
            "status": self.status.value,
            "clauses": self.clauses,
            "count": len(self.cases),
            "cases": [r.case.id for r in self.cases],
            "message": self.example.message,
            "repro": self.example.repro,
            "xfail_reason": self.example.xfail_reason,
        }


def _clause_order(clause: str) -> tuple:
    head, _, number = clause.rpartition("-")
    return (head, int(number) if number.isdigit() else 0)


def group(results: list[CaseResult], statuses=(Status.FAILED, Status.ERROR, Status.XFAIL)) -> list[Deviation]:
    """Deviations among ``results`` of the given statuses, largest first.

    Expected failures group by the cause their expected-failures entry
    names (a traced cause can show several messages: a missing stage fails
    one clause with a difference and another with a KeyError); everything
    else by the signature of its message.
    """
    found: dict[tuple, Deviation] = {}
    for r in results:
        if r.status not in statuses:
            continue
        traced = r.status == Status.XFAIL and r.xfail_reason
        key = (r.status, f"known: {r.xfail_reason}" if traced else signature(r.message))
        found.setdefault(key, Deviation(key[1], r.status)).cases.append(r)
    return sorted(found.values(), key=lambda d: (d.status != Status.ERROR, -len(d.cases), d.signature))


def render(deviations: list[Deviation], limit_lines: int = 4) -> list[str]:
    """Console lines: one block per deviation."""
    out = []
    for i, d in enumerate(deviations, 1):
        label = {Status.FAILED: "FAIL", Status.ERROR: "ERROR", Status.XFAIL: "XFAIL"}.get(d.status, d.status.value)
        out.append(f"  D{i} {label} in {len(d.cases)} case(s) of {', '.join(d.clauses)}")
        shown = d.example.message.splitlines()[:limit_lines]
        out += [f"       {line}" for line in shown]
        if d.example.xfail_reason:
            out.append(f"       known: {d.example.xfail_reason}")
        out.append(f"       repro: {d.example.repro}")
    return out
