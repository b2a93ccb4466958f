"""The models, optimizers and data every case trains.

Small enough that a case takes well under a second. The base model has what
every model has: several layers, persistent and non-persistent buffers,
a parameter with fewer rows than ranks (uneven and empty
shards), and several param groups with their own hyperparameters. What
breaks state-dict code in one particular way is a *feature* a case turns on
only where its clause names it (SPEC §2, isolation): a tied weight
(``tie``), a parameter that never gets a gradient (``lazy``: no optimizer
state), a frozen parameter (``frozen``), an adapter the checkpoint lacks
(``adapter``), a router in every block that never gets a gradient
(``router``: lazy state in the middle of the model), extra state in every
block (``extra_state``: MODEL-5); empty groups, custom group fields and schedulers are set up
by the cases that need them. Layouts that place parts of a model on meshes
of their own use a mixture of experts (``experts``): a router and a stacked
expert weight ``[experts, dim, dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .. import tensors


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 16
    dim: int = 8
    hidden: int = 12
    n_layers: int = 2
    aux_out: int = 3
    dtype: torch.dtype = torch.float32
    # Features (off in the base model):
    tie: bool = False  # the head shares the embedding's weight
    # ``aux`` never gets a gradient (lazy optimizer state) when True; when
    # False it gets a zero gradient and state like every other parameter.
    lazy_aux: bool = False
    frozen: bool = False  # a module with requires_grad=False from the start
    adapter: bool = False  # an extra trainable module, as fine-tuning adds
    # Each block has a router run under no_grad (hard routing, as MoE gates):
    # in the middle of the model, in groups with parameters that do step,
    # it never gets a gradient and so never gets optimizer state.
    router: bool = False
    experts: int = 0  # a mixture of that many experts after the layers (0: none)
    # Extra state in every block (MODEL-5): "tensor", "dict" or "object" (any
    # picklable value); "": none, as in the base model of every other clause.
    extra_state: str = ""
    # Many keys (SPEC SCALE, 1.5): ``lanes`` tiny ``Linear(LANE, LANE)`` layers in
    # every block, each adding to the first LANE features; the lanes named in
    # ``lazy_lanes`` (block, lane) never run, so they never get a gradient;
    # the block ``other_dtype_block`` is in float64 (a second dtype amid the rest).
    lanes: int = 0
    lazy_lanes: tuple[tuple[int, int], ...] = ()
    other_dtype_block: int = -1

    def everything(self, pipeline: bool = False) -> "ModelConfig":
        """Every feature at once (pipeline stages cannot tie across stages)."""
        return replace(self, tie=not pipeline, lazy_aux=True, frozen=True)


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab, cfg.dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, cfg.dim))
        self.register_buffer("cache", torch.zeros(cfg.dim), persistent=False)

    def forward(self, tokens):
        return self.embedding(tokens) * self.scale


LANE = 3  # a lane's width (ModelConfig.lanes)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(cfg.dim)
        self.fc1 = nn.Linear(cfg.dim, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, cfg.dim)
        # Many keys: lanes of LANE rows (uneven shards on 2 and 4 ranks, empty ones on 4).
        self.lanes = nn.ModuleList(nn.Linear(LANE, LANE) for _ in range(cfg.lanes)) if cfg.lanes else None
        self.running = [i for i in range(cfg.lanes) if (index, i) not in cfg.lazy_lanes]
        # Fewer rows than ranks: its shards are uneven, some empty.
        self.router = nn.Linear(cfg.dim, cfg.aux_out) if cfg.router else None
        # In float64 amid a model of another dtype (ModelConfig.other_dtype_block): it computes in its own.
        self.own_dtype = torch.float64 if index == cfg.other_dtype_block else None

    def forward(self, x):
        if self.own_dtype is not None:
            return self._forward(x.to(self.own_dtype)).to(x.dtype)
        return self._forward(x)

    def _forward(self, x):
        out = self.fc2(torch.relu(self.fc1(self.norm(x))))
        if self.lanes is not None:
            # Every running lane at once (a few ops, not hundreds), each through a
            # tanh of its own, so that each lane's gradient is its own.
            weights = torch.stack([self.lanes[i].weight for i in self.running])
            biases = torch.stack([self.lanes[i].bias for i in self.running])
            lanes = torch.tanh(torch.einsum("...i,loi->...lo", x[..., :LANE], weights) + biases).sum(-2)
            out = out + F.pad(lanes, (0, x.shape[-1] - LANE))
        if self.router is not None:
            with torch.no_grad():  # a hard routing decision: no gradient reaches the router
                gate = torch.softmax(self.router(x), dim=-1).amax(dim=-1, keepdim=True)
            out = out * gate
        return x + out


@dataclass(frozen=True)
class Marker:
    """An arbitrary picklable object as extra state (MODEL-5); allowed for
    ``torch.load(weights_only=True)``, as a library registers its own types."""

    index: int
    name: str


torch.serialization.add_safe_globals([Marker])


class ExtraStateBlock(Block):
    """A block whose extra state is its ``index``, as a value of the kind its
    config names; it travels through the model state dict under
    ``layers.N._extra_state`` like any other entry (MODEL-5)."""

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        self.kind = cfg.extra_state

    def get_extra_state(self):
        if self.kind == "tensor":
            return torch.tensor([float(self.index), 0.5])
        if self.kind == "dict":
            return {"index": self.index, "name": f"block{self.index}", "history": [self.index, -1]}
        return Marker(self.index, f"block{self.index}")

    def set_extra_state(self, state):
        if self.kind == "tensor":
            self.index = int(state[0].item())
        elif self.kind == "dict":
            self.index = int(state["index"])
        else:
            self.index = state.index


class _DataParallelWeight(torch.autograd.Function):
    """A weight a layout distributed itself (a distributed value that no FSDP
    manages): gathered whole for the forward; its gradient averaged over every
    rank of the world (each computed it on its own rows of the batch), as FSDP
    and DDP average theirs, then cut to this rank's block. Deterministic: one
    all-reduce leaves the same sum on every rank."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return tensors.full(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad)
        grad = grad / dist.get_world_size()
        weight = ctx.weight
        start, rows = tensors.block_start(weight, dist.get_rank()), tensors.local(weight).shape
        block = grad[tuple(slice(at, at + n) for at, n in zip(start, rows))]
        return tensors.like(weight, block.contiguous())


