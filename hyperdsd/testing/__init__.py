"""A multi-process test harness for distributed PyTorch code on CPU (or an
accelerator).

Spawns ranks that join a process group once and then run task after task
(``fn(ctx, **kwargs)`` on every rank), with a deadline per task, a verdict
from every rank, stacks from any rank that hangs, and no process left
behind. Under ``torchrun`` the same tasks run on the launched world, on
sub-worlds of it where a task needs fewer ranks.
"""

from .context import NotApplicable, RankContext, region_of
from .executor import Executor
from .mesh import MeshSpec, parse_mesh
from .messages import REGIONS, WHOLE_TASK, RankResult, Task
from .outcome import TaskOutcome, judge
from .pool import PoolStartError, WorkerPool
from .pool_set import PoolSet
from .process import environment_problems, stop_fork_server
from .status import RankStatus, Status
from .world import TorchrunWorld, WorldLost, launched_by_torchrun

__all__ = [
    "Executor",
    "MeshSpec",
    "NotApplicable",
    "PoolSet",
    "PoolStartError",
    "REGIONS",
    "RankContext",
    "RankResult",
    "RankStatus",
    "Status",
    "Task",
    "TaskOutcome",
    "TorchrunWorld",
    "WHOLE_TASK",
    "WorkerPool",
    "WorldLost",
    "environment_problems",
    "judge",
    "launched_by_torchrun",
    "parse_mesh",
    "region_of",
    "stop_fork_server",
]
