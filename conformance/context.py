"""What a case function sees on its rank."""

from __future__ import annotations

import os

import torch.distributed as dist

from hyperdsd.testing import NotApplicable, RankContext

from .adapters import Adapter
from .registry import Case

__all__ = ["CaseContext", "NotApplicable"]


class CaseContext:
    def __init__(self, rank_ctx: RankContext, case: Case, phase: int, iut: Adapter, workdir: str):
        self.rank_ctx = rank_ctx
        self.case = case
        self.phase = phase
        self.iut = iut
        # Private to this case, shared by its ranks and phases (checkpoints live here).
        self.dir = workdir

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
