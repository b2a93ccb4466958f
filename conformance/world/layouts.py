"""Layouts: how a model is laid out over ranks, and a training setup on one rank.

Layouts are data: each family is one :class:`LayoutKind` entry in
:data:`KINDS` (its name pattern, meshes, how it places and shards a model,
its data parallelism, the clauses it serves), and a name such as ``fsdp4``
or ``fsdp4+ep2x2`` parses into a :class:`Layout` of one of them.

A :class:`Setup` is what a case trains and hands to the implementation under
test: the model (wrapped as the layout wraps it), its optimizers, and a
deterministic training loop, so that two setups built alike and trained
alike end bitwise equal.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import _compat
from . import policies
from .models import OPTIMIZERS, GroupSpec, ModelConfig, ToyModel, batch, loss_fn, param_groups

# FSDP2 layouts train on CPU ranks; torch 2.6 needs this to run them there.
_compat.fsdp2_on_cpu()

# Path segments that wrappers insert and canonical FQNs leave out.
WRAPPER_SEGMENTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


@dataclass(frozen=True)
class Layout:
    """A named layout: its world, the meshes it builds, how it lays a model out."""

    name: str
    kind: "LayoutKind" = field(repr=False)
    world_size: int
    meshes: tuple[tuple[str, tuple[str, ...]], ...]  # (shape, dim names) of each mesh, e.g. ("2x2", ("ep", "dp"))
    pp: int = 1
    args: tuple[int, ...] = ()  # the numbers in the name
    policy: str = ""  # the FSDP2 policy variant after a dot (``fsdp4.bf16``; SPEC §2), "" for the base

    @property
    def base(self) -> str:
        """The layout's name without its policy variant."""
        return self.name.partition(".")[0]

    @property
    def mesh(self) -> str:
        """The main mesh (the one dense layers are sharded on), as a string."""
        return self.meshes[0][0]

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self.meshes[0][1]

    @property
    def mesh_specs(self) -> tuple[str, ...]:
        return tuple(spec for spec, _ in self.meshes)

    @property
    def spans(self) -> list[tuple[int, ...]]:
        """The ranks of each model (one model over the world, unless the kind places several)."""
        sizes = self.args if self.kind.parts else (self.world_size,)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [tuple(range(start, start + n)) for start, n in zip(starts, sizes)]


@dataclass(frozen=True)
class LayoutKind:
    """One family of layouts, as data: adding a layout is one entry in
    :data:`KINDS` plus, where no existing one fits, its sharding function.

    ``pattern`` matches names (its groups are the numbers in them);
    ``make(*numbers)`` gives (world size, meshes, pipeline stages);
    ``place(setup)`` builds this rank's meshes (every rank builds every mesh
    alike: creating one is a collective) and says which ranks the rank's
    model spans; ``shard(setup)`` lays the built model out (the adapter's
    own ``shard`` for what FSDP would shard); ``dp(setup)`` is the rank's
    (data-parallel rank, degree); ``model(cfg, setup)`` adjusts the model
    config; ``parts``: the numbers in the name are the sizes of disjoint
    parts of the world, one model each; ``serves`` lists the clauses whose
    sections take their layouts from here (:func:`serving`), with the
    layouts they run on.
    """

    name: str
    pattern: str
    make: Callable[..., tuple[int, tuple, int]]
    place: Callable[["Setup"], None]
    shard: Callable[["Setup"], None]
    dp: Callable[["Setup"], tuple[int, int]]
    model: Callable[[ModelConfig, "Setup"], ModelConfig] = lambda cfg, setup: cfg
    wrap: Callable[[nn.Module], nn.Module] = lambda module: module
    parts: bool = False
    serves: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # FSDP1 (SPEC §2, 1.3): the suite wraps with torch's FullyShardedDataParallel;
    # ``flat``: use_orig_params=False (the optimizer holds flat parameters).
    fsdp1: bool = False
    flat: bool = False


# -- how each kind builds its meshes ---------------------------------------


def _no_mesh(setup: "Setup") -> None:
    setup.mesh = None


def _world_mesh(setup: "Setup") -> None:
    """The layout's meshes over the whole world; the first is the model's."""
    meshes = [setup.c.mesh(spec, dims) for spec, dims in setup.layout.meshes]
    setup.mesh, setup.meshes = meshes[0], meshes


def _stages(setup: "Setup") -> None:
    _world_mesh(setup)
    setup.stage = setup.mesh.get_coordinate()[0]


