"""Layouts: how a model is laid out over ranks, and a training setup on one rank.

A :class:`Setup` is what a case trains and hands to the implementation under
test: the model (wrapped as the layout wraps it), its optimizers, and a
deterministic training loop, so that two setups built alike and trained
alike end bitwise equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from hyperdsd import _compat

from .models import OPTIMIZERS, GroupSpec, ModelConfig, ToyModel, batch, loss_fn, param_groups

# Path segments that wrappers insert and canonical FQNs leave out.
WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class Layout:
    name: str
    kind: str  # single | ddp | fsdp | hsdp | pp | ppfsdp | tp
    world_size: int
    mesh: str  # the mesh as a string, e.g. "4" or "2x2"
    dim_names: tuple[str, ...]
    pp: int = 1

    @property
    def sharded(self) -> bool:
        return self.kind in ("fsdp", "hsdp", "ppfsdp", "tp")


_PATTERNS = [
    (r"single", lambda: ("single", 1, "1", ("shard",), 1)),
    (r"ddp", lambda: ("ddp", 2, "2", ("shard",), 1)),
    (r"fsdp(\d+)", lambda n: ("fsdp", int(n), n, ("shard",), 1)),
    (r"hsdp(\d+)x(\d+)", lambda r, s: ("hsdp", int(r) * int(s), f"{r}x{s}", ("replicate", "shard"), 1)),
    (r"pp(\d+)", lambda p: ("pp", int(p), p, ("pp",), int(p))),
    (r"pp(\d+)xfsdp(\d+)", lambda p, s: ("ppfsdp", int(p) * int(s), f"{p}x{s}", ("pp", "shard"), int(p))),
    (r"fsdp(\d+)xtp(\d+)", lambda d, t: ("tp", int(d) * int(t), f"{d}x{t}", ("shard", "tp"), 1)),
]


def parse_layout(name: str) -> Layout:
    for pattern, make in _PATTERNS:
        match = re.fullmatch(pattern, name)
        if match:
            kind, ws, mesh, dims, pp = make(*match.groups())
            return Layout(name, kind, ws, mesh, dims, pp)
    raise ValueError(f"unknown layout {name!r}")


class Setup:
    """One rank's model, optimizers and training loop for a layout."""

    def __init__(
        self,
        c,
        layout: str | Layout,
        optimizer: str = "adamw",
        *,
        seed: int = 0,
        cfg: ModelConfig | None = None,
        groups: GroupSpec | None = None,
        wrappers: tuple[str, ...] = (),
        scheduler: bool = False,
        n_optimizers: int = 1,
        meta: bool = False,
        with_optimizer: bool = True,
        trainable: callable = None,
    ):
        self.c = c
        self.layout = parse_layout(layout) if isinstance(layout, str) else layout
        lay = self.layout
        if lay.world_size != c.world_size:
            raise ValueError(f"layout {lay.name} needs {lay.world_size} ranks, the world has {c.world_size}")
        self.cfg = cfg or ModelConfig()
        if self.cfg.tie and lay.pp > 1:
            raise ValueError(f"layout {lay.name}: a tied model cannot be split into pipeline stages")
        groups = groups or GroupSpec.for_seed(seed)
        self.optimizer_name = optimizer
        self.steps_done = 0
        self.mesh = c.mesh(lay.mesh, lay.dim_names) if lay.kind != "single" else None
        self.stage = self.mesh.get_coordinate()[0] if lay.pp > 1 else 0

        torch.manual_seed(seed)
        if meta:
            with torch.device("meta"):
                module = ToyModel(self.cfg)
        else:
            module = ToyModel(self.cfg)
        if lay.pp > 1:
            module.keep_stage(self.stage, lay.pp)
        if "checkpoint" in wrappers:
            for name in list(module.layers):
                module.layers[name] = _compat.checkpoint_wrapper(module.layers[name])
        self.device = c.rank_ctx.device
        if not meta and self.device.type != "cpu":
            module.to(self.device)  # built on the CPU for the same values on every device
        self.module = module
        self._shard()
        model: nn.Module = module
        if lay.kind == "ddp":
            model = nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)
        if "compile" in wrappers:
            model = torch.compile(model, backend="eager")
        self.model = model  # what the implementation under test is given

        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list = []
        if with_optimizer:
            named = [(n, p) for n, p in self.named_parameters() if trainable is None or trainable(n)]
            all_groups = param_groups(named, groups)
            chunks = [all_groups] if n_optimizers == 1 else [all_groups[:1], all_groups[1:]]
            self.optimizers = [OPTIMIZERS[optimizer](chunk) for chunk in chunks]
            if scheduler:
                self.schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in self.optimizers]
        self._pipeline = None

    # -- structure -------------------------------------------------------
    def _shard(self) -> None:
        lay = self.layout
        if not lay.sharded:
            return
        shard_mesh = self.mesh["shard"] if lay.kind in ("ppfsdp", "tp") else self.mesh
        if lay.kind == "tp":
            self._apply_tp()
        shard = self.c.iut.shard
        for block in self.module.layers.values():
            shard(block, mesh=shard_mesh)
        shard(self.module, mesh=shard_mesh)

    def _apply_tp(self) -> None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.mesh["tp"]
        for block in self.module.layers.values():
            parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Canonical FQN and parameter, tied parameters once, in registration order."""
        return [(canonical(n), p) for n, p in self.module.named_parameters()]

    def fqn_of(self) -> dict[nn.Parameter, str]:
        return {p: n for n, p in self.named_parameters()}

    def param(self, fqn: str) -> nn.Parameter:
        return dict(self.named_parameters())[fqn]

    def freeze(self, fqns) -> None:
        for fqn in fqns:
            self.param(fqn).requires_grad_(False)

    @property
    def dp(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel degree) of this rank."""
        lay = self.layout
        if lay.kind in ("single", "pp"):
            return 0, 1
        if lay.kind in ("ppfsdp", "tp"):
            return self.mesh.get_local_rank("shard"), self.mesh["shard"].size()
        return self.c.rank, self.c.world_size

    # -- training --------------------------------------------------------
    def train(self, steps: int = 1) -> None:
        # Training a model the implementation handled exercises what it did:
        # a failure there is the implementation's (see CaseContext.after_iut).
        with self.c.after_iut(self.model, "training"):
            self._train(steps)

    def _train(self, steps: int) -> None:
        for _ in range(steps):
            tokens, targets = (t.to(self.device) for t in batch(self.steps_done, 0, self.cfg))
            rank, degree = self.dp
            rows = tokens.shape[0] // degree
            tokens, targets = tokens[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]
            if self.layout.pp > 1:
                self._pipeline_step(tokens, targets)
            else:
                loss_fn(self.model(tokens), targets).backward()
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in self.schedulers:
                sched.step()
            self.steps_done += 1

    def _pipeline_step(self, tokens, targets) -> None:
        if self._pipeline is None:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            group = self.mesh.get_group("pp")
            stage = PipelineStage(self.module, self.stage, self.layout.pp, device=self.device, group=group)
            self._pipeline = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
        if self.stage == 0:
            self._pipeline.step(tokens)
        elif self.stage == self.layout.pp - 1:
            self._pipeline.step(target=targets, losses=[])
        else:
            self._pipeline.step()

    def set_steps_done(self, steps: int) -> None:
        """Line the data up with a run that already trained ``steps`` steps."""
        self.steps_done = steps
