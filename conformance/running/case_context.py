"""What a case function sees on its rank, and the boundary between the suite
and the implementation under test (IUT).

Every call a case makes through ``c.iut`` runs as code under test (see
``RankContext.under_test``): a failure inside it, a hang in it or in a
collective it issued, is a verdict on the IUT (``failed``); a failure of the
suite's own code elsewhere is an ``error``. Work that only exercises what the
IUT produced (training a model it loaded, DCP saving a dict it returned)
runs under test too, labelled as such.

Within an adapter's call, the implementation's own code is what runs in
``conformance.adapters.iut_call`` (for adapters whose functions are the
implementation's, the whole call). An adapter's refusal (``Unsupported`` or
``NotImplementedError`` raised outside it) makes the case not applicable.
"""

from __future__ import annotations

import contextlib
import os
import traceback

import torch
import torch.distributed as dist

from hyperdsd.testing import NotApplicable, RankContext, region_of

from ..adapters import COMBINED, FUNCTIONS, Adapter, iut_call, raised_by_iut
from ..judging.handled import Handled, changes
from ..judging.naming import name_tensors, show
from ..judging.oracle import CheckFailure
from ..judging.received import Received
from .registry import Case

__all__ = ["CaseContext", "NotApplicable"]

# Adapter members that run the IUT's code (a stack's own mesh and checkpoint too, SPEC 1.6).
_IUT_CALLS = frozenset(FUNCTIONS + COMBINED) | {"options", "shard", "mesh", "save_checkpoint", "load_checkpoint"}


def _handed(name: str, args: tuple, kwargs: dict) -> tuple | None:
    """(model, optimizers) a get or a set of the IUT is handed; None for other calls."""
    if name not in FUNCTIONS and name not in COMBINED:
        return None
    model = args[0] if args else kwargs.get("model")
    optimizers = None
    if "optimizer" in name or name in COMBINED:
        optimizers = args[1] if len(args) > 1 else kwargs.get("optimizers")
    return model, optimizers


class JudgedAdapter:
    """The adapter as cases see it: every IUT call runs under test, and the
    setup whose model it was given remembers that the IUT touched it."""

    def __init__(self, adapter: Adapter, c: "CaseContext"):
        self._adapter = adapter
        self._c = c
        self._calls: dict[str, object] = {}

    def __getattr__(self, name: str):
        value = getattr(self._adapter, name)
        if name not in _IUT_CALLS or not callable(value):
            return value
        if name not in self._calls:
            whole = self._adapter.functions_are_iut

            def call(*args, **kwargs):
                if args:
                    self._c.touched(args[0], name)
                handed = _handed(name, args, kwargs)
                before = Handled.of(*handed) if handed else None
                try:
                    with self._c.rank_ctx.under_test(name), iut_call() if whole else contextlib.nullcontext():
                        result = value(*args, **kwargs)
                except NotImplementedError as exc:
                    if raised_by_iut(exc):
                        raise
                    raise NotApplicable(f"the adapter of {self._adapter.name} refused {name}: {exc}") from None
                finally:
                    if before is not None:
                        self._c.received.note_changes(name, changes(before, Handled.of(*handed)))
                self._c.received.note(name, args, kwargs, result)
                return result

            self._calls[name] = call
        return self._calls[name]


class CaseContext:
    def __init__(
        self, rank_ctx: RankContext, case: Case, phase: int, iut: Adapter, workdir: str, deadline_s: float = 60.0
    ):
        self.rank_ctx = rank_ctx
        self.deadline_s = deadline_s  # this phase's, as the runner enforces it
        self.case = case
        self.phase = phase
        self.adapter = iut
        self.iut = JudgedAdapter(iut, self)
        # Private to this case, shared by its ranks and phases (checkpoints live here).
        self.dir = workdir
        # id(model) -> the IUT function that last received it (see touched()).
        self._touched: dict[int, str] = {}
        self._models: dict[int, object] = {}  # the models handed to the IUT, to name their tensors
        # What the IUT's gets and sets returned here, judged when the case stumbles (SPEC §4).
        self.received = Received()

    @property
    def rank(self) -> int:
        return self.rank_ctx.rank

    @property
    def world_size(self) -> int:
        return self.rank_ctx.world_size

    @property
    def clause(self) -> str:
        return self.case.clause

    def mesh(self, spec: str, dim_names: tuple[str, ...] | None = None):
        return self.rank_ctx.mesh(spec, dim_names)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def under_test(self, label: str):
        """Work that exercises what the IUT produced: its failures are the IUT's."""
        return self.rank_ctx.under_test(label)

    def touched(self, model, fn: str) -> None:
        self._touched[id(model)] = fn
        self._models[id(model)] = model

    def name_tensors(self, exc: BaseException) -> None:
        """Let ``exc``'s text name the tensors it was raised with (a KeyError
        on a parameter, say) by FQN, type, shape and dtype, never by their
        values (SPEC §4, 1.4): its arguments are rewritten in place."""
        if not any(isinstance(a, torch.Tensor) or (isinstance(a, str) and "tensor(" in a) for a in exc.args):
            return
        names: dict[int, str] = {}
        for model in self._models.values():
            names.update(Handled.of(model, None).names())
        try:
            exc.args = tuple(
                show(a, names) if isinstance(a, torch.Tensor) else name_tensors(a) if isinstance(a, str) else a
                for a in exc.args
            )
        except (AttributeError, TypeError):  # an exception type whose args are fixed
            pass

    def stumbled(self, exc: Exception) -> CheckFailure | None:
        """The verdict when the case's own code raised ``exc`` outside any IUT
        call: a failure naming what the IUT returned, where that broke torch's
        promise, and what its calls did to the objects they were handed (SPEC
        §4: both are input); None where nothing did, and the error is the
        suite's."""
        if isinstance(exc, (AssertionError, NotApplicable)) or region_of(exc):
            return None
        surprises = self.received.surprises()
        if not surprises:
            return None
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {os.path.relpath(frame.filename)}:{frame.lineno}" if frame else ""
        return CheckFailure(
            "\n".join(surprises) + f"\n(the case could not go on with it: {type(exc).__name__}: {str(exc)[:300]}{at})"
        )

    def note_changes(self, exc: BaseException) -> None:
        """Add to a failure's message what the IUT's calls did to the objects
        they were handed, which the failure may follow from (a difference,
        training that cannot go on); on its own line, outside the message's
        first two, by which reports group failures."""
        changed = self.received.changes()
        if changed and len(exc.args) == 1 and isinstance(exc.args[0], str):
            try:
                exc.args = (exc.args[0] + "\n(" + "\n".join(changed) + ")",)
            except (AttributeError, TypeError):
                pass

    def after_iut(self, model, what: str):
        """``what`` on a model the IUT was given runs under test, named after
        the IUT call it follows; on an untouched model it is the suite's own."""
        fn = self._touched.get(id(model))
        return self.under_test(f"{what} after {fn}") if fn else contextlib.nullcontext()
