"""hyperdsd: distributed state dicts for PyTorch models and optimizers.

A drop-in for ``torch.distributed.checkpoint.state_dict``: the same
functions and options, with optimizer state keyed by FQN that survives
FSDP2, HSDP, pipeline stages and resharding through DCP, gets that never
change the optimizer, and sets that validate before they change anything.
:mod:`hyperdsd.checkpoint` resumes training through DCP (a load planner,
one-call save/load, and a ``Stateful``).
"""

import re as _re

import torch as _torch

# pyproject.toml's floor. Checked first, so that an older torch gets this one
# error rather than an ImportError or AttributeError from deep inside.
MIN_TORCH = (2, 6)
_found = tuple(int(x) for x in _re.match(r"(\d+)\.(\d+)", str(_torch.__version__)).groups())
if _found < MIN_TORCH:
    raise ImportError(
        f"hyperdsd needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or later, found torch {_torch.__version__}: it is "
        "tested from 2.6 on, the first release with FSDP2 public as torch.distributed.fsdp.fully_shard "
        "(docs/TORCH_RELEASES.md)"
    )

from . import checkpoint  # noqa: E402
from .api import (  # noqa: E402
    get_model_state_dict,
    get_optim_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optim_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .errors import StateDictError  # noqa: E402
from .options import StateDictOptions  # noqa: E402

__version__ = "0.2.0"

# Optional conformance profiles this implementation claims (see SPEC.md §4).
CONFORMANCE_PROFILES = ("inplace", "multi-optimizer", "tp")
# The documented DCP load path (SPEC.md §2): a planner factory for dcp.load.
DCP_LOAD_PLANNER = checkpoint.LoadPlanner

__all__ = [
    "StateDictError",
    "checkpoint",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optim_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optim_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]