def _parts(setup: "Setup") -> None:
    """Disjoint parts of the world (as many as the name has numbers), each
    with its own 1-D mesh; the rank's model lives on its own part's."""
    spans = setup.layout.spans
    meshes = submeshes(setup.c, spans)
    setup.part = next(i for i, span in enumerate(spans) if setup.c.rank in span)
    setup.ranks, setup.mesh, setup.meshes = spans[setup.part], meshes[setup.part], meshes


def model_group(c, layout: str):
    """The process group of this rank's model on ``layout`` (None: the whole world)."""
    lay = parse_layout(layout)
    if not lay.kind.parts:
        return None
    spans = lay.spans
    return submeshes(c, spans)[next(i for i, span in enumerate(spans) if c.rank in span)].get_group()


def submeshes(c, spans: list[tuple[int, ...]]) -> list:
    """A 1-D mesh over each span of ranks, built once per world on every rank
    alike (a mesh over part of the world is still made by all of it).

    Its dim is named ``part``, a name no other layout uses: torch 2.6 to 2.9
    compare meshes by ranks and dim names, and DTensor's caches and mesh
    registry would hand a model on ranks 2-3 the ``shard`` slice of an
    earlier case's pp x shard mesh over the same ranks, with that mesh's
    groups (one program would not build both)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = ("submeshes", tuple(spans))
    if key not in c.rank_ctx.cache:
        device = c.rank_ctx.device_type
        c.rank_ctx.cache[key] = [DeviceMesh(device, list(span), mesh_dim_names=("part",)) for span in spans]
    return c.rank_ctx.cache[key]


# -- how each kind shards a model ------------------------------------------


def _unsharded(setup: "Setup") -> None:
    pass


def _blocks_and_root(setup: "Setup", mesh) -> None:
    shard, policy = setup.c.iut.shard, setup.layout.policy
    blocks = list(setup.module.layers.values())
    for i, block in enumerate(blocks):
        shard(block, mesh=mesh, **policies.arguments(policy, "last" if i == len(blocks) - 1 else "block", setup))
    shard(setup.module, mesh=mesh, **policies.arguments(policy, "root", setup))


def _fsdp(setup: "Setup") -> None:
    _blocks_and_root(setup, setup.mesh)


def _fsdp_on_shard_dim(setup: "Setup") -> None:
    _blocks_and_root(setup, setup.mesh["shard"])


def _tp_then_fsdp(setup: "Setup") -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in setup.module.layers.values():
        parallelize_module(block, setup.mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    _fsdp_on_shard_dim(setup)


def _dense_children(setup: "Setup", *, skip: tuple[str, ...]) -> None:
    """Every module but the experts' own fully sharded over the world, each on
    its own (the root is not: it would take over the parameters the layout
    placed itself)."""
    shard, mesh, module = setup.c.iut.shard, setup.mesh, setup.module
    for block in module.layers.values():
        shard(block, mesh=mesh)
    for name in ("tok", "norm", "head", "aux"):
        shard(getattr(module, name), mesh=mesh)
    for name in ("router", "experts"):
        if name not in skip:
            shard(getattr(module.moe, name), mesh=mesh)


def _experts_on_ep_mesh(setup: "Setup") -> None:
    """Experts over ``ep`` (whole experts per rank), each expert's rows over
    ``dp``: a 2-D DTensor on the ``ep x dp`` mesh; the rest as FSDP lays it."""
    from torch.distributed.tensor import Shard

    _place(setup.module.moe.experts, setup.meshes[1], [Shard(0), Shard(1)])
    _dense_children(setup, skip=("experts",))


def _router_replicated(setup: "Setup") -> None:
    """The router replicated on a sub-mesh (the ``rep`` slice of the second
    mesh), as tensor-parallel layers keep their norms; the rest as FSDP lays it."""
    from torch.distributed.tensor import Replicate

    _place(setup.module.moe.router, setup.meshes[1]["rep"], [Replicate()])
    _dense_children(setup, skip=("router",))


def _place(module: nn.Module, mesh, placements) -> None:
    with torch.no_grad():
        module.weight = nn.Parameter(_compat.distribute_locally(module.weight.detach(), mesh, placements))


def _experts(cfg: ModelConfig, setup: "Setup") -> ModelConfig:
    return replace(cfg, experts=4)


def _second_model_differs(cfg: ModelConfig, setup: "Setup") -> ModelConfig:
    """Each sub-world's model is another model (as an actor and a critic are)."""
    return replace(cfg, n_layers=cfg.n_layers + setup.part)


