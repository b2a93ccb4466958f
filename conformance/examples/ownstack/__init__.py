"""ownstack: a stand-in for a vendor's own distributed stack (the worked example of SPEC 1.6).

Its distributed tensor (:class:`SplitTensor`) is not torch's DTensor, its
mesh (:class:`Mesh`) and placements (:class:`Shard`, :class:`Replicate`) are
its own, and so are its ``fully_shard``, its state-dict functions
(:mod:`.state_dict`, torch's names and signatures) and its checkpoint format
(:mod:`.checkpoint`). As with the vendor stacks it stands in for, torch
operations on its tensors are refused outside its dispatch context
:func:`local_ops`; the optimizer steps and loads inside it, and keeps plain
local blocks as its state.
"""

from .mesh import Mesh
from .sharding import default_placements, fully_shard, units_of
from .tensor import Replicate, Shard, SplitTensor, distribute, in_local_ops, local_ops

__all__ = [
    "checkpoint",
    "state_dict",
    "Mesh",
    "Replicate",
    "Shard",
    "SplitTensor",
    "default_placements",
    "distribute",
    "fully_shard",
    "in_local_ops",
    "local_ops",
    "units_of",
]

from . import checkpoint, state_dict  # noqa: E402  (they import the names above)
