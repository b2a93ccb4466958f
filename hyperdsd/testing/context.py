"""What a task sees on its rank (rank, world size, device, meshes, a private
cache, the code under test it is in) and how one task runs there."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable

from . import messages as m
from .mesh import MeshSpec, build_mesh, parse_mesh
from .status import RankStatus


class NotApplicable(Exception):
    """Raised by a task (on every rank alike) when it does not apply here."""


class RankContext:
    """Per-process state that outlives a single task.

    Meshes are expensive to create (a 2-D mesh creates subgroups, which is a
    collective) so they are made once per world and reused by every task;
    they are dropped when the rank leaves its process group.
    """

    def __init__(self, rank: int, world_size: int, workdir: str, device_type: str = "cpu", local_rank: int = 0):
        self.rank = rank
        self.world_size = world_size
        self.workdir = workdir
        self.device_type = device_type
        self.local_rank = local_rank
        self.cache: dict[Any, Any] = {}
        self._meshes: dict[MeshSpec, Any] = {}
        # The code under test this rank is running now ("" outside it). Kept
        # in a file too, so that a controller can read where a rank hung or died.
        self.region = ""
        self._region_fd: int | None = None
        if workdir:
            self._region_fd = os.open(os.path.join(workdir, f"rank{rank}.region"), os.O_WRONLY | os.O_CREAT, 0o600)

    @property
    def device(self):
        """The device this rank computes on: the CPU, or its accelerator by local rank."""
        import torch

        if self.device_type == "cpu":
            return torch.device("cpu")
        module = getattr(torch, self.device_type, None)
        count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
        return torch.device(self.device_type, self.local_rank % count if count else self.local_rank)

    def mesh(self, spec: str | MeshSpec, dim_names: tuple[str, ...] | None = None):
        spec = parse_mesh(spec, dim_names)
        if spec.size != self.world_size:
            raise ValueError(f"mesh {spec} has {spec.size} ranks but the world has {self.world_size}")
        if spec not in self._meshes:
            self._meshes[spec] = build_mesh(spec, self.device_type)
        return self._meshes[spec]

    def reset(self) -> None:
        """Forget meshes and cached objects: they belong to process groups that are gone."""
        self._meshes.clear()
        self.cache.clear()

    @contextlib.contextmanager
    def under_test(self, label: str):
        """Run a block of the code under test: a failure inside it (raising,
        hanging, dying) is a verdict on that code, not on the task."""
        outer = self.region
        self._set_region(label)
        try:
            yield
        except BaseException as exc:
            if not region_of(exc):
                try:
                    setattr(exc, REGION_ATTR, label)
                except (AttributeError, TypeError):
                    pass
            raise
        finally:
            self._set_region(outer)

    def _set_region(self, label: str) -> None:
        self.region = label
        if self._region_fd is not None:
            data = label.encode()
            os.pwrite(self._region_fd, data, 0)
            os.ftruncate(self._region_fd, len(data))

    def group_sequences(self) -> dict[tuple[int, ...], int] | None:
        """Sequence numbers of every process group this rank is in.

        Ranks whose numbers differ for a group have issued a different number
        of collectives on it: the group is out of step and must not be reused.
        """
        import torch.distributed as dist

        from . import _compat

        if not dist.is_initialized():
            return {}
        try:
            return {ranks: _compat.collectives_issued(pg) for ranks, pg in _compat.member_groups(self.rank).items()}
        except Exception:
            return None  # unknown: the controller treats the groups as suspect

    def collectives_issued(self) -> int:
        """Collectives this rank has issued on all its process groups so far
        (a check that an error came before any collective compares two reads)."""
        import torch.distributed as dist

        from . import _compat

        if not dist.is_initialized():
            return 0
        return sum(_compat.collectives_issued(pg) for pg in _compat.member_groups(dist.get_rank()).values())


REGION_ATTR = "__hyperdsd_region__"


def region_of(exc: BaseException) -> str:
    """The ``under_test`` block ``exc`` left ("" when it was raised outside any)."""
    return getattr(exc, REGION_ATTR, "")


def select_device(device_type: str, local_rank: int) -> None:
    """Make this rank's accelerator (by local rank) the current one, where the
    device type has that notion (``torch.cuda``, ``torch.xpu``, ...)."""
    import torch

    module = getattr(torch, device_type, None)
    count = module.device_count() if module is not None and hasattr(module, "device_count") else 0
    if count and hasattr(module, "set_device"):
        module.set_device(local_rank % count)


def read_region(workdir: str, rank: int) -> str:
    """Where a rank of a pool was last (see RankContext.under_test)."""
    try:
        with open(os.path.join(workdir, f"rank{rank}.region"), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def resolve(ref: str) -> Callable:
    module_name, _, attr = ref.partition(":")
    if not attr:
        raise ValueError(f"task function {ref!r}: expected 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _reset_torch_globals() -> None:
    """Undo global state a task may have changed, so the next task starts clean."""
    import torch

    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _children() -> set[int]:
    """PIDs of this process's live children."""
    pids: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids.update(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


def _describe_pid(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        return f"pid {pid} ({cmdline[:80]})"
    except OSError:
        return f"pid {pid}"


def _leaks(threads_before: set[int], children_before: set[int]) -> list[str]:
    """Threads and child processes the task left behind; the processes are killed."""
    leaks = [f"thread {t.name!r}" for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    for pid in sorted(_children() - children_before):
        leaks.append(f"process {_describe_pid(pid)}, killed")
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (OSError, ChildProcessError):
            pass
    return leaks


def execute(ctx: RankContext, task: m.Task) -> m.RankResult:
    """Run ``task`` on this rank and describe how it went; never raises."""
    start = time.perf_counter()
    result = m.RankResult(rank=ctx.rank, status=RankStatus.PASSED)
    threads_before = {t.ident for t in threading.enumerate()}
    children_before = _children()
    try:
        result.value = resolve(task.fn)(ctx, **dict(task.kwargs))
    except NotApplicable as exc:
        result.status, result.message = RankStatus.NOT_APPLICABLE, str(exc)
    except BaseException as exc:  # noqa: BLE001 - a task's SystemExit is a failure too
        result.status = RankStatus.RAISED
        result.exc_type = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
        result.message = str(exc) or repr(exc)
        result.traceback = traceback.format_exc()
        result.region = region_of(exc)
        result.check = isinstance(exc, AssertionError)
    finally:
        try:
            _reset_torch_globals()
        except Exception:
            pass
    result.duration_s = time.perf_counter() - start
    result.pg_sequence = ctx.group_sequences()
    result.leaks = _leaks(threads_before, children_before)
    return result


def worker_env() -> dict[str, str]:
    """Environment for spawned ranks: loopback only, one intra-op thread."""
    return {"GLOO_SOCKET_IFNAME": os.environ.get("HYPERDSD_GLOO_IFNAME", "lo")}
