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

import torch.distributed as dist

from hyperdsd.testing import NotApplicable, RankContext, region_of

from ..adapters import COMBINED, FUNCTIONS, Adapter, iut_call, raised_by_iut
from ..judging.oracle import CheckFailure
from ..judging.received import Received
from .registry import Case

__all__ = ["CaseContext", "NotApplicable"]

# Adapter members that run the IUT's code.
_IUT_CALLS = frozenset(FUNCTIONS + COMBINED) | {"options", "shard"}


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
                try:
                    with self._c.rank_ctx.under_test(name), iut_call() if whole else contextlib.nullcontext():
                        result = value(*args, **kwargs)
                except NotImplementedError as exc:
                    if raised_by_iut(exc):
                        raise
                    raise NotApplicable(f"the adapter of {self._adapter.name} refused {name}: {exc}") from None
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

    def stumbled(self, exc: Exception) -> CheckFailure | None:
        """The verdict when the case's own code raised ``exc`` outside any IUT
        call: a failure naming what the IUT returned, where that broke torch's
        promise (SPEC §4: its output is input); None where nothing did, and
        the error is the suite's."""
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

    def after_iut(self, model, what: str):
        """``what`` on a model the IUT was given runs under test, named after
        the IUT call it follows; on an untouched model it is the suite's own."""
        fn = self._touched.get(id(model))
        return self.under_test(f"{what} after {fn}") if fn else contextlib.nullcontext()
