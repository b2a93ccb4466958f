"""Write an expected-failures file from a run against torch's implementation,
one section per traced cause.

Every failing case of the report must be explained by exactly one cause of
``tools/releases/causes.json`` (the first that matches it); a case no cause explains stops the
tool, so a new deviation is traced by hand before it can be listed. Within a
cause, cases are written as the shortest ID prefixes that cover them and no
case that passes or has another cause.

    python -m tools.releases.trace_known report.json --torch 2.13.0 > conformance/known/torch-2.13.txt
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable

from conformance.adapters import MODES
from conformance.reporting.deviations import signature
from conformance.running.results import Status

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PIPELINE = ("pp2", "pp2xfsdp2")


def _mode(case: dict) -> str:
    """The mode a case's ID names after its layout (whose own name may hold a
    mode's word: ``fsdp1-4-flat``, FSDP1's flat parameters)."""
    body = case["id"].split("[", 1)[1].rstrip("]")
    layout = case.get("layout") or ""
    body = body[len(layout) + 1 :] if layout and body.startswith(layout + "-") else body
    return next((p for p in body.split("-") if p in MODES), "")


# What a missing stage looks like to the clauses that see it.
_STAGE_MISSING = (
    "differs from the uninterrupted",
    "absent on rank",
    "does not hold the full state",
    "Missing key(s) in state_dict",
    "symmetric difference",
    "does not reproduce the source",
    "after resharding",
    "with every feature at once",
    # 2.11: Adagrad's `sum` (made in its constructor) is gone from the stage that loaded nothing.
    "KeyError in training after set_optimizer_state_dict",
    # 2.7's code (verl's copy): the stage's parameters have no state in the checkpoint, a bare KeyError.
    "KeyError in set_optimizer_state_dict",
)

_KEY_ERROR = re.compile(r"raised KeyError in set_optimizer_state_dict: '([^']+)'")


def _set_key_error(case) -> str:
    """The key a KeyError raised by set_optimizer_state_dict names ('' when there is none). Before the
    strict check of later releases (torch 2.7's code), a parameter without state in the checkpoint is a
    bare KeyError naming its FQN; under the flat layout the key is ``state.FQN.NAME``."""
    m = _KEY_ERROR.search(case["message"] or "")
    return m.group(1) if m else ""


def _missing_param_state(case) -> bool:
    key = _set_key_error(case)
    return bool(key) and not key.startswith(("state.", "param_groups."))


def _pp_stage_only(case, sig) -> bool:
    pp = any(side in PIPELINE for side in case["layout"].split("_to_"))
    return (
        pp
        and _mode(case) in ("full_cpu", "bcast", "file")
        and any(p in sig for p in _STAGE_MISSING)
        and not case["clause"].startswith(("OPT-ATOM", "OPT-EMPTY", "OPT-SCHED-1", "OPT-SCHED-3", "MODEL-2"))
    )


def _fsdp1(case) -> bool:
    """Whether a side of the case is an FSDP1 layout (SPEC §2, 1.3)."""
    return any(side.startswith(("fsdp1-", "hsdp1-")) for side in case["layout"].split("_to_"))


# The causes, as data (tools/releases/causes.json): each a title, the reason an
# expected-failures entry gives, and ``when``: alternatives (any), each a set
# of conditions on a failing case that must all hold.
CAUSES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "causes.json")

# The conditions a cause's alternative may name, on (case, signature): the
# signature is the case's message as reports group it (first line, masked).
_LISTS = {
    "clause": lambda c, s, xs: c["clause"] in xs,
    "not_clause": lambda c, s, xs: c["clause"] not in xs,
    "layout": lambda c, s, xs: c["layout"] in xs,
    "mode": lambda c, s, xs: _mode(c) in xs,
    "id_has": lambda c, s, xs: any(x in c["id"] for x in xs),
    "id_ends": lambda c, s, xs: c["id"].endswith(tuple(xs)),
    "sig_has": lambda c, s, xs: any(x in s for x in xs),
    "sig_has_all": lambda c, s, xs: all(x in s for x in xs),
    "message_has": lambda c, s, xs: any(x in (c["message"] or "") for x in xs),
}
_FLAGS = {
    "fsdp1": lambda c: _fsdp1(c),
    "pipeline": lambda c: c["layout"] in PIPELINE,
}
_TESTS = {
    "pipeline_stage_missing": lambda c, s: _pp_stage_only(c, s),
    "set_key_error_names_a_parameter": lambda c, s: _missing_param_state(c),
    "set_key_error_names_flat_state": lambda c, s: _set_key_error(c).startswith("state."),
}


@dataclass(frozen=True)
class Cause:
    title: str
    reason: str
    when: tuple[dict, ...]

    def matches(self, case: dict, sig: str) -> bool:
        return any(_holds(alternative, case, sig) for alternative in self.when)


def _holds(conditions: dict, case: dict, sig: str) -> bool:
    for name, value in conditions.items():
        if name in _LISTS:
            ok = _LISTS[name](case, sig, value)
        elif name in _FLAGS:
            ok = _FLAGS[name](case) == value
        elif name == "test":
            ok = _TESTS[value](case, sig)
        else:
            raise ValueError(f"{CAUSES_FILE}: unknown condition {name!r}")
        if not ok:
            return False
    return True


def load_causes(path: str = CAUSES_FILE) -> tuple[Cause, ...]:
    """The causes of ``path``, each condition checked to be one the tracer knows."""
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    causes = tuple(Cause(r["title"], r["reason"], tuple(r["when"])) for r in records)
    known = set(_LISTS) | set(_FLAGS) | {"test"}
    for cause in causes:
        for alternative in cause.when:
            unknown = set(alternative) - known
            if unknown or ("test" in alternative and alternative["test"] not in _TESTS):
                raise ValueError(f"{path}: cause {cause.title!r} names unknown conditions {sorted(unknown)}")
    return causes


CAUSES = load_causes()
_UNSHARDED_LOAD = next(c for c in CAUSES if c.title == "full loads into unsharded modules").when[0]["message_has"]


# A generated scenario (python -m conformance explore) is attributed to the
# first clause whose check fails, which need not be the clause the matrix
# files the same cause under; its shrunk scenario keeps only the features
# the deviation needs. So its cause is read from the message and those
# features: (title, test(finding, scenario, message)), first match wins.
_FULL_FILES = ("full_cpu", "bcast", "file")
EXPLORE_RULES: tuple[tuple[str, Callable[[dict, dict, str], bool]], ...] = (
    ("get reshards what a forward left unsharded", lambda f, s, m: "changed the modules' sharding state" in m),
    (
        "full loads into unsharded modules",
        lambda f, s, m: any(w in m for w in _UNSHARDED_LOAD),
    ),
    (
        "plain SGD in full modes",
        lambda f, s, m: (
            "Expected device to be set" in m
            or (s.get("optimizer") == "sgd_plain" and "AssertionError in set_optimizer_state_dict" in m)
        ),
    ),
    (
        "flat layout and absent state",
        lambda f, s, m: (
            "float() argument must be a string or a real number" in m or _set_key_error(f).startswith("state.")
        ),
    ),
    (
        "groups paired by position without state",
        lambda f, s, m: f["clause"] == "OPT-KEYS-1" and "match the size of optimizer's group" in m,
    ),
    ("no DCP load path for lazy state", lambda f, s, m: "Missing key in checkpoint state_dict" in m),
    ("lazy state rejected", lambda f, s, m: "Missing optimizer state for parameter" in m or _missing_param_state(f)),
    ("extra state objects in full modes", lambda f, s, m: "Unexpected value type" in m),
    # A checkpoint before the first step: what follows is the fake step's doing (state where none was).
    ("fake step in get", lambda f, s, m: s.get("before") == 0),
    # SGD's flat load: the empty dict rebuilt for a parameter without state loads as state.
    ("flat layout and absent state", lambda f, s, m: s["mode"] == "flat" and "present, expected absent" in m),
    (
        "empty param groups",
        lambda f, s, m: (
            s.get("empty_at")
            and (
                "zero parameters" in m
                or "IndexError" in m
                or "param groups without parameters" in m
                # behind OPT-EMPTY-1's check, in the round trips: a group kept the target's fields or lost them
                or re.search(r"group(s\[\d+\]| of \[\])\['\w+'\]: ", m) is not None
                or "KeyError in training" in m
            )
        ),
    ),
    ("broadcast loads send whole tensors", lambda f, s, m: f["clause"] == "MODEL-3" and "received" in m),
    ("get aliases the optimizer", lambda f, s, m: f["clause"] == "OPT-PURE-2" and "changed the optim" in m),
    (
        "pipeline stages under full_cpu",
        lambda f, s, m: (
            any(side in PIPELINE for side in (s["layout"], s.get("reshard_to") or "")) and s["mode"] in _FULL_FILES
        ),
    ),
    ("model keys not reported", lambda f, s, m: f["clause"] == "MODEL-2"),
    ("frozen parameters' state dropped", lambda f, s, m: s.get("frozen") and "differs" in m),
    (
        "nested state values",
        lambda f, s, m: (
            s.get("optimizer") == "custom"
            and ("differs" in m or "Flattening optimizer state_dict" in m or "generator object" in m)
        ),
    ),
    ("state cast to the parameter's dtype", lambda f, s, m: s.get("dtype") == "bfloat16" and "differs" in m),
    (
        "group fields the target lacks",
        lambda f, s, m: (s.get("scheduler") or s.get("custom_fields")) and ("differs" in m or "KeyError" in m),
    ),
)


def explore_cause(finding: dict) -> str | None:
    """The traced cause of a deviation found by ``python -m conformance explore --impl torch``, or None."""
    scenario, message = finding["scenario"], finding["message"] or ""
    return next((title for title, test in EXPLORE_RULES if test(finding, scenario, message)), None)


@functools.lru_cache(maxsize=1)
def _found_scenarios() -> dict[str, dict]:
    """The scenario of every found-scenario case the registry loads (conformance/found/), by case ID."""
    import glob

    from conformance.running.generated import found_dirs

    out = {}
    for directory in found_dirs():
        for path in glob.glob(os.path.join(directory, "*.json")):
            with open(path) as f:
                data = json.load(f)
            out[data["id"]] = data["scenario"]
    return out


def cause_of(case: dict, found: dict[str, dict] | None = None) -> str | None:
    """The traced cause of a failing case of a run: a found-scenario case by its scenario, like a
    finding of an exploration; any other by the matrix's causes."""
    if "[found-" in case["id"]:
        scenario = (found if found is not None else _found_scenarios()).get(case["id"])
        return None if scenario is None else explore_cause({**case, "scenario": scenario})
    sig = signature(case["message"] or "")
    return next((c.title for c in CAUSES if c.matches(case, sig)), None)


_FEATURES = (
    "tie", "lazy", "frozen", "adapter", "router", "extra_state", "one_group", "empty_at", "router_group",
    "custom_fields", "scheduler", "warm", "reshard_to", "model_keys", "group_order",
)  # fmt: skip


def _features(scenario: dict) -> int:
    """How many of a scenario's features are on: the simplest finding of a cause is the one to keep."""
    return sum(bool(scenario.get(k)) for k in _FEATURES)


def explore_table(path: str, save_found: str | None = None) -> int:
    """Each finding of an exploration's JSON report with its cause; the causes found of those traced.
    ``save_found``: write one found-scenario case per cause there (its smallest finding), so that the
    regression matrix holds each cause the exploration found once."""
    with open(path) as f:
        report = json.load(f)
    run = report.get("explore", report)
    findings = run.get("findings", [])
    found: dict[str, list[str]] = {}
    untraced = []
    for f in findings:
        cause = explore_cause(f)
        (found.setdefault(cause, []) if cause else untraced).append(
            f"{f['clause']}: {f['description'].splitlines()[0]}"
        )
    titles = [c.title for c in CAUSES]
    print(
        f"exploration: seed {run.get('seed')}, budget {run.get('budget_s')} s, world sizes {run.get('world_sizes')}, "
        f"{run.get('ran')} scenarios, {len(findings)} deviations"
    )
    for title in titles:
        mark = f"{len(found[title])} finding(s)" if title in found else "not found"
        print(f"  {title}: {mark}")
        for line in found.get(title, [])[:3]:
            print(f"      {line}")
    for line in untraced:
        print(f"  UNTRACED {line}")
    print(f"causes found: {len(found)} of {len(titles)} traced; untraced deviations: {len(untraced)}")
    if save_found and not untraced:
        from conformance.running.generated import found_record, write_found
        from conformance.world.scenario import Scenario

        impl = (report.get("impl") or {}).get("spec", "torch")
        for title in titles:
            mine = [f for f in findings if explore_cause(f) == title]
            if not mine:
                continue
            f = min(mine, key=lambda f: (_features(f["scenario"]), len(json.dumps(f["scenario"])), f["token"]))
            record = found_record(
                f["clause"], Scenario.from_dict(f["scenario"]), impl=impl, status=f["status"], message=f["message"]
            )
            print(f"  {title}: {write_found(save_found, record)}")
    return 1 if untraced else 0


def _covering(ids: list[str], others: list[str]) -> list[str]:
    """Shortest prefixes (clause, clause on a layout) covering ``ids`` and none of ``others``."""
    out, left = [], list(ids)
    clause = lambda i: i.split("[", 1)[0] + "["  # noqa: E731
    layout = lambda i: clause(i) + i.split("[", 1)[1].split("-", 1)[0] + "-"  # noqa: E731
    for level in (clause, layout):
        groups: dict[str, list[str]] = {}
        for i in left:
            groups.setdefault(level(i), []).append(i)
        left = []
        for prefix, members in groups.items():
            if prefix != members[0] and not any(o.startswith(prefix) for o in others):
                out.append(prefix)
            else:
                left += members
    return out + left


def check(cases: list[dict], known_path: str) -> dict:
    """How a known-failures file fares against a run's cases, as ``--xfails`` would judge them:
    failures it does not list, passes it lists (xpass), errors, and entries that match no case."""
    from conformance.running.xfails import Xfails

    known = Xfails.load(known_path)
    known.mark_selected([c["id"] for c in cases])
    listed = lambda c: known.match(c["id"]) is not None  # noqa: E731
    return {
        "file": os.path.relpath(known_path, ROOT),
        "unlisted": sorted(c["id"] for c in cases if c["status"] == Status.FAILED and not listed(c)),
        "xpass": sorted(c["id"] for c in cases if c["status"] == Status.PASSED and listed(c)),
        "error": sorted(c["id"] for c in cases if c["status"] == Status.ERROR),
        "stale": [e.pattern for e in known.unmatched()],
    }


_FAILING = (Status.FAILED, Status.ERROR, Status.XFAIL)


def _by_cause(cases: list[dict], found: dict | None) -> tuple[dict[str, list[str]], list[str]]:
    """The failing cases' IDs by their cause's title, and the failures no cause explains."""
    by_cause: dict[str, list[str]] = {}
    untraced = []
    for c in cases:
        if c["status"] not in _FAILING:
            continue
        cause = cause_of(c, found)
        if cause is None:
            untraced.append(f"{c['id']}: {signature(c['message'] or '')[:200]}")
        else:
            by_cause.setdefault(cause, []).append(c["id"])
    return by_cause, untraced


def _sections(path: str) -> tuple[str, dict[str, list[str]], dict[str, int]]:
    """A known-failures file's header, its entry lines by cause title (in file
    order) and each section's case count."""
    header: list[str] = []
    sections: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    current = None
    with open(path) as f:
        for line in f.read().splitlines():
            heading = re.match(r"## (.*) \((\d+) cases\)$", line)
            if heading:
                current = heading.group(1)
                sections[current], counts[current] = [], int(heading.group(2))
            elif current is None:
                header.append(line)
            elif line.strip():
                sections[current].append(line)
    return "\n".join(line for line in header if line.strip()), sections, counts


def merge(cases: list[dict], path: str, manifest: list[str], found: dict | None = None) -> list[str]:
    """Add the failures of ``cases`` (a run of cases added since ``path`` was
    written, whose full run's report is gone) under their causes, as prefixes
    that cover no other case of ``manifest``; the header's counts follow.
    Failures the file already lists are left as they are, so merging one run
    twice adds nothing. Returns the untraced failures (then nothing is written)."""
    from conformance.running.xfails import Xfails

    header, sections, counts = _sections(path)
    listed = Xfails.load(path)
    by_cause, untraced = _by_cause([c for c in cases if listed.match(c["id"]) is None], found)
    if untraced:
        return untraced
    if not by_cause:
        return []
    reasons = {cause.title: cause.reason for cause in CAUSES}
    for title, ids in by_cause.items():
        others = [i for i in manifest if i not in set(ids)]
        sections.setdefault(title, [])
        sections[title] += [f"{p}  # {title}: {reasons[title]}" for p in _covering(ids, others)]
        counts[title] = counts.get(title, 0) + len(ids)
    tally = re.search(r"(?: and (\d+) run\(s\) of cases added since)?: \d+ failing cases, \d+ causes\.", header)
    runs = int(tally.group(1) or 0) + 1
    header = (
        header[: tally.start()]
        + f" and {runs} run(s) of cases added since: {sum(counts.values())} failing cases, {len(sections)} causes."
        + header[tally.end() :]
    )
    out = [header]
    for title in [cause.title for cause in CAUSES if cause.title in sections]:
        out += ["", f"## {title} ({counts[title]} cases)"] + sections[title]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return []


def known_file(version: str) -> str:
    """The known-failures file of a torch release (``2.13.0`` -> ``conformance/known/torch-2.13.txt``)."""
    return os.path.join(ROOT, "conformance", "known", f"torch-{'.'.join(version.split('.')[:2])}.txt")


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.releases.trace_known",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("report")
    parser.add_argument("--torch", help="the torch version the report is from, for the header")
    parser.add_argument(
        "--explore",
        action="store_true",
        help="the report is an exploration's (python -m conformance explore --impl torch --json F): list each "
        "deviation with its traced cause, and which causes it found; exit 1 if one has no cause",
    )
    parser.add_argument(
        "--save-found",
        metavar="DIR",
        help="with --explore: write one found-scenario case per traced cause there (conformance/found ships them)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="judge the release's known-failures file against the report instead of writing one: "
        "exit 1 unless every failure is listed, no listed case passed, no case errored and every entry matches",
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="the report is a run of cases added since the release's known-failures file was written: add "
        "their failures to that file under their causes (when the full run's report is gone)",
    )
    parser.add_argument(
        "--also",
        action="append",
        default=[],
        metavar="REPORT",
        help="a later run of some cases (-k): its cases replace or add to the report's",
    )
    args = parser.parse_args()
    if args.explore:
        return explore_table(args.report, args.save_found)
    if not args.torch:
        parser.error("--torch is required")
    with open(args.report) as f:
        cases = json.load(f)["cases"]
    for path in args.also:
        with open(path) as f:
            later = {c["id"]: c for c in json.load(f)["cases"]}
        cases = [later.pop(c["id"], c) for c in cases] + list(later.values())
    if args.merge:
        from conformance.running.registry import all_cases

        untraced = merge(cases, known_file(args.torch), [c.id for c in all_cases()], _found_scenarios())
        if untraced:
            sys.stderr.write("untraced failures (add a cause):\n  " + "\n  ".join(untraced) + "\n")
            return 1
        args.check = True
    if args.check:
        result = check(cases, known_file(args.torch))
        for key in ("unlisted", "xpass", "error", "stale"):
            print(f"{result['file']}: {len(result[key])} {key}" + "".join(f"\n  {i}" for i in result[key][:20]))
        return 1 if any(result[k] for k in ("unlisted", "xpass", "error", "stale")) else 0
    bad = [c for c in cases if c["status"] in _FAILING]
    by_cause, untraced = _by_cause(bad, _found_scenarios())
    if untraced:
        sys.stderr.write("untraced failures (add a cause):\n  " + "\n  ".join(untraced) + "\n")
        return 1
    out = [
        f"# Expected failures of torch.distributed.checkpoint.state_dict (torch {args.torch}) on this suite,",
        "# from a full run (python -m conformance --impl torch --json ...)"
        + (f" and {len(args.also)} run(s) of cases added since" if args.also else "")
        + f": {len(bad)} failing cases, {len(by_cause)} causes.",
        "# Written by python -m tools.releases.trace_known; each section is one cause, each line a case ID or prefix.",
        "#   python -m conformance --impl torch --xfails "
        f"conformance/known/torch-{'.'.join(args.torch.split('.')[:2])}.txt",
    ]
    for cause in CAUSES:
        ids = by_cause.get(cause.title)
        if not ids:
            continue
        others = [c["id"] for c in cases if c["id"] not in set(ids)]
        out += ["", f"## {cause.title} ({len(ids)} cases)"]
        out += [f"{p}  # {cause.title}: {cause.reason}" for p in _covering(ids, others)]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
