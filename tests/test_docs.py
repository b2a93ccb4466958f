"""The documents' examples run as they are, and the README stays a front page.

Examples are found by a marker comment (``<!-- example: tests/test_docs.py -->``
before a python block), not by a heading, so documents can be reorganised.
"""

import os
import re
import subprocess
import sys

import pytest
from helpers import ROOT

MARKER = "<!-- example: tests/test_docs.py -->"


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
