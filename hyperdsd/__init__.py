"""hyperdsd: distributed state dicts for PyTorch models and optimizers.

A drop-in for ``torch.distributed.checkpoint.state_dict``: the same
functions and options, with optimizer state keyed by FQN that survives
FSDP2, HSDP, pipeline stages and resharding through DCP, gets that never
change the optimizer, and sets that validate before they change anything.
:mod:`hyperdsd.checkpoint` resumes training through DCP (a load planner,
one-call save/load, and a ``Stateful``).
"""

from . import checkpoint
from .api import (
    get_model_state_dict,
    get_optim_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optim_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from .errors import StateDictError
from .options import StateDictOptions

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
