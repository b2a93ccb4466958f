"""A run's checkpoints as step directories, the last few kept, resumed from the newest committed."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from ..errors import StateDictError
from ..options import StateDictOptions
from . import commit
from .loading import load
from .saving import _agreed, _path, _save, settle


class Manager:
    """Checkpoints of a run as step directories ``root/step-{n}``, the last ``keep`` of them kept.

    Each :meth:`save` commits atomically (as :func:`save`); once it is
    committed, rank 0 removes committed steps older than the newest
    ``keep`` ones (never the one just saved: ``keep`` is at least 1).
    :meth:`latest` is the newest committed step, skipping steps whose save
    did not finish; :meth:`load` resumes from it::

        manager = Manager("checkpoints/run", keep=3)
        start = manager.load(model, optimizer) if manager.latest() is not None else 0
        for step in range(start + 1, steps + 1):
            train_one_step()
            if step % 100 == 0:
                manager.save(step, model, optimizer)

    ``storage_writer`` and ``storage_reader`` are DCP's, used for every
    save and load. With a process group, call every method on every rank:
    rank 0 looks at the directory and tells the others.
    """

    def __init__(
        self,
        root,
        keep: int = 3,
        *,
        options: StateDictOptions | None = None,
        storage_writer: StorageWriter | None = None,
        storage_reader: StorageReader | None = None,
    ):
        if int(keep) < 1:
            raise ValueError(f"keep must be at least 1 (the checkpoint just saved), not {keep}")
        self.root = _path(root)
        self.keep = int(keep)
        self.options = options
        self.storage_writer = storage_writer
        self.storage_reader = storage_reader

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def save(
        self,
        step: int,
        model,
        optimizers,
        *,
        schedulers=(),
        extra: Mapping[str, Any] | None = None,
        async_save: bool = False,
    ):
        """:func:`save` to ``root/step-{step}``; then the steps beyond the newest ``keep`` are removed."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        return _save(
            self.path(step),
            model,
            optimizers,
            schedulers,
            extra,
            self.options,
            async_save,
            self.storage_writer,
            after_commit=self._prune,
        )

    def latest(self) -> int | None:
        """The newest step with a committed checkpoint, or None (after :func:`settle`)."""
        settle()
        return _agreed(self._latest_here)

    def load(
        self, model, optimizers, *, schedulers=(), extra: Mapping[str, Any] | None = None, step: int | None = None
    ) -> int:
        """Load the newest committed step (or ``step``) as :func:`load` does; returns its step."""
        if step is None:
            step = self.latest()
            if step is None:
                raise StateDictError(f"there is no committed checkpoint under {self.root}")
        load(
            self.path(step),
            model,
            optimizers,
            schedulers=schedulers,
            extra=extra,
            options=self.options,
            storage_reader=self.storage_reader,
        )
        return step

    def _steps(self) -> list[int]:
        """Steps named in ``root`` (committed or not), newest first."""
        if not self.root.is_dir():
            return []
        found = set()
        for name in os.listdir(self.root):
            match = _STEP.fullmatch(name)
            if match:
                found.add(int(match.group(1)))
        return sorted(found, reverse=True)

    def _latest_here(self) -> int | None:
        for step in self._steps():
            if commit.resolve(self.path(step))[0] is not None:
                return step
        return None

    def _prune(self) -> None:
        """On rank 0, after a commit: remove committed steps beyond the newest ``keep``."""
        committed = [s for s in self._steps() if (self.path(s) / commit.RECORD).is_file()]
        for step in committed[self.keep :]:
            # Into the trash, atomically: each rank removes its own files from there.
            with contextlib.suppress(OSError):
                commit.to_trash(self.path(step))


_STEP = re.compile(r"\.?step-(\d+)(?:\.previous)?")  # step-{n}, and .step-{n}.previous (a commit cut short)
