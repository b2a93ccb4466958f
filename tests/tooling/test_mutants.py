"""The mutation list still applies to the current sources, so the measured
score (docs/CONFORMANCE.md, docs/MUTATION.md) cannot rot silently, and it keeps
applying when code moves: each mutant is anchored to a function and a pattern
of its syntax tree (tools/mutation/anchor.py), not to text. No suite run here: ``python
-m tools.mutation.mutate`` runs the campaign."""

import ast
import os
import shutil
import textwrap

import pytest

from conformance.running.registry import all_cases
from tools.mutation.anchor import AnchorError, Package
from tools.mutation.anchor import apply as edit
from tools.mutation.mutants import MUTANTS, Mutant
from tools.mutation.mutate import ROOT, apply, check, locate, main, package, quick_slice

IDS = [m.name for m in MUTANTS]


@pytest.fixture(scope="module")
def today():
    return package()


def test_enough_mutants_with_unique_names():
    assert len(MUTANTS) >= 30
    assert len(set(IDS)) == len(IDS), "duplicate mutant names"


def test_the_score_is_stated_once_for_every_mutant_listed():
    """docs/MUTATION.md states the score, counting every mutant of tools/mutation/mutants.py; other documents
    link to it."""
    import re

    docs = os.path.join(ROOT, "docs")
    with open(os.path.join(docs, "MUTATION.md")) as f:
        stated = re.findall(r"\*\*(\d+) mutants: the matrix alone kills \d+", f.read())
    assert stated == [str(len(MUTANTS))], stated
    for name in os.listdir(docs):
        if name.endswith(".md") and name != "MUTATION.md":
            with open(os.path.join(docs, name)) as f:
                assert not re.search(r"\d+ mutants", f.read()), f"{name} states a mutation figure: link MUTATION.md"


@pytest.mark.parametrize("mutant", MUTANTS, ids=IDS)
def test_every_mutant_applies_to_todays_sources(mutant, today):
    path, mutated = apply(mutant, today)  # an AnchorError says what rotted: re-anchor it in tools/mutation/mutants.py
    with open(os.path.join(ROOT, "hyperdsd", path)) as f:
        source = f.read()
    assert mutated != source
    ast.parse(mutated, filename=f"hyperdsd/{path} ({mutant.name})")


def test_every_hint_selects_a_case():
    ids = [c.id for c in all_cases()]
    stale = [(m.name, h) for m in MUTANTS for h in m.hints if not any(h in i for i in ids)]
    assert not stale, f"hints that select no case (rename them after the case): {stale}"


# What the text-based mutants (before they were anchored) made of today's sources: the anchored ones make
# the same text. Once the source moves on from a target, its comparison is skipped.
TEXT_MUTANTS = {
    "get-steps-fresh-optimizer": (
        "state/optimizer/state.py",
        "        placeholders = placeholder_state_of(opt) if not opt.state "
        "else (stateless_placeholders(opt) if to_load else {})\n",
        "        placeholders = {}\n"
        "        if not opt.state:  # initialise state as torch's get does: zero grads, a step at lr 0\n"
        "            lrs = [g['lr'] for g in opt.param_groups]\n"
        "            for g in opt.param_groups:\n"
        "                g['lr'] = 0.0\n"
        "                for p in g['params']:\n"
        "                    if p.grad is None:\n"
        "                        p.grad = torch.zeros_like(p)\n"
        "            opt.step()\n"
        "            for g, lr in zip(opt.param_groups, lrs):\n"
        "                g['lr'] = lr\n"
        "            opt.zero_grad(set_to_none=True)\n",
    ),
    "prefix-left-missing-keys": (
        "state/model.py",
        "    plan.missing = [c for c in raw_of if c not in matched and c not in frozen]",
        "    plan.missing = [raw_of[c] for c in raw_of if c not in matched and c not in frozen]",
    ),
    "strict-lazy-counts-as-missing": (
        "state/optimizer/plan.py",
        "        absent = [f for f in required if f not in listed]",
        "        absent = [f for f in required if f not in listed or f not in source.by_name]",
    ),
    "flat-unknown-keys-dropped": (
        "state/keys/flat.py",
        "        if split is None:\n            self.unknown.append(key)\n",
        "        if split is None:\n",
    ),
    "state-cast-to-param-dtype": (
        "state/optimizer/values.py",
        "    verdict = _verdict(value, p, key, expected, verdicts)\n",
        '    if isinstance(value, torch.Tensor) and key != "step":\n'
        "        value = value.to(p.dtype)  # state follows its parameter's dtype\n"
        "    verdict = _verdict(value, p, key, expected, verdicts)\n",
    ),
    "dcp-partial-loaded-into-warm": (
        "checkpoint/load_template.py",
        "        if present:\n",
        "        if present and not entry.placeholder:\n"
        "            drop += missing  # a stepped optimizer has the rest: load what is there\n"
        "            continue\n"
        "        if present:\n",
    ),
    "strict-false-ignored-for-optimizer": (
        "api.py",
        '                self.index, self.optims, parts["optim"], strict=self.opts.strict, foreign_ok=foreign_ok',
        '                self.index, self.optims, parts["optim"], strict=True, foreign_ok=foreign_ok',
    ),
}