def _fsdp1_units(setup: "Setup", *, flat: bool, strategy: str) -> None:
    """FSDP1 (torch's ``FullyShardedDataParallel``) on every block, then on the
    root, with ``device_id`` the rank's device (SPEC §2). The suite wraps with
    torch's own class, whatever the implementation under test: it is judged on
    its state-dict functions, and FSDP1 has no sharding API to adapt (FSDP2's
    ``fully_shard`` is the adapter's ``shard``). ``setup.module`` becomes the
    root wrapper: its own ``state_dict`` (FSDP1's full state dict, canonical
    keys) is the suite's reference way for the model."""
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    kwargs = {"device_id": setup.device, "use_orig_params": not flat, "sharding_strategy": ShardingStrategy[strategy]}
    if strategy == "HYBRID_SHARD":
        kwargs["device_mesh"] = setup.mesh
    module = setup.module
    with warnings.catch_warnings():  # FSDP1's deprecation notice, and its notes on CPU devices
        warnings.simplefilter("ignore")
        for name in list(module.layers):
            module.layers[name] = FSDP(module.layers[name], **kwargs)
        setup.module = FSDP(module, **kwargs)


# -- data parallelism -------------------------------------------------------


def _no_dp(setup: "Setup") -> tuple[int, int]:
    return 0, 1


def _world_dp(setup: "Setup") -> tuple[int, int]:
    return setup.c.rank, setup.c.world_size


def _shard_dim_dp(setup: "Setup") -> tuple[int, int]:
    return setup.mesh.get_local_rank("shard"), setup.mesh["shard"].size()


def _part_dp(setup: "Setup") -> tuple[int, int]:
    return setup.ranks.index(setup.c.rank), len(setup.ranks)


def _ddp(module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module, find_unused_parameters=True)


KINDS: tuple[LayoutKind, ...] = (
    LayoutKind("single", r"single", lambda: (1, (("1", ("shard",)),), 1), _no_mesh, _unsharded, _no_dp),
    LayoutKind("ddp", r"ddp", lambda: (2, (("2", ("shard",)),), 1), _world_mesh, _unsharded, _world_dp, wrap=_ddp),
    LayoutKind("fsdp", r"fsdp(\d+)", lambda n: (n, ((f"{n}", ("shard",)),), 1), _world_mesh, _fsdp, _world_dp),
    LayoutKind(
        "hsdp",
        r"hsdp(\d+)x(\d+)",
        lambda r, s: (r * s, ((f"{r}x{s}", ("replicate", "shard")),), 1),
        _world_mesh,
        _fsdp,
        _world_dp,
    ),
    LayoutKind("pp", r"pp(\d+)", lambda p: (p, ((f"{p}", ("pp",)),), p), _stages, _unsharded, _no_dp),
    LayoutKind(
        "ppfsdp",
        r"pp(\d+)xfsdp(\d+)",
        lambda p, s: (p * s, ((f"{p}x{s}", ("pp", "shard")),), p),
        _stages,
        _fsdp_on_shard_dim,
        _shard_dim_dp,
    ),
    LayoutKind(
        "tp",
        r"fsdp(\d+)xtp(\d+)",
        lambda d, t: (d * t, ((f"{d}x{t}", ("shard", "tp")),), 1),
        _world_mesh,
        _tp_then_fsdp,
        _shard_dim_dp,
    ),
    # A mixture of experts: dense layers sharded over the world, the experts
    # on an ``ep x dp`` mesh of their own (OPT-MESH-1).
    LayoutKind(
        "ep",
        r"fsdp(\d+)\+ep(\d+)x(\d+)",
        lambda n, e, d: (n, ((f"{n}", ("shard",)), (f"{e}x{d}", ("ep", "dp"))), 1),
        _world_mesh,
        _experts_on_ep_mesh,
        _world_dp,
        model=_experts,
        serves=(("OPT-MESH-1", ("fsdp4+ep2x2",)),),
    ),
    # ... with an expert-parallel degree of 1: the stacked experts FSDP-sharded on dim 0.
    LayoutKind(
        "ep1",
        r"fsdp(\d+)\+ep1",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        lambda setup: _dense_children(setup, skip=()),
        _world_dp,
        model=_experts,
        serves=(("OPT-MESH-1", ("fsdp4+ep1",)),),
    ),
    # ... with the router replicated on sub-meshes of ``rep`` ranks.
    LayoutKind(
        "rep",
        r"fsdp(\d+)\+rep(\d+)",
        lambda n, r: (n, ((f"{n}", ("shard",)), (f"{n // r}x{r}", ("group", "rep"))), 1),
        _world_mesh,
        _router_replicated,
        _world_dp,
        model=_experts,
        serves=(("OPT-MESH-1", ("fsdp4+rep2",)),),
    ),
    # FSDP1 (SPEC §2, 1.3): FullyShardedDataParallel on every block and the root.
    LayoutKind(
        "fsdp1",
        r"fsdp1-(\d+)",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        lambda setup: _fsdp1_units(setup, flat=False, strategy="FULL_SHARD"),
        _world_dp,
        fsdp1=True,
    ),
    LayoutKind(
        "fsdp1-flat",
        r"fsdp1-(\d+)-flat",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        lambda setup: _fsdp1_units(setup, flat=True, strategy="FULL_SHARD"),
        _world_dp,
        fsdp1=True,
        flat=True,
    ),
    # SHARD_GRAD_OP: parameters stay unsharded from the forward to the backward.
    LayoutKind(
        "fsdp1-shard_grad_op",
        r"fsdp1-(\d+)-shard_grad_op",
        lambda n: (n, ((f"{n}", ("shard",)),), 1),
        _world_mesh,
        lambda setup: _fsdp1_units(setup, flat=False, strategy="SHARD_GRAD_OP"),
        _world_dp,
        fsdp1=True,
    ),
    LayoutKind(
        "hsdp1",
        r"hsdp1-(\d+)x(\d+)",
        lambda r, s: (r * s, ((f"{r}x{s}", ("replicate", "shard")),), 1),
        _world_mesh,
        lambda setup: _fsdp1_units(setup, flat=False, strategy="HYBRID_SHARD"),
        _world_dp,
        fsdp1=True,
    ),
    # Models on disjoint parts of the world, each fully sharded on its own
    # mesh (colocated trainers: an actor on ranks 0-1, a critic on 2-3).
    LayoutKind(
        "halves",
        r"halves(\d+)\+(\d+)",
        lambda a, b: (a + b, ((f"{a}+{b}", ("shard",)),), 1),
        _parts,
        _fsdp,
        _part_dp,
        model=_second_model_differs,
        parts=True,
        serves=(("OPT-MESH-2", ("halves2+2",)),),
    ),
)