def whole(weight: torch.Tensor) -> torch.Tensor:
    """The weight a forward computes with (FSDP hands over plain tensors; see above for the rest)."""
    return _DataParallelWeight.apply(weight) if tensors.is_distributed(weight) else weight


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cfg.experts, cfg.dim) * 0.3)

    def forward(self, x):
        return torch.softmax(x @ whole(self.weight).T, dim=-1)


class Experts(nn.Module):
    """Every expert's weight in one stacked tensor, as grouped-GEMM MoE layers keep them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cfg.experts, cfg.dim, cfg.dim) * 0.3)

    def forward(self, x, gates):
        # Every token through every expert, weighted by its gates: the same
        # numbers whichever rank holds which expert.
        out = torch.einsum("...d,edk->...ek", x, whole(self.weight))
        return (gates.unsqueeze(-1) * out).sum(-2)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x):
        return x + self.experts(x, self.router(x))


class ToyModel(nn.Module):
    def __init__(self, cfg: ModelConfig = ModelConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = Embed(cfg)
        block = ExtraStateBlock if cfg.extra_state else Block
        self.layers = nn.ModuleDict({str(i): block(cfg, i) for i in range(cfg.n_layers)})
        self.moe = MoE(cfg) if cfg.experts else None
        self.frozen = nn.Linear(cfg.dim, cfg.dim) if cfg.frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.aux = nn.Linear(cfg.dim, cfg.aux_out)  # never used in forward
        self.adapter = nn.Linear(cfg.dim, cfg.dim) if cfg.adapter else None
        if cfg.tie:
            self.head.weight = self.tok.embedding.weight
        if cfg.dtype != torch.float32:
            self.to(cfg.dtype)
        if 0 <= cfg.other_dtype_block < cfg.n_layers:
            self.layers[str(cfg.other_dtype_block)].to(torch.float64)

    def forward(self, x):
        h = self.tok(x) if self.tok is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.moe is not None:
            h = self.moe(h)
        if self.head is None:
            return h
        if self.frozen is not None:
            h = h + self.frozen(h)
        if not self.cfg.lazy_aux:
            h = h + 0.0 * self.aux(h).sum(-1, keepdim=True)
        if self.adapter is not None:
            h = h + self.adapter(h)
        return self.head(self.norm(h))

    def keep_stage(self, stage: int, n_stages: int) -> "ToyModel":
        """Drop what another pipeline stage owns; the rest keeps its original FQNs."""
        if self.cfg.tie and n_stages > 1:
            raise ValueError("a tied model cannot be split into pipeline stages")
        n = self.cfg.n_layers
        mine = range(stage * n // n_stages, (stage + 1) * n // n_stages)
        for name in list(self.layers):
            if int(name) not in mine:
                del self.layers[name]
        if stage != 0:
            self.tok = None
        if stage != n_stages - 1:
            self.frozen = self.norm = self.head = self.aux = self.adapter = None
        return self


def batch(step: int, seed: int, cfg: ModelConfig, rows: int = 12, seq: int = 4):
    """The global batch for ``step``: the same on every rank and every layout."""
    gen = torch.Generator().manual_seed(10_000 * seed + step)
    tokens = torch.randint(0, cfg.vocab, (rows, seq), generator=gen)
    targets = torch.randint(0, cfg.vocab, (rows, seq), generator=gen)
    return tokens, targets


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
