"""A training setup on one rank: what a case trains and hands to the
implementation under test.

A :class:`Setup` is the model (laid out and wrapped as its layout says:
:mod:`conformance.world.layouts`), its optimizers, and a deterministic
training loop, so that two setups built alike and trained alike end bitwise
equal.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _compat
from ..judging import fsdp1
from ..judging.oracle import FqnOf, canonical
from .groups import GroupSpec, param_groups
from .layouts import Layout, parse_layout
from .models import ModelConfig, ToyModel, batch, loss_fn
from .optimizers import OPTIMIZERS
from .placing import model_group


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
        # Where this rank's model lives; the layout's kind fills these in.
        self.mesh = None
        self.meshes: list = []
        self.stage = 0  # pipeline stage
        self.part = 0  # which of several models on parts of the world
        self.ranks: tuple[int, ...] = tuple(range(c.world_size))  # the ranks the model spans
        lay.kind.place(self)
        self.cfg = lay.kind.model(cfg or ModelConfig(), self)
        if self.cfg.tie and lay.pp > 1:
            raise ValueError(f"layout {lay.name}: a tied model cannot be split into pipeline stages")
        groups = groups or GroupSpec.for_seed(seed)
        self.optimizer_name = optimizer
        self.steps_done = 0

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
        # FSDP1 with its original parameters keeps the very parameter objects,
        # as 1-D views of its shards: the groups by role go by their shapes
        # before the wrap.
        by_role = None
        if with_optimizer and lay.wrapper == "fsdp1" and not lay.kind.flat_params:
            by_role = param_groups(
                [(n, p) for n, p in self.named_parameters() if trainable is None or trainable(n)], groups
            )
        lay.kind.shard(self)
        model: nn.Module = lay.kind.wrap(self.module)
        if "compile" in wrappers:
            model = torch.compile(model, backend="eager")
        self.model = model  # what the implementation under test is given

        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list = []
        if with_optimizer:
            named = [(n, p) for n, p in self.named_parameters() if trainable is None or trainable(n)]
            all_groups = by_role or param_groups(named, groups)
            chunks = [all_groups] if n_optimizers == 1 else [all_groups[:1], all_groups[1:]]
            with self.stepping():
                self.optimizers = [OPTIMIZERS[optimizer](chunk) for chunk in chunks]
                if scheduler:
                    self.schedulers = [
                        torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in self.optimizers
                    ]
        self._pipeline = None

    # -- structure -------------------------------------------------------
    def stepping(self):
        """The stack's own context (``Adapter.training``, SPEC 1.6), around
        what the suite does to optimizers and parameters outside a forward and
        backward: building optimizers, stepping them, loading a model's own
        state dict. Entered around each such operation alone, never nested
        (a stack's context need not nest), and never around a call into the
        implementation. None declared: no context."""
        training = self.c.adapter.training
        return training() if training is not None else contextlib.nullcontext()

    @property
    def group(self):
        """The process group of the model's ranks (None: the whole world)."""
        return model_group(self.c, self.layout)

    @property
    def group_size(self) -> int:
        return len(self.ranks)

    @property
    def root(self) -> int:
        """The rank that holds full state dicts (full_cpu) and broadcasts them: the model's first."""
        return self.ranks[0]

    @property
    def is_root(self) -> bool:
        return self.c.rank == self.root

    def barrier(self) -> None:
        """Wait for the model's ranks (and only them)."""
        if dist.is_initialized() and self.group_size > 1:
            dist.barrier(group=self.group)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Canonical FQN and parameter, tied parameters once, in registration
        order; each parameter as the optimizer steps it, also where FSDP2
        holds the module unsharded (SPEC LOOP)."""
        stepped = _compat.stepped_parameters(self.module)
        out, seen = [], set()
        for prefix, module in self.module.named_modules():
            for name, param in _compat.own_parameters(module).items():
                if param is None:
                    continue
                param = stepped.get((id(module), name), param)
                if id(param) not in seen:
                    seen.add(id(param))
                    out.append((canonical(f"{prefix}.{name}" if prefix else name), param))
        return out

    def gathered(self) -> dict | None:
        """For FSDP1 layouts, :func:`conformance.judging.oracle.full_snapshot`'s full
        state by original parameter's FQN (FSDP1 holds flat shards, not
        DTensors); None for every other layout. Collective."""
        if self.layout.wrapper != "fsdp1":
            return None
        return fsdp1.full_snapshot(self.module, self.optimizers, self.fqn_of(), canonical)

    def fqn_of(self) -> FqnOf:
        """Parameter -> FQN; a tensor the model does not hold is named as such."""
        return FqnOf((p, n) for n, p in self.named_parameters())

    def param(self, fqn: str) -> nn.Parameter:
        return dict(self.named_parameters())[fqn]

    def freeze(self, fqns) -> None:
        params = dict(self.named_parameters())
        for fqn in fqns:
            params[fqn].requires_grad_(False)

    @property
    def dp(self) -> tuple[int, int]:
        """(data-parallel rank, data-parallel degree) of this rank."""
        return self.layout.kind.dp(self)

    # -- training --------------------------------------------------------
    def train(self, steps: int = 1) -> None:
        # Training a model the implementation handled exercises what it did:
        # a failure there is the implementation's (see CaseContext.after_iut).
        with self.c.after_iut(self.model, "training"):
            self._train(steps)

    def _train(self, steps: int) -> None:
        for _ in range(steps):
            self.forward_backward(*self.local_batch())
            self.step()

    def local_batch(self, stream: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the batch of the next step (``stream`` 0: training data)."""
        tokens, targets = (t.to(self.device) for t in batch(self.steps_done, stream, self.cfg))
        rank, degree = self.dp
        rows = tokens.shape[0] // degree
        return tokens[rank * rows : (rank + 1) * rows], targets[rank * rows : (rank + 1) * rows]

    def forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        if self.layout.pp > 1:
            self._pipeline_step(tokens, targets)
        else:
            loss_fn(self.model(tokens), targets).backward()

    def step(self) -> None:
        """The optimizers' and schedulers' step after the gradients are in; the data moves on."""
        with self.stepping():
            for opt in self.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            for sched in self.schedulers:
                sched.step()
        self.steps_done += 1

    def _pipeline_step(self, tokens, targets) -> None:
        if self._pipeline is None:
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            _compat.gloo_safe_pipeline_start()
            group = self.mesh.get_group("pp")
            stage = PipelineStage(self.module, self.stage, self.layout.pp, device=self.device, group=group)
            self._pipeline = _compat.pipeline_schedule(ScheduleGPipe, stage, 2, loss_fn)
        if self.stage == 0:
            self._pipeline.step(tokens)
        elif self.stage == self.layout.pp - 1:
            self._pipeline.step(target=targets, losses=[])
        else:
            self._pipeline.step()

    def set_steps_done(self, steps: int) -> None:
        """Line the data up with a run that already trained ``steps`` steps."""
        self.steps_done = steps

    # -- the setup's own state, no implementation involved -----------------
    def own_state(self) -> dict:
        """A copy of everything training changes. Optimizer state is copied
        as it is held, by parameter: torch's own Optimizer.load_state_dict
        would turn a string in the state into a generator's text."""
        from ..judging.oracle import clone_tree

        return {
            "model": clone_tree(self.module.state_dict()),
            "optimizers": [
                (
                    {p: clone_tree(dict(st)) for p, st in o.state.items()},
                    [{k: clone_tree(v) for k, v in g.items() if k != "params"} for g in o.param_groups],
                )
                for o in self.optimizers
            ],
            "schedulers": [clone_tree(s.state_dict()) for s in self.schedulers],
            "steps_done": self.steps_done,
        }

    def load_own_state(self, state: dict) -> None:
        """Put back what :meth:`own_state` copied (consumes it)."""
        with torch.no_grad(), self.stepping():
            self.module.load_state_dict(state["model"])
        for opt, (per_param, groups) in zip(self.optimizers, state["optimizers"], strict=True):
            opt.state.clear()
            opt.state.update(per_param)
            for group, fields in zip(opt.param_groups, groups, strict=True):
                group.update(fields)
        for sched, st in zip(self.schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(st)
        self.steps_done = state["steps_done"]
