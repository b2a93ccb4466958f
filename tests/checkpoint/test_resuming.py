"""The examples of docs/RESUMING.md run as they are, in one process and on
two ranks under torchrun, and the error the page shows is the one raised.
The page marks the examples with a comment, so headings can change freely."""

import os
import pickle
import re
import socket
import subprocess
import sys

from helpers import ROOT, scaled
from torch.distributed.checkpoint import FileSystemReader

PAGE = os.path.join(ROOT, "docs", "RESUMING.md")
BEGIN, END = "<!-- examples: tests/checkpoint/test_resuming.py", "<!-- end examples -->"
EXAMPLES = ("resume_one_call.py", "resume_planner.py", "resume_app_state.py")
# Runs each example in a fresh namespace of one interpreter: torch is imported once.
RUNNER = "import runpy, sys\nfor path in sys.argv[1:]:\n    runpy.run_path(path, run_name='__main__')\n"


def section() -> str:
    """The page's tested examples: from the begin marker to the end marker."""
    with open(PAGE) as f:
        text = f.read()
    assert BEGIN in text and END in text, f"{PAGE} lacks the markers {BEGIN!r} ... {END!r}"
    return text.split(BEGIN, 1)[1].split(END, 1)[0]


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), flags=re.S)


def write_examples(folder) -> dict[str, str]:
    files = {}
    for code in blocks("python"):
        name = re.match(r"# file: (\S+)\n", code)
        assert name, f"a python block of {PAGE} does not say which file it is:\n{code[:200]}"
        files[name.group(1)] = code
        (folder / name.group(1)).write_text(code)
    return files


def run(folder, args, launcher=(), timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), ROOT]))
    (folder / "runner.py").write_text(RUNNER)
    return subprocess.run(
        [sys.executable, *launcher, str(folder / "runner.py"), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
    )


def test_every_python_block_is_a_named_example(tmp_path):
    files = write_examples(tmp_path)
    assert set(files) == {"model.py", "resume_incomplete.py", *EXAMPLES}


def test_the_examples_run_in_one_process_and_the_error_shown_is_the_one_raised(tmp_path):
    write_examples(tmp_path)
    done = run(tmp_path, EXAMPLES)
    assert done.returncode == 0, done.stderr[-4000:]

    # Take exp_avg_sq of one parameter out of the checkpoint's metadata, as the page says.
    path = tmp_path / "checkpoints" / "one-call"
    metadata = FileSystemReader(str(path)).read_metadata()
    del metadata.state_dict_metadata["optim.state.experts.0.weight.exp_avg_sq"]
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    failed = run(tmp_path, ["resume_incomplete.py"])
    assert failed.returncode != 0
    (shown,) = blocks("text")
    raised = failed.stderr.rstrip().splitlines()[-len(shown.strip().splitlines()) :]
    assert raised == shown.strip().splitlines(), failed.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_examples_run_on_two_ranks_sharded(tmp_path):
    write_examples(tmp_path)
    launcher = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()))
    done = run(tmp_path, EXAMPLES, launcher=launcher)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert (tmp_path / "checkpoints" / "planner" / ".metadata").exists()


def test_without_the_planner_the_example_would_stop_on_lazy_state(tmp_path):
    """The page's claim: DCP's default planner stops on the router's absent state."""
    name = "resume_planner.py"
    code = write_examples(tmp_path)[name]
    assert "planner=" in code
    (tmp_path / name).write_text(re.sub(r"planner=[\w.]+\(\),?", "", code))
    failed = run(tmp_path, [name])
    assert "Missing key in checkpoint state_dict: " in failed.stderr and "router.weight.step" in failed.stderr, (
        failed.stderr[-3000:]
    )
