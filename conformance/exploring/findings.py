"""What exploration found: a scenario's :class:`Verdict` and the signature
of its deviation, each :class:`Finding` (a shrunk deviation and its
scenario), the :class:`Exploration` report, how each is described and
replayed, and the found-scenario files a finding is saved as."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from hyperdsd.testing import Status

from ..running.generated import found_record, write_found
from ..running.results import CaseResult
from ..world.scenario import Scenario


def replay_command(impl: str, s: Scenario, clause: str | None = None) -> str:
    """The command that runs ``s`` again (``clause``'s check alone, when given), and nothing else."""
    only = f" --clause {clause}" if clause else ""
    return f"python -m conformance explore --impl {shlex.quote(impl)} --replay {s.token}{only}"


def deviated(r: CaseResult) -> bool:
    return r.status in (Status.FAILED, Status.ERROR)


def result_signature(r: CaseResult) -> str:
    """The kind of a check's deviation: its status, clause and message with the particulars left out."""
    return f"{r.status.value} {r.case.clause}: {normalise(r.message)}"


@dataclass
class Verdict:
    """What one scenario came to: the first clause whose check did not pass
    with a deviation not already known (checks run most specific first and
    stop there), else the first that did not pass; and the results of the
    checks that ran."""

    scenario: Scenario
    results: list[CaseResult]
    duration_s: float = 0.0
    known: frozenset[str] = frozenset()  # signatures already found when it was judged

    @property
    def bad(self) -> CaseResult | None:
        bad = [r for r in self.results if deviated(r)]
        return next((r for r in bad if result_signature(r) not in self.known), bad[0] if bad else None)

    @property
    def status(self) -> Status:
        bad = self.bad
        if bad is not None:
            return bad.status
        if self.results and all(r.status == Status.NOT_APPLICABLE for r in self.results):
            return Status.NOT_APPLICABLE
        return Status.PASSED

    @property
    def clause(self) -> str | None:
        return self.bad.case.clause if self.bad else None

    @property
    def message(self) -> str:
        return self.bad.message if self.bad else ""

    @property
    def signature(self) -> str | None:
        """The kind of deviation: its status, clause and message with the
        particulars (numbers, names) left out; None when nothing deviated."""
        bad = self.bad
        return None if bad is None else result_signature(bad)


def normalise(message: str) -> str:
    """A message's gist: its first line and what its first detail says,
    once ranks, numbers, quoted names, where in the state it was and what
    follows a value difference are left out, so that two scenarios
    deviating alike have one signature whatever their sizes and whichever
    entry shows it first (hypothesis shrinks within one signature)."""
    out: list[str] = []
    for line in message.splitlines():
        detail = line[:1].isspace()
        line = re.sub(r"\branks? [\d,]+", "rank N", line)
        line = re.sub(r"'[^']*'", "'.'", line)
        if detail:  # "  state['x']['step']: values differ ..." -> "values differ ..."
            line = re.sub(r"^\s*[\w.]*(\[[^\]]*\])+:\s*", "", line)
        line = re.sub(r"(values differ|received|expected a|dtype|shape) .*", r"\1 ...", line)
        line = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", line).strip()
        line = re.sub(r"N(, ?N)+", "N", line)  # lists of ranks or sizes, whatever their length
        if line and line not in out:
            out.append(line)
        if len(out) == 2:
            break
    return " | ".join(out)[:300]


@dataclass
class Finding:
    verdict: Verdict
    saved_to: str | None = None
    shrunk: bool = True  # False: seen as the run was interrupted, before hypothesis shrank it

    @property
    def scenario(self) -> Scenario:
        return self.verdict.scenario

    def to_json(self, impl: str) -> dict:
        v = self.verdict
        bad = v.bad
        return {
            "clause": v.clause,
            "status": v.status.value,
            "signature": v.signature,
            "message": v.message,
            "ranks": bad.ranks if bad else [],
            "scenario": self.scenario.to_dict(),
            "description": self.scenario.describe(),
            "token": self.scenario.token,
            "repro": replay_command(impl, self.scenario, v.clause),
            "saved_to": self.saved_to,
            "shrunk": self.shrunk,
        }


@dataclass
class Exploration:
    seed: int
    budget_s: float
    world_sizes: list[int]
    ran: int = 0
    rounds: int = 0
    elapsed_s: float = 0.0
    findings: list[Finding] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False

    @property
    def per_minute(self) -> float:
        return 60.0 * self.ran / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def by_clause(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.findings:
            out[f.verdict.clause] = out.get(f.verdict.clause, 0) + 1
        return dict(sorted(out.items()))

    def to_json(self, impl: str) -> dict:
        return {
            "ran": self.ran,
            "rounds": self.rounds,
            "budget_s": self.budget_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "seed": self.seed,
            "world_sizes": self.world_sizes,
            "scenarios_per_minute": round(self.per_minute, 2),
            "statuses": dict(sorted(self.statuses.items())),
            "failures_by_clause": self.by_clause(),
            "complete": not self.interrupted,
            "findings": [f.to_json(impl) for f in self.findings],
        }


def kinds(findings: list[Finding]) -> dict[str, list[Finding]]:
    """Findings grouped by their signature with the mode left out: one
    deviation found in several modes is one line of the summary."""
    out: dict[str, list[Finding]] = {}
    for f in findings:
        key = f.verdict.signature.replace(f" {f.scenario.mode}: ", " ", 1)
        out.setdefault(key, []).append(f)
    return out


def describe_finding(f: Finding, impl: str) -> str:
    v = f.verdict
    bad = v.bad
    ranks = f" on ranks {bad.ranks}" if bad and bad.ranks else ""
    lines = [
        f"{v.status.value.upper()} {v.clause}{ranks}",
        f"  scenario ({'shrunk' if f.shrunk else 'not shrunk: the run was interrupted'}):",
        *("    " + line for line in f.scenario.describe().splitlines()),
        "  what differed:",
        *("    " + line for line in v.message.splitlines()[:12]),
        f"  replay: {replay_command(impl, f.scenario, v.clause)}",
    ]
    if f.saved_to:
        lines.append(f"  saved as case {json.load(open(f.saved_to))['id']} in {f.saved_to}")
    return "\n".join(lines)


def save_finding(directory: str, f: Finding, impl: str) -> str:
    v = f.verdict
    record = found_record(v.clause, f.scenario, impl=impl, status=v.status.value, message=v.message)
    return write_found(directory, record)
