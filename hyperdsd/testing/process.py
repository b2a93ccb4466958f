"""Process hygiene for rank workers: isolation from the terminal, death with
the controller, stack dumps on request, and killing whole process trees."""

from __future__ import annotations

import ctypes
import os
import signal

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
