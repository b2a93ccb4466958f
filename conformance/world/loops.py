"""Points of a training loop where a state dict is taken or loaded (SPEC LOOP).

A :class:`LoopPoint` splits one training step in two: ``reach`` runs from
rest (right after the last optimizer step) up to the point, ``finish`` from
the point to the end of the step. A loop that stops at the point and goes
on is ``reach`` then ``finish``, the same as a loop that never stopped
there: the uninterrupted run of every LOOP case.

The points are what real loops do around a checkpoint: an evaluation
forward (``no_grad`` or ``inference_mode``) that leaves parameters unsharded
where the layout's policy does not reshard after forward; an explicit
``unshard()``; gradients present after backward (a preemption handler);
and between micro-batches of gradient accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .. import _compat
from ..judging.oracle import snapshot
from .layouts import Layout
from .placing import model_group
from .setup import Setup

# Where evaluation batches come from: data no training step uses.
EVAL_STREAM = 7


def _fsdp_modules(setup: Setup) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in setup.model.modules() if isinstance(m, FSDPModule)]


def _eval_forward(setup: Setup, grad_mode) -> None:
    """One evaluation forward of this rank's model (a pipeline stage on an
    input of its own: a stage's forward is what unshards its parameters)."""
    tokens, _ = setup.local_batch(EVAL_STREAM)
    setup.model.eval()
    with grad_mode():
        if setup.layout.pp > 1 and setup.stage > 0:
            gen = torch.Generator().manual_seed(setup.stage)
            hidden = torch.randn(*tokens.shape, setup.cfg.dim, generator=gen, dtype=setup.cfg.dtype).to(setup.device)
            setup.model(hidden)
        else:
            setup.model(tokens)
    setup.model.train()


def _train_step(setup: Setup) -> None:
    setup.forward_backward(*setup.local_batch())
    setup.step()


def _unshard(setup: Setup) -> None:
    for module in _fsdp_modules(setup):
        module.unshard()


def _backward(setup: Setup) -> None:
    setup.forward_backward(*setup.local_batch())


def _halves(setup: Setup):
    tokens, targets = setup.local_batch()
    cut = tokens.shape[0] // 2
    return (tokens[:cut], targets[:cut]), (tokens[cut:], targets[cut:])


def _gradient_sync(setup: Setup, on: bool) -> None:
    """Turn gradient synchronisation off for the first micro-batches, on for the last."""
    fsdp = _fsdp_modules(setup)
    if fsdp:
        for module in fsdp:
            module.set_requires_gradient_sync(on, recurse=False)
    elif isinstance(setup.model, torch.nn.parallel.DistributedDataParallel):
        if not on:
            setup.loop_no_sync = setup.model.no_sync()
            setup.loop_no_sync.__enter__()
        else:
            setup.loop_no_sync.__exit__(None, None, None)


def _first_micro_batch(setup: Setup) -> None:
    _gradient_sync(setup, False)
    setup.forward_backward(*_halves(setup)[0])


def _last_micro_batch(setup: Setup) -> None:
    _gradient_sync(setup, True)
    setup.forward_backward(*_halves(setup)[1])
    setup.step()


def _sharded_by_fsdp(layout: Layout) -> str | None:
    return None if layout.wrapper == "fsdp2" else "unshard() is FSDP2's"


def _not_pipelined(layout: Layout) -> str | None:
    # A pipeline schedule runs its micro-batches inside one call: no point between them is reachable.
    return "a pipeline schedule accumulates inside one step" if layout.pp > 1 else None


def _anywhere(layout: Layout) -> str | None:
    return None


def _no_fsdp_accumulation(layout: Layout) -> str | None:
    # FSDP2 keeps a partial accumulation in its unsharded gradients, which no
    # public call clears: after a rollback there, the next step would add it.
    if layout.wrapper == "fsdp2":
        return "FSDP2 keeps the partial accumulation where no public call clears it"
    return _not_pipelined(layout)


def _drop_gradients(setup: Setup) -> None:
    for opt in setup.optimizers:
        opt.zero_grad(set_to_none=True)


def _drop_accumulation(setup: Setup) -> None:
    _gradient_sync(setup, True)
    _drop_gradients(setup)


@dataclass(frozen=True)
class LoopPoint:
    name: str
    what: str
    reach: Callable[[Setup], None]
    finish: Callable[[Setup], None]
    applies: Callable[[Layout], str | None] = _anywhere  # None, or why the point is not on the layout
    rollback: Callable[[Layout], str | None] = _anywhere  # ... for a set there (LOOP-2)
    # What a loop that rolls back at the point drops of the step it abandons.
    abandon: Callable[[Setup], None] = _drop_gradients
    # Whether the step through the point is a plain training step (nothing
    # but where the loop stops differs): its uninterrupted run is the plain run.
    plain: bool = True

    def replay(self, setup: Setup) -> None:
        """The step a job resuming from a checkpoint taken at the point runs
        again: a plain step, or the micro-batches of an accumulation."""
        if self.plain:
            _train_step(setup)
        else:
            self.reach(setup)
            self.finish(setup)


POINTS = {
    p.name: p
    for p in (
        LoopPoint(
            "eval", "after an evaluation forward under no_grad", lambda s: _eval_forward(s, torch.no_grad), _train_step
        ),
        LoopPoint(
            "infer",
            "after an evaluation forward under inference_mode",
            lambda s: _eval_forward(s, torch.inference_mode),
            _train_step,
        ),
        LoopPoint("unshard", "after an explicit unshard()", _unshard, _train_step, _sharded_by_fsdp, _sharded_by_fsdp),
        LoopPoint("grads", "after backward, gradients present", _backward, lambda s: s.step()),
        LoopPoint(
            "accum",
            "between micro-batches of gradient accumulation",
            _first_micro_batch,
            _last_micro_batch,
            _not_pipelined,
            _no_fsdp_accumulation,
            _drop_accumulation,
            plain=False,
        ),
    )
}


def reach(setup: Setup, point: LoopPoint) -> None:
    with setup.c.after_iut(setup.model, f"the loop up to the point ({point.what})"):
        point.reach(setup)


def finish(setup: Setup, point: LoopPoint) -> None:
    with setup.c.after_iut(setup.model, f"the loop from the point ({point.what})"):
        point.finish(setup)


def sharding_state(setup: Setup) -> list[tuple[str, str, int]]:
    """What each module holds under each parameter name, by identity: FSDP2
    swaps sharded and unsharded parameters there as it reshards."""
    return [
        (prefix, name, id(p))
        for prefix, module in setup.model.named_modules()
        for name, p in _compat.own_parameters(module).items()
        if p is not None
    ]


def uninterrupted(c, how, before: int, point: LoopPoint, after: int) -> dict:
    """The snapshot of ``how`` (seed 0) trained ``before`` steps, through one
    step stopped at ``point`` and gone on, and ``after - 1`` steps more; kept
    per rank (no implementation touches it). Where the step is plain, that is
    the plain run that every resume case shares."""
    from . import resuming

    if point.plain:
        return resuming.trained_source(c, how, before, after=after).expected
    key = ("loop-run", how, before, point.name, after)
    (have,) = resuming.kept_everywhere(c, (key,), model_group(c, how.layout))
    if have:
        return resuming.keep(c, key, c.rank_ctx.cache[key])
    setup = how.build(c, 0)
    setup.train(before)
    point.reach(setup)
    point.finish(setup)
    setup.train(after - 1)
    return resuming.keep(c, key, snapshot(setup))
