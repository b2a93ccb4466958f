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

Every problem is found while DCP plans the load, before any data is read;
DCP then raises on every rank (a ``CheckpointException`` carrying each
failing rank's error; :func:`load` turns it into one :class:`StateDictError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from . import api
from .errors import StateDictError
from .options import StateDictOptions, resolve_options
from .state.dcp_template import judge, optimizer_entries, unexpected

__all__ = ["AppState", "LoadPlanner", "load", "save"]

MODEL, OPTIM, SCHEDULERS = "model", "optim", "schedulers"
_SHOWN = 10  # unexpected keys named in an error; the rest are counted


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, knowing what optimizer state may be absent.

    Pass it to ``dcp.load`` when the state dict holds optimizer state from
    ``get_optimizer_state_dict`` (nested or flat, under any key; a
    ``Stateful`` that returns one works too). Per parameter:

    - state wholly absent from the checkpoint, where the template holds
      placeholders (a never-stepped optimizer's): lazy state; the parameter
      never had a gradient when the checkpoint was saved. It is left out of
      the load, and ``set`` leaves the parameter without state.
    - state partly absent (``exp_avg`` there, ``exp_avg_sq`` or ``step`` not):
      corruption; :class:`StateDictError` names the FQN and the keys.

    Everything else stays required, as with DCP's default planner: the
    model, a stepped optimizer's state, the param groups. With ``strict``
    (the default), entries the checkpoint holds under the state dict's
    top-level keys that no rank asks for are an error too (a checkpoint of
    another model, or with more param groups). ``strict=False`` skips
    missing and unexpected entries as ``allow_partial_load=True`` does;
    partly absent state is still refused.
    """

    def __init__(self, *, strict: bool = True):
        super().__init__(allow_partial_load=not strict)
        self.strict = strict
        self.asked: set[str] = set()
        self.tops: set[str] = set()

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.asked = set(self.state_dict)
        self.tops = {str(path[0]) for path in self.mappings.values()} if self.mappings else set(self.state_dict)
        entries = optimizer_entries(self.original_state_dict, self.state_dict, self.mappings)
        drop, problems = judge(entries, metadata.state_dict_metadata, strict=self.strict)
        if problems:
            raise StateDictError("the checkpoint's optimizer state cannot be loaded:\n  " + "\n  ".join(problems))
        for key in drop:
            del self.state_dict[key]

    def create_local_plan(self):
        plan = super().create_local_plan()
        if not self.strict:
            return plan
        # Every rank's keys go to the coordinator, which alone can tell a key
        # no rank asks for (pipeline stages each ask for their own).
        return dataclasses.replace(plan, planner_data=(sorted(self.asked), sorted(self.tops)))

    def create_global_plan(self, global_plan):
        plans = super().create_global_plan(global_plan)
        if not self.strict:
            return plans
        asked: set[str] = set()
        tops: set[str] = set()
        for plan in plans:
            keys, names = plan.planner_data or ((), ())
            asked.update(keys)
            tops.update(names)
        extra = unexpected(asked, tops, self.metadata.state_dict_metadata)
        if extra:
            more = f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else ""
            raise StateDictError(
                f"the checkpoint holds entries that no rank's state dict has (strict=True; another model's checkpoint?): "
                f"{extra[:_SHOWN]}{more}"
            )
        return [dataclasses.replace(plan, planner_data=None) for plan in plans]


# -- the model, optimizers and schedulers as one state dict ------------------

def _as_list(items) -> list:
    if items is None:
        return []
    return [items] if not isinstance(items, (list, tuple)) else list(items)


def _check_extra(extra: Mapping[str, Any] | None) -> None:
    taken = sorted(set(extra or {}) & {MODEL, OPTIM, SCHEDULERS})
    if taken:
        raise StateDictError(f"extra uses the names {taken}, which hold the model, optimizers and schedulers; choose others")


def _state(model, optimizers, schedulers, extra, opts: StateDictOptions) -> dict[str, Any]:
    msd, osd = api.get_state_dict(model, optimizers, options=opts)
    state: dict[str, Any] = {MODEL: msd, OPTIM: osd}
    if schedulers:
        state[SCHEDULERS] = [s.state_dict() for s in schedulers]
    for key, obj in (extra or {}).items():
        state[key] = obj.state_dict() if isinstance(obj, Stateful) else obj
    return state


def _apply(state: dict[str, Any], model, optimizers, schedulers, extra, opts: StateDictOptions) -> None:
    """Set what DCP loaded: model and optimizers validated first, then the rest."""
    api.set_state_dict(model, optimizers, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM], options=opts)
    for scheduler, sd in zip(schedulers, state.get(SCHEDULERS, ())):
        scheduler.load_state_dict(sd)
    for key, obj in (extra or {}).items():
        if isinstance(obj, Stateful):
            obj.load_state_dict(state[key])


class AppState(Stateful):
    """A model, its optimizers and LR schedulers as one DCP ``Stateful``.

    ``state_dict()`` is ``{"model": ..., "optim": ..., "schedulers": [...]}``
    by FQN (``get_state_dict``); ``load_state_dict`` sets them back, model
    and optimizers validated together before anything changes::

        dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=path)
        dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path, planner=LoadPlanner())
    """

    def __init__(self, model, optimizers, schedulers=(), *, options: StateDictOptions | None = None):
        self.model = model
        self.optimizers = optimizers
        self.schedulers = _as_list(schedulers)
        self.options = resolve_options(options)

    def state_dict(self) -> dict[str, Any]:
        return _state(self.model, self.optimizers, self.schedulers, None, self.options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _apply(state_dict, self.model, self.optimizers, self.schedulers, None, self.options)


# -- one call each -------------------------------------------------------------

def save(checkpoint_id, model, optimizers, *, schedulers=(), extra: Mapping[str, Any] | None = None,
         options: StateDictOptions | None = None, async_save: bool = False):
    """Save the model, optimizers, schedulers and ``extra`` as a DCP checkpoint.

    The checkpoint holds ``model``, ``optim`` (by FQN), ``schedulers`` (a
    list of their state dicts, if any) and each key of ``extra`` (a
    ``Stateful``'s state dict, or any value DCP saves). Pipeline stages
    pass ``StateDictOptions(flatten_optimizer_state_dict=True)``, so that
    stages write disjoint keys. With ``async_save`` the state is staged and
    written in the background: returns the future of ``dcp.async_save``.
    """
    opts = resolve_options(options)
    _check_extra(extra)
    state = _state(model, optimizers, _as_list(schedulers), extra, opts)
    if async_save:
        return dcp.async_save(state, checkpoint_id=checkpoint_id)
    dcp.save(state, checkpoint_id=checkpoint_id)
    return None


def load(checkpoint_id, model, optimizers, *, schedulers=(), extra: Mapping[str, Any] | None = None,
         options: StateDictOptions | None = None) -> None:
    """Load what :func:`save` wrote into the model, optimizers, schedulers and ``extra``.

    Optimizers may be freshly built: parameters that had no state when the
    checkpoint was saved stay without state. A checkpoint of another model
    (FQNs it lacks or does not know, other shapes), with partly missing
    optimizer state or other param groups raises :class:`StateDictError`
    on every rank alike, before anything is changed. ``options.strict=False``
    loads what matches and leaves the rest as it is.
    """
    opts = resolve_options(options)
    _check_extra(extra)
    schedulers = _as_list(schedulers)
    state = _state(model, optimizers, schedulers, extra, opts)
    try:
        dcp.load(state, checkpoint_id=checkpoint_id, planner=LoadPlanner(strict=opts.strict))
    except CheckpointException as exc:
        raise _one_error(checkpoint_id, exc) from None
    _apply(state, model, optimizers, schedulers, extra, opts)


def _one_error(checkpoint_id, exc: CheckpointException) -> StateDictError:
    """DCP's exception (the same failures on every rank) as one message."""
    by_text: dict[str, list[int]] = {}
    for rank, (error, _trace) in sorted(exc.failures.items()):
        text = str(error) if isinstance(error, StateDictError) else f"{type(error).__name__}: {error}"
        by_text.setdefault(text, []).append(rank)
    planning = bool(exc.args) and exc.args[0] == "plan"
    outcome = "nothing was changed" if planning else "the model and optimizers may be partly loaded"
    lines = [f"checkpoint {checkpoint_id!s} cannot be loaded ({outcome}):"]
    for text, ranks in by_text.items():
        first, *rest = text.splitlines()
        lines.append(f"  on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {first}")
        lines += [f"    {line.strip()}" for line in rest]
    return StateDictError("\n".join(lines))
