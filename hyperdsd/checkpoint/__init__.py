"""Checkpoints through torch.distributed.checkpoint (DCP) that resume as users expect.

Checkpoints stay plain DCP directories that torch's tools read. Three ways
to write and read them, from the least to the most that is done for you:

- :class:`LoadPlanner`: the flow users already write (a template from
  ``get``, ``dcp.load``, then ``set``) with ``planner=LoadPlanner()`` as its
  only change. It resumes optimizers whose parameters never had a gradient
  (lazy state) and refuses checkpoints with partly missing state.
- :func:`save` and :func:`load`: the model, its optimizers, LR schedulers
  and any other ``Stateful`` objects in one call each.
- :class:`AppState`: a DCP ``Stateful`` over the model, optimizers and
  schedulers, the pattern of torch's DCP tutorial.

:func:`save` commits atomically (:mod:`hyperdsd.checkpoint.commit`): a save that fails
or is cut short on any rank leaves the checkpoint committed before it, and
:func:`load` takes only committed checkpoints; plain ``dcp.save`` rewrites
data files in place, so a failed save over a checkpoint loads as a mix of
both. :class:`Manager` keeps the last few of a run's checkpoints as step
directories and resumes from the newest committed one (docs/CHECKPOINTS.md).

Every problem is found while DCP plans the load, before any data is read;
DCP then raises on every rank (a ``CheckpointException`` carrying each
failing rank's error; :func:`load` turns it into one :class:`StateDictError`).
"""

from .app_state import AppState
from .load_planner import LoadPlanner
from .loading import load
from .manager import Manager
from .saving import SaveFuture, save, settle

__all__ = ["AppState", "LoadPlanner", "Manager", "SaveFuture", "load", "save", "settle"]