@pytest.mark.parametrize("name", sorted(TEXT_MUTANTS))
def test_anchored_mutant_makes_the_text_mutants_edit(name, today):
    file, target, replacement = TEXT_MUTANTS[name]
    with open(os.path.join(ROOT, "hyperdsd", file)) as f:
        source = f.read()
    if source.count(target) != 1:
        pytest.skip(f"hyperdsd/{file} has moved on from the text this mutant once targeted")
    path, mutated = apply(next(m for m in MUTANTS if m.name == name), today)
    assert path == file
    assert mutated == source.replace(target, replacement)


# -- moved, reformatted: still found, the same edit --------------------------------------------------


def _move_out(package_dir: str, names: set[str]) -> None:
    """Move every top-level function and class that holds one of ``names`` (dotted) out of its
    module into ``moved/<module>.py``, reformatted (ast.unparse: other line breaks, quotes and
    parentheses, no comments) and indented under an ``if True:``."""
    os.makedirs(os.path.join(package_dir, "moved"))
    by_module: dict[str, list[str]] = {}
    for fn in Package(package_dir).functions:
        if fn.name in names:
            by_module.setdefault(fn.path, []).append(fn.qualname.split(".")[0])
    for path, tops in by_module.items():
        with open(os.path.join(package_dir, path)) as f:
            source = f.read()
        lines = source.splitlines(keepends=True)
        moved, cut = [], []
        for node in ast.parse(source).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in tops:
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                cut.append((first - 1, node.end_lineno))
                moved.append(node)
        for start, end in reversed(cut):
            del lines[start:end]
        with open(os.path.join(package_dir, path), "w") as f:
            f.write("".join(lines))
        with open(os.path.join(package_dir, "moved", path.replace("/", "_")), "w") as f:
            f.write("import torch\n\n" + ast.unparse(ast.If(ast.Constant(True), moved, [])) + "\n")


def _function(source: str, qualname: str) -> str:
    from tools.mutation.anchor import _functions

    return next(ast.dump(node) for q, node in _functions(ast.parse(source)) if q == qualname)


def test_every_mutant_applies_after_its_function_moves_to_another_module(tmp_path, today):
    copy = str(tmp_path / "hyperdsd")
    shutil.copytree(os.path.join(ROOT, "hyperdsd"), copy, ignore=shutil.ignore_patterns("__pycache__"))
    _move_out(copy, {m.function for m in MUTANTS})
    moved = Package(copy)
    for m in MUTANTS:
        was, now = locate(m, today), locate(m, moved)
        assert now.path == "moved/" + was.path.replace("/", "_"), m.name
        assert now.name != m.function and now.qualname == was.qualname
        # the same edit of the same function: the mutated functions' syntax trees are equal
        assert _function(apply(m, moved)[1], now.qualname) == _function(apply(m, today)[1], was.qualname), m.name
    problems, notes = check(MUTANTS[:2], moved, hints=False)
    assert not problems and len(notes) == 2
    assert notes[0].startswith(f"mutant {MUTANTS[0].name}: {MUTANTS[0].function} is now hyperdsd.moved.")


# -- what --check reports -----------------------------------------------------------------------------

SYNTHETIC = {
    "a.py": """
        def f(x, extra):
            if extra:  # a comment the edit keeps
                x = list(x)
                return [v for v in x if v > 0]
            return x


        class C:
            def m(self, y):
                return y + y
        """,
    "b.py": """
        def g(z):
            return z


        def h(z):
            return z
        """,
    "c.py": """
        def g(z):
            return -z


        def u(s):
            return "\u00e9t\u00e9\f" + s.upper()  # columns count bytes: an edit after non-ASCII text
        """,
}


