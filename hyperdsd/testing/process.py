"""Process hygiene for rank workers: isolation from the terminal, death with
the controller, stack dumps on request, and killing whole process trees.

Run as a script (``python .../process.py --parent-pid P ARGS...``) this file
is the worker's bootstrap: it arms the death signal within milliseconds of
the process starting, before the seconds spent importing torch, and then
runs ``hyperdsd.testing.worker`` with ARGS. Importing the worker first would
leave that window open: a controller killed during it would leave ranks
behind until their imports finished.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
STACK_SIGNAL = signal.SIGUSR1


def isolate_worker(parent_pid: int) -> None:
    """Detach a freshly spawned worker from the controller's terminal.

    The worker becomes leader of its own process group so that the
    controller can kill it together with anything it started, never receives
    the terminal's Ctrl-C (the controller handles that and kills the pool),
    and is killed by the kernel if the controller dies first.
    """
    try:
        os.setsid()
    except OSError:
        pass  # already a group leader
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the controller's own cleanup still applies
    if os.getppid() != parent_pid:
        # The controller died before the death signal was armed.
        os._exit(1)


def worker_command(*args: str) -> list[str]:
    """The command line that starts a rank worker through this bootstrap."""
    return [sys.executable, os.path.abspath(__file__), *args]


def environment_problems() -> list[str]:
    """What in this Python environment would make every rank fail alike.

    Checked once before any rank starts, so that a broken install gives one
    clear message instead of a failure per case.
    """
    problems = []
    try:
        import numpy  # noqa: F401
    except ImportError:
        problems.append("numpy is not installed, and torch.distributed's object collectives "
                        "(broadcast_object_list, DCP's planning) need it: pip install numpy")
    return problems


def kill_tree(pid: int) -> None:
    """SIGKILL a worker and every process in its process group."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def request_stacks(pid: int) -> None:
    try:
        os.kill(pid, STACK_SIGNAL)
    except (ProcessLookupError, PermissionError):
        pass


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name}"
    return f"exited with code {exitcode}"


if __name__ == "__main__":
    # Bootstrap: only the standard library is loaded so far.
    _parent = int(sys.argv[sys.argv.index("--parent-pid") + 1])
    isolate_worker(_parent)
    # Behave as `python -m`: the working directory, not this file's folder,
    # heads the import path, so the testing modules cannot shadow others.
    sys.path[0] = os.getcwd()
    import runpy

    runpy.run_module("hyperdsd.testing.worker", run_name="__main__", alter_sys=True)