def parse_layout(name: str) -> Layout:
    base, dot, policy = name.partition(".")
    for kind in KINDS:
        match = re.fullmatch(kind.pattern, base)
        if match:
            if dot and (kind.name not in policies.KINDS or policy not in policies.VARIANTS):
                raise ValueError(
                    f"unknown layout {name!r}: policy variants ({', '.join(policies.VARIANTS)}) "
                    f"apply to the {' and '.join(policies.KINDS)} layouts"
                )
            numbers = tuple(int(g) for g in match.groups())
            world_size, meshes, pp = kind.make(*numbers)
            return Layout(name, kind, world_size, meshes, pp, numbers, policy)
    raise ValueError(f"unknown layout {name!r}")


def serving(clause: str) -> tuple[str, ...]:
    """The layouts whose kinds say they serve ``clause``."""
    return tuple(name for kind in KINDS for c, names in kind.serves if c == clause for name in names)


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
        if with_optimizer and lay.kind.fsdp1 and not lay.kind.flat:
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
            self.optimizers = [OPTIMIZERS[optimizer](chunk) for chunk in chunks]
            if scheduler:
                self.schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.8) for o in self.optimizers]
        self._pipeline = None

    # -- structure -------------------------------------------------------
    @property
    def group(self):
        """The process group of the model's ranks (None: the whole world)."""
        return model_group(self.c, self.layout.name)

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
        """For FSDP1 layouts, :func:`conformance.oracle.full_snapshot`'s full
        state by original parameter's FQN (FSDP1 holds flat shards, not
        DTensors); None for every other layout. Collective."""
        if not self.layout.kind.fsdp1:
            return None
        return _compat.fsdp1_full_snapshot(self.module, self.optimizers, self.fqn_of(), canonical)

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
        from ..oracle import clone_tree

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
        with torch.no_grad():
            self.module.load_state_dict(state["model"])
        for opt, (per_param, groups) in zip(self.optimizers, state["optimizers"], strict=True):
            opt.state.clear()
            opt.state.update(per_param)
            for group, fields in zip(opt.param_groups, groups, strict=True):
                group.update(fields)
        for sched, st in zip(self.schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(st)
        self.steps_done = state["steps_done"]