@pytest.fixture
def synthetic(tmp_path):
    pkg = tmp_path / "hyperdsd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in SYNTHETIC.items():
        (pkg / name).write_text(textwrap.dedent(text).lstrip())
    return str(tmp_path)


def _m(name, function, pattern, replacement):
    return Mutant(name, function, pattern, replacement, "a bug")


BROKEN = [
    _m("fine", "hyperdsd.a.f", "if extra: ...", "if False: ..."),
    _m("gone", "hyperdsd.a.removed", "x", "None"),
    _m("method-gone", "hyperdsd.a.C.other", "y", "None"),
    _m("nothing", "hyperdsd.a.f", "x + 1", "x"),
    _m("twice", "hyperdsd.a.C.m", "y", "0"),
    _m("ambiguous", "hyperdsd.moved.g", "z", "0"),
]


def test_check_names_a_gone_function_and_a_pattern_that_does_not_match_once(synthetic):
    problems, notes = check(BROKEN, package(synthetic), hints=False)
    assert notes == []
    by_name = {p.split(":")[0].removeprefix("mutant "): p for p in problems}
    assert set(by_name) == {"gone", "method-gone", "nothing", "twice", "ambiguous"}
    assert "function hyperdsd.a.removed is gone" in by_name["gone"]
    assert "function hyperdsd.a.C.other is gone" in by_name["method-gone"]
    assert "matches 0 times in hyperdsd.a.f (a.py:1)" in by_name["nothing"]
    assert "matches 2 times in hyperdsd.a.C.m" in by_name["twice"]
    assert "ambiguous" in by_name["ambiguous"] and "hyperdsd.b.g" in by_name["ambiguous"]
    assert "hyperdsd.c.g" in by_name["ambiguous"]


def test_check_on_the_command_line(synthetic, monkeypatch, capsys):
    import tools.mutation.mutate

    monkeypatch.setattr(tools.mutation.mutate, "ROOT", synthetic)
    monkeypatch.setattr(tools.mutation.mutate, "MUTANTS", tuple(BROKEN))
    assert main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "mutant gone: function hyperdsd.a.removed is gone" in out
    assert "mutant nothing: the pattern matches 0 times" in out
    assert "# 6 mutants: 5 problems" in out
    monkeypatch.setattr(tools.mutation.mutate, "MUTANTS", tuple(BROKEN[:1]))
    assert main(["--check"]) == 0
    assert "every one applies" in capsys.readouterr().out


def test_a_name_is_matched_by_its_qualname_and_ties_go_to_the_module_holding_the_pattern(synthetic):
    pkg = package(synthetic)
    assert pkg.find("hyperdsd.b.g").path == "b.py"  # the module named wins over another g
    assert pkg.find("hyperdsd.elsewhere.g", "-z").path == "c.py"  # moved: the g the pattern is in
    assert pkg.find("hyperdsd.x.C.m").path == "a.py"
    with pytest.raises(AnchorError, match="is gone"):
        pkg.find("hyperdsd.a.D.m")  # a method of another class is not this one


# -- edits ------------------------------------------------------------------------------------------


def _edit(synthetic, pattern, replacement, function="hyperdsd.a.f"):
    fn = package(synthetic).find(function)
    mutated = edit(fn, pattern, replacement)
    return [line for line in mutated.splitlines() if line not in fn.source.splitlines()]


def test_an_edit_touches_only_where_pattern_and_replacement_differ(synthetic):
    # the if's test alone: the comment, the body stay
    assert _edit(synthetic, "if extra: ...", "if False: ...") == ["    if False:  # a comment the edit keeps"]
    # a sub-expression
    assert _edit(synthetic, "v > 0", "v > 0 or v is None") == ["        return [v for v in x if v > 0 or v is None]"]
    assert _edit(synthetic, "y + y", "y + y if y else y", "hyperdsd.a.C.m") == ["        return y + y if y else y"]
    # statements inserted before and after, at the match's indentation; a statement deleted
    assert _edit(synthetic, "return x", "x = list(x)\nreturn x") == ["    x = list(x)"]
    fn = package(synthetic).find("hyperdsd.a.f")
    assert "    pass\n    return x\n" in edit(fn, "if extra: ...", "if extra: ...\npass")
    assert "x = list(x)" not in edit(fn, "if extra:\n    x = list(x)\n    ...", "if extra:\n    ...")


