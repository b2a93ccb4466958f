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

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def isolate_worker(parent_pid: int, *, forked: bool = False) -> None:
    """Detach a freshly started worker from the controller's terminal.

    The worker becomes leader of its own process group so that the
    controller can kill it together with anything it started, never receives
    the terminal's Ctrl-C (the controller handles that and kills the pool),
    and is killed by the kernel if its parent dies first: the controller, or
    for a forked worker the fork server, which ends when the controller does.
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
    if forked:
        # The fork server outlives the controller only briefly: a controller
        # still alive now means the signal was armed in time.
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
    elif os.getppid() != parent_pid:
        # The controller died before the death signal was armed.
        os._exit(1)


def worker_command(*args: str) -> list[str]:
    """The command line that starts a rank worker through this bootstrap."""
    return [sys.executable, os.path.abspath(__file__), *args]


# -- starting workers ----------------------------------------------------------
#
# A rank imports seconds of CPU before its first task: torch, then
# torch._dynamo (which optimizers and FSDP import on first use), DCP. On a
# machine of few cores, ten ranks importing them alike are a tenth of a
# suite run. Where the platform forks, a fork server (multiprocessing's)
# imports them once and every rank is forked from it: a process that has
# only imported modules, never run an op or started a thread. Elsewhere each
# rank is a fresh interpreter started through the bootstrap above.

PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "hyperdsd",
    "hyperdsd.testing.worker",
)


class SpawnedWorker:
    """A rank started as a fresh interpreter, with a waitable that becomes ready when it exits."""

    def __init__(self, args: list[str], sock, log_path: str, env: dict[str, str]):
        import subprocess

        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                worker_command(*args, "--fd", str(sock.fileno())),
                pass_fds=(sock.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                # Own session: no terminal Ctrl-C, and one group to kill.
                start_new_session=True,
            )
        self.pid = self.proc.pid
        try:
            self.sentinel = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.sentinel = None  # death is still seen as EOF on the pipe

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float) -> None:
        import subprocess

        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            pass

    def release(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


class ForkedWorker:
    """A rank forked from the fork server; the same interface as :class:`SpawnedWorker`."""

    def __init__(
        self,
        args: list[str],
        sock,
        log_path: str,
        env: dict[str, str],
        start_timeout_s: float,
        preload: tuple[str, ...] = (),
    ):
        import multiprocessing
        import threading

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([*PRELOAD, *preload])  # only read when the server starts
        self._proc = ctx.Process(
            target=_forked_main,
            args=(args, sock, log_path, env, os.getpid()),
            name=f"hyperdsd-rank-{args[args.index('--rank') + 1]}",
        )
        # start() waits, without a deadline, for the server to fork: on its
        # first use, until it has imported PRELOAD. Killing a server that
        # takes longer ends that wait with an error.
        timer = threading.Timer(start_timeout_s, _kill_fork_server)
        timer.daemon = True
        timer.start()
        try:
            self._proc.start()
        finally:
            timer.cancel()
            # multiprocessing's exit handler joins every child it started,
            # without a deadline; the pool kills and reaps its ranks itself.
            # A rank the pool never learnt of would wait for the controller
            # while the controller waited for it; not multiprocessing's child,
            # it dies with the fork server when the controller exits.
            from . import _compat  # not at the top: run as a script, this file has no package

            _compat.forget_child(self._proc)
        self.pid = self._proc.pid
        self.sentinel = self._proc.sentinel
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode if self.sentinel is not None else self._exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float) -> None:
        if self.sentinel is not None:
            self._proc.join(max(0.0, timeout))

    def release(self) -> None:
        if self.sentinel is not None and self._proc.exitcode is not None:
            self._exitcode = self._proc.exitcode
            self._proc.close()
            self.sentinel = None


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C and SIGTERM held back (in this thread) until the block ends: a
    rank started and not yet in its pool's list would be known to nobody."""
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_worker(
    args: list[str], sock, log_path: str, env: dict[str, str], start_timeout_s: float, preload: tuple[str, ...] = ()
):
    """Start one rank worker: ``args`` for ``hyperdsd.testing.worker`` but
    ``--fd``, ``sock`` the worker's end of its connection, its output
    appended to ``log_path``. ``HYPERDSD_SPAWN_RANKS=1`` starts fresh
    interpreters where ranks would be forked."""
    if sys.platform == "linux" and os.environ.get("HYPERDSD_SPAWN_RANKS") != "1":
        return ForkedWorker(args, sock, log_path, env, start_timeout_s, preload)
    return SpawnedWorker(args, sock, log_path, env)


def _kill_fork_server() -> None:
    from . import _compat

    pid = _compat.fork_server_pid()
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)  # the next start launches a new one
        except ProcessLookupError:
            pass


def stop_fork_server(timeout_s: float = 10.0) -> None:
    """Stop multiprocessing's fork server and resource tracker, if this
    process started them, and reap them: each gets ``timeout_s`` to leave,
    then SIGKILL. For a process about to exit (the CLI): left to end with
    it, they would outlive it by the seconds their own exit takes. Ranks
    forked from the server die with it (their parent-death signal)."""
    from multiprocessing import util

    from . import _compat

    with interrupts_deferred():
        pid, address = _compat.detach_fork_server()
        if pid is not None:
            _reap(pid, timeout_s)
            if address and not util.is_abstract_socket_namespace(address):
                with contextlib.suppress(OSError):
                    os.unlink(address)
        pid = _compat.detach_resource_tracker()
        if pid is not None:
            _reap(pid, timeout_s)


def _reap(pid: int, timeout_s: float) -> None:
    """Wait for a child of this process to exit, at most ``timeout_s``, then kill it."""
    import time

    deadline = time.monotonic() + timeout_s
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.005)
    except ChildProcessError:
        pass  # already reaped


def _forked_main(args: list[str], sock, log_path: str, env: dict[str, str], controller_pid: int) -> None:
    """A forked rank's first steps: what the bootstrap and Popen do for a spawned one."""
    isolate_worker(controller_pid, forked=True)
    # The fork server runs until every holder of the controller's "alive"
    # pipe has exited, and hands each child a copy: a rank holding it would
    # keep the server, whose death is the rank's own, alive after the
    # controller's. Closed, the server ends with the controller.
    from . import _compat

    _compat.close_fork_server_alive_fd()
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    from hyperdsd.testing import worker

    worker.main([*args, "--fd", str(sock.detach())])


def environment_problems() -> list[str]:
    """What in this Python environment would make every rank fail alike.

    Checked once before any rank starts, so that a broken install gives one
    clear message instead of a failure per case.
    """
    problems = []
    try:
        import numpy  # noqa: F401
    except ImportError:
        problems.append(
            "numpy is not installed, and torch.distributed's object collectives "
            "(broadcast_object_list, DCP's planning) need it: pip install numpy"
        )
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
    # By its absolute name: this file also runs as a script, the entry point of a spawned rank.
    from hyperdsd.testing.messages import STACK_SIGNAL

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
