"""The documents' examples run as they are, and the README stays a front page.

Examples are found by a marker comment (``<!-- example: tests/repository/test_docs.py -->``
before a python block), not by a heading, so documents can be reorganised.
"""

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

MARKER = "<!-- example: tests/repository/test_docs.py -->"


def marked_blocks(page: str) -> list[str]:
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    return re.findall(re.escape(MARKER) + r"\s*```python\n(.*?)```", text, flags=re.S)


def run_python(folder, name: str, code: str) -> subprocess.CompletedProcess:
    (folder / name).write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), ROOT]))
    return subprocess.run([sys.executable, name], cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("index", [0, 1], ids=["get_and_set", "resume"])
def test_the_readmes_examples_run(tmp_path, index):
    blocks = marked_blocks("README.md")
    assert len(blocks) == 2, f"README.md should mark its two examples with {MARKER!r}"
    done = run_python(tmp_path, "example.py", blocks[index])
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_harness_example_runs(tmp_path):
    blocks = marked_blocks(os.path.join("docs", "HARNESS.md"))
    assert len(blocks) == 2, "docs/HARNESS.md marks the task module and the controller"
    (tmp_path / "my_tests.py").write_text(blocks[0])
    done = run_python(tmp_path, "run.py", blocks[1])
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_readme_is_a_front_page():
    with open(os.path.join(ROOT, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; reference material belongs in docs/"
    text = "\n".join(lines)
    for link in re.findall(r"\]\((docs/[\w.]+\.md)", text):
        assert os.path.exists(os.path.join(ROOT, link)), f"README.md links to {link}, which does not exist"


# -- every name a document gives exists ------------------------------------------------------------

TOP = ("hyperdsd", "conformance", "tests", "tools", "docs", "ci", ".ci")
# A path under one of the top-level entries, anywhere in a document (prose, backticks, code blocks).
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*)")
# A bare Python file name, in prose or as a whole backticked span: it must be some file of the repository.
BARE = re.compile(r"(?<![\w./-])([\w-]+\.py)\b")
# A backticked dotted name under one of the packages, maybe called: `hyperdsd.checkpoint.save(path)`.
DOTTED = re.compile(r"^((?:hyperdsd|conformance|tools|tests)(?:\.\w+)+)(?:\(.*)?$")
RUN_MODULE = re.compile(r"python3? -m ((?:hyperdsd|conformance|tools|tests)(?:\.\w+)*)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
# A placeholder in a path: `conformance/known/torch-X.Y.txt`, `conformance/found/<hash>.json`.
PLACEHOLDER = re.compile(r"[*{}<>]|\bX\.Y\b")
# Names CHANGELOG.md may give though they are gone: it records history. Each with the reason.
HISTORY_NAMES: dict[str, str] = {}
# Bare file names of other projects that documents discuss.
OTHERS_FILES = {
    "state_dict.py": "torch/distributed/checkpoint/state_dict.py, torch's implementation (and verl's copy)",
    "_state_dict_utils.py": "torch/distributed/_state_dict_utils.py",
}


def documents() -> list[str]:
    docs = sorted(f"docs/{n}" for n in os.listdir(os.path.join(ROOT, "docs")) if n.endswith(".md"))
    return ["README.md", "CHANGELOG.md", *docs]


def _module_file(dotted: str) -> str | None:
    base = os.path.join(ROOT, *dotted.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _dotted_exists(dotted: str) -> bool:
    """A module or package, or a name its longest module prefix mentions (``hyperdsd.checkpoint.Manager``)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        found = _module_file(".".join(parts[:n]))
        if found:
            if n == len(parts):
                return True
            with open(found, encoding="utf-8") as f:
                return re.search(rf"\b{re.escape(parts[n])}\b", f.read()) is not None
    return False


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        text = FENCE.sub("", f.read())
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def missing_names(doc: str, text: str, basenames: set[str]) -> list[str]:
    """What ``text`` (the document ``doc``) names that the repository does not hold."""
    missing = []
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if PLACEHOLDER.search(path) or path in HISTORY_NAMES:
            continue
        if not os.path.exists(os.path.join(ROOT, path)):
            missing.append(path)
    for target in LINK.findall(text):
        if re.match(r"\w+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        where = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), file)) if file else os.path.join(ROOT, doc)
        if not os.path.exists(where):
            missing.append(target)
        elif anchor and where.endswith(".md") and anchor not in _anchors(where):
            missing.append(target)
    prose = FENCE.sub("", text)
    spans = [span.strip() for span in INLINE.findall(prose)]
    bare = BARE.findall(INLINE.sub(" ", prose)) + [span for span in spans if BARE.fullmatch(span)]
    known = basenames | set(HISTORY_NAMES) | set(OTHERS_FILES)
    missing += [name for name in bare if name not in known]
    for span in spans:
        dotted = DOTTED.match(span)
        if dotted and not _dotted_exists(dotted.group(1)):
            missing.append(dotted.group(1))
    for module in RUN_MODULE.findall(text):
        if not _dotted_exists(module):
            missing.append(f"python -m {module}")
    return sorted(set(missing))


def _repo_basenames() -> set[str]:
    names = set()
    for top in TOP:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            names.update(files)
    return names


def test_every_name_a_document_gives_exists():
    """Every file, folder, module, ``python -m`` module and link (with its anchor) that README.md,
    CHANGELOG.md and docs/*.md name exists in the repository, so a rename or a removal cannot leave a
    document pointing at nothing. Paths are found anywhere under the top-level folders (hyperdsd/,
    conformance/, tests/, tools/, docs/, ci/, .ci/); a bare ``name.py`` in prose, or as a whole
    backticked span, must be some file's name (a backticked command such as ``python example.py`` is
    left alone, and OTHERS_FILES names torch's files); a backticked dotted name must be a module, or a
    name its module mentions. CHANGELOG.md records history, so a name it gives for something since
    removed may stay, listed in HISTORY_NAMES with the reason (none is needed now)."""
    basenames = _repo_basenames()
    wrong = {}
    for doc in documents():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            missing = missing_names(doc, f.read(), basenames)
        if missing:
            wrong[doc] = missing
    assert not wrong, "documents name what the repository does not hold:\n" + "\n".join(
        f"  {doc}: {', '.join(names)}" for doc, names in wrong.items()
    )


def test_the_name_check_finds_what_is_missing():
    text = (
        "See `tools/no_such_tool.py`, [the guide](ADAPTERS.md#no-such-heading), `gone_module.py`,\n"
        "`hyperdsd.no_such_module`, and run `python -m tools.no_such_module`; but `tools/benchmarks/bench.py`,\n"
        "[its anchor](PERFORMANCE.md#the-suites-own-speed), `helpers.py`, `hyperdsd.checkpoint.Manager`\n"
        "and conformance/found/ exist, and `conformance/found/<hash>.json` is a pattern.\n"
    )
    assert missing_names("docs/X.md", text, _repo_basenames()) == [
        "ADAPTERS.md#no-such-heading",
        "gone_module.py",
        "hyperdsd.no_such_module",
        "python -m tools.no_such_module",
        "tools/no_such_tool.py",
    ]


@pytest.mark.parametrize("page", ["docs/PERFORMANCE.md", "docs/MUTATION.md"])
def test_the_measurement_pages_say_what_is_true_now(page):
    """A page of figures holds the current ones, one dated table per family; history is CHANGELOG.md's."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().splitlines()
    # (PERFORMANCE.md's essay on what makes hyperdsd fast is no figure: it is not counted)
    essay = [i for i, line in enumerate(lines) if line == "## What makes hyperdsd fast"]
    if essay:
        end = next((i for i in range(essay[0] + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines = lines[: essay[0]] + lines[end:]
        assert end - essay[0] > 50, "the essay's section was not found whole"
    assert len(lines) <= 250, f"{page} has {len(lines)} lines; past measurements belong in CHANGELOG.md, not here"