def test_an_edit_after_non_ascii_text_on_its_line(synthetic):
    fn = package(synthetic).find("hyperdsd.c.u")
    assert 'return "\u00e9t\u00e9\f" + s.lower()  # columns' in edit(fn, "s.upper()", "s.lower()")


def test_parentheses_where_precedence_needs_them(synthetic):
    fn = package(synthetic).find("hyperdsd.a.C.m")
    mutated = edit(fn, "y + y", "y + (y or 1)")
    assert "return y + (y or 1)" in mutated
    mutated = edit(fn, "y + y", "(y or 1) + y")
    assert "return (y or 1) + y" in mutated


def test_an_edit_that_would_drop_what_the_pattern_leaves_open_is_refused(synthetic):
    fn = package(synthetic).find("hyperdsd.a.f")
    with pytest.raises(AnchorError, match="leaves open"):
        edit(fn, "if extra: ...", "pass")  # the body would go, unseen
    with pytest.raises(AnchorError, match="where the pattern's does"):
        edit(fn, "if extra: ...", "if extra: return None")


def test_quick_slice_covers_every_clause_and_mode():
    cases = all_cases()
    chosen = {c.id: c for c in cases if c.id in set(quick_slice())}
    assert {(c.clause, c.mode) for c in chosen.values()} == {(c.clause, c.mode) for c in cases}


# -- the exploration stage's plumbing (no exploration runs here) ------------------------------------


def test_explore_command_has_the_budget_seed_and_copy():
    from tools.mutation.mutate import PACKAGE, ExploreSettings, explore_command

    cmd = explore_command(ExploreSettings("90s", 7), "/tmp/r.json")
    assert cmd[1:4] == ["-m", "conformance", "explore"]
    args = dict(zip(cmd[4::2], cmd[5::2]))
    assert args == {"--impl": PACKAGE, "--budget": "90s", "--seed": "7", "--rounds": "1", "--json": "/tmp/r.json"}
    assert ExploreSettings("2m").budget_s == 120.0
    with pytest.raises(ValueError, match="budget"):
        ExploreSettings("soon").budget_s


def _report(findings, complete=True, ran=5):
    return {"impl": "x", "explore": {"ran": ran, "complete": complete, "findings": findings}}


def test_explore_result_names_the_first_finding_its_clause_and_token():
    from tools.mutation.mutate import explore_result

    finding = {
        "clause": "MODEL-1",
        "status": "failed",
        "message": "full: the model state dict differs:\n  'head.weight' is missing\n  more",
        "token": "s1.abc",
        "description": "layout single (1 ranks), mode full",
        "shrunk": True,
    }
    r = explore_result(_report([finding, {**finding, "clause": "OPT-RT-1"}]), 1)
    assert (r.killed_by, r.status, r.token, r.ran) == ("explore: MODEL-1", "failed", "s1.abc", 5)
    assert r.message == "full: the model state dict differs: 'head.weight' is missing"
    assert r.scenario.startswith("layout single")
    unshrunk = explore_result(_report([{**finding, "shrunk": False}], complete=False), 1)
    assert unshrunk.killed_by == "explore: MODEL-1 (not shrunk)"


def test_explore_result_survives_only_a_complete_clean_run():
    from tools.mutation.mutate import explore_result

    assert explore_result(_report([]), 0).killed_by == ""
    assert explore_result(_report([]), 0).ran == 5
    broken = explore_result(_report([], complete=False), 1)
    assert broken.status == "broken" and "interrupted" in broken.killed_by
    assert explore_result({"explore": {"ran": 0, "findings": []}}, 2).status == "broken"


def test_stages_and_the_split_score():
    from tools.mutation.mutate import StageResult, Verdict, parse_stages, scores

    assert parse_stages("explore,hints") == ("hints", "explore")
    assert parse_stages("hints,quick,full,explore") == ("hints", "quick", "full", "explore")
    with pytest.raises(ValueError, match="stages"):
        parse_stages("hints,fuzz")
    m = MUTANTS[0]
    verdicts = [
        Verdict(m, StageResult("OPT-RT-1[x]", "failed"), "hints", 1.0),
        Verdict(m, StageResult("explore: MODEL-1", "failed"), "explore", 1.0),
        Verdict(m, StageResult(), "", 1.0),
    ]
    sc = scores(verdicts)
    assert (sc["total"], sc["killed"], sc["matrix_killed"], sc["explore_killed"]) == (3, 2, 1, 1)
