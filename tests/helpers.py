"""Shared helpers for tests that start processes.

Tests wait on events (a process exits, a line is printed, a rank is gone),
each with a limit far above what any load makes of it: the limit only turns
a hang into a failure. A limit that a run must stay under to pass (a task's
deadline, a released rank's grace) is scaled by :func:`slowness`, measured
once per test session. Speed claims live in the benchmarks under tools/.
See docs/TESTING.md.
"""

import contextlib
import functools
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where test modules and the rank tasks they run live: a subprocess that
# runs them (a CLI run, a torchrun world) needs every folder on its path.
TESTS = os.pathsep.join(
    os.path.join(ROOT, "tests", *sub)
    for sub in ((), ("library",), ("checkpoint",), ("harness",), ("suite",), ("tooling",), ("repository",))
)


# What one run of _calibration takes on the reference machine (docs/TESTING.md).
_REFERENCE_S = 0.014


def _calibration() -> float:
    """Seconds for a fixed single-threaded workload: torch's dispatcher and
    the interpreter, what the ranks of most tests spend their time in."""
    start = time.perf_counter()
    t = torch.zeros(16)
    for _ in range(2000):
        t.add_(1.0)
    total = 0
    for i in range(200_000):
        total += i * i
    return time.perf_counter() - start


@functools.cache
def slowness() -> float:
    """How many times slower than the reference machine this one runs now
    (at least 1): measured at the start of the session, under whatever load
    the machine has then. ``HYPERDSD_TEST_SLOWNESS`` sets it instead."""
    forced = os.environ.get("HYPERDSD_TEST_SLOWNESS")
    if forced:
        return max(1.0, float(forced))
    _calibration()  # warm up: first calls pay for lazy initialisation
    return min(20.0, max(1.0, statistics.median([_calibration() for _ in range(9)]) / _REFERENCE_S))


def scaled(seconds: float) -> int:
    """A limit of ``seconds`` on the reference machine, for this one (whole seconds: limits appear in messages)."""
    return math.ceil(seconds * slowness())


def marked_processes(mark: str) -> list[int]:
    """PIDs of live processes whose environment carries ``HYPERDSD_TEST_MARK=mark``."""
    needle = f"HYPERDSD_TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != b"Z":
            found.append(int(entry))
    return found


_MP_HELPERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def is_multiprocessing_helper(pid: int) -> bool:
    """Whether ``pid`` is multiprocessing's fork server or resource tracker,
    which live as long as the process that started them."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return any(name in cmdline for name in _MP_HELPERS)


def descendant_ranks() -> list[int]:
    """PIDs of live processes descending from this one, but for
    multiprocessing's fork server and resource tracker: what a pool killed
    must not leave. (Ranks forked from a fork server that started before a
    test set its mark carry no mark in their environment.)"""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if fields[0] != b"Z":
            parents[int(entry)] = (int(fields[1]), cmdline)
    found, frontier = [], [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in parents.items():
            if ppid == parent:
                frontier.append(pid)
                if not any(name in cmdline for name in _MP_HELPERS):
                    found.append(pid)
    return found


def wait_for(condition, limit_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``condition`` until it holds or ``limit_s`` has passed; whether it held."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def lingering(mark: str, limit_s: float = 120.0) -> list[int]:
    """Marked processes still alive after ``limit_s`` to go (killed ranks may
    take a moment); they are then killed, so a failing test leaves none behind."""
    wait_for(lambda: not marked_processes(mark), limit_s, interval_s=0.2)
    left = marked_processes(mark)
    kill_marked(mark)
    return left


def left_behind(mark: str) -> list[str]:
    """Marked processes alive now, with their command lines; then killed, so
    a failing test leaves none behind. No wait: for a process that must have
    reaped everything it started before it returned."""
    left = []
    for pid in marked_processes(mark):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone since
        left.append(f"{pid} {cmdline[:200]}")
    kill_marked(mark)
    return left


def kill_marked(mark: str) -> None:
    """SIGKILL every live process marked ``mark``: cleanup after a failed test."""
    for pid in marked_processes(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_cli(args, *, timeout=600, env=None, mark=None):
    """Run ``python -m conformance`` in a subprocess, for at most ``timeout``
    seconds on the reference machine; returns (CompletedProcess, mark).

    Its output goes to files, not pipes: a pipe is held open by whatever
    the run started too, and reading it to the end would wait for them."""
    mark = mark or uuid.uuid4().hex
    full_env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([TESTS, ROOT]),
        HYPERDSD_TEST_MARK=mark,
        CONFORMANCE_DEADLINE_SCALE=f"{slowness():.2f}",  # cases' own deadlines; an explicit --timeout is kept
        **(env or {}),
    )
    command = [sys.executable, "-m", "conformance", *args]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=out, stderr=err, text=True)
        try:
            proc.wait(timeout=scaled(timeout))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read()), mark


def same(a, b) -> bool:
    """Bitwise equality of nested state: tensors (dtype, shape, values), dicts, lists, scalars."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def run_task(pools, world_size: int, fn, deadline_s: float = 120, **kwargs):
    """Run ``fn`` on every rank of a pool; it must pass there, within ``deadline_s``
    on the reference machine. Returns each rank's value."""
    from hyperdsd.testing import Task

    outcome = pools.run(world_size, Task(fn, kwargs), scaled(deadline_s))
    assert outcome.status == "passed", outcome.describe() + "\n" + "\n".join(r.traceback for r in outcome.results)
    return outcome.values


@contextlib.contextmanager
def runner_on(pools, impl: str):
    """A conformance Runner judging ``impl`` on ``pools`` in this process, closed afterwards."""
    from conformance.adapters import load_adapter
    from conformance.running.runner import Runner

    runner = Runner(load_adapter(impl), pools, deadline_scale=slowness())
    try:
        yield runner
    finally:
        runner.close()
