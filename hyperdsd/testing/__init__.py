"""A multi-process test harness for distributed PyTorch code on CPU.

Spawns ranks that join a gloo process group once and then run task after
task (``fn(ctx, **kwargs)`` on every rank), with a deadline per task, a
verdict from every rank, stacks from any rank that hangs, and no process
left behind. Under ``torchrun`` the same tasks run on the launched world.
"""

from .context import NotApplicable, RankContext
from .mesh import MeshSpec, parse_mesh
from .messages import RankResult, Task
from .process import environment_problems
from .pool import PoolSet, PoolStartError, TaskOutcome, WorkerPool
from .world import ExistingWorld, launched_by_torchrun

__all__ = [
    "ExistingWorld",
    "MeshSpec",
    "NotApplicable",
    "PoolSet",
    "PoolStartError",
    "RankContext",
    "RankResult",
    "Task",
    "TaskOutcome",
    "WorkerPool",
    "environment_problems",
    "launched_by_torchrun",
    "parse_mesh",
]
