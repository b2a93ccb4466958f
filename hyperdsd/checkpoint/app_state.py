"""The model, its optimizers, schedulers and extra objects as one state dict, and as a DCP ``Stateful``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from .. import api
from ..errors import StateDictError
from ..options import StateDictOptions, resolve_options

MODEL, OPTIM, SCHEDULERS = "model", "optim", "schedulers"


def _as_list(items) -> list:
    if items is None:
        return []
    return [items] if not isinstance(items, (list, tuple)) else list(items)


def _check_extra(extra: Mapping[str, Any] | None) -> None:
    taken = sorted(set(extra or {}) & {MODEL, OPTIM, SCHEDULERS})
    if taken:
        raise StateDictError(
            f"extra uses the names {taken}, which hold the model, optimizers and schedulers; choose others"
        )


def _state(model, optimizers, schedulers, extra, opts: StateDictOptions, *, to_load: bool = False) -> dict[str, Any]:
    get = api.load_template if to_load else api.get_state_dict
    msd, osd = get(model, optimizers, options=opts)
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
