"""A generated scenario: one model, optimizer, layout and mode as data.

A :class:`Scenario` is a small frozen record, JSON-serialisable: the model's
sizes and features, the optimizer and its parameter groups, the layout and
mode, the steps before and after the save, a fresh or a warm target. It says
what it builds (:meth:`Scenario.recipe`) and whether it is valid; which
clauses it exercises, and their cases, are ``conformance.running.generated``'s;
drawing and shrinking scenarios is ``conformance.exploring``'s.

This module is imported on every rank: it needs nothing beyond the suite.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import zlib
from dataclasses import dataclass, fields

from .. import modes
from ..modes import MODES, Mode, mode_of
from .catalog import BASE
from .layouts import POLICY_KINDS, Layout, Move, parse_layout

TOKEN_PREFIX = "s1."

# The layouts and optimizers scenarios draw from: the matrix's own, layouts
# by world size (hypothesis shrinks towards the first).
DRAWN = {lay.name: lay for lay in sorted(BASE, key=lambda lay: lay.world_size)}
DRAWN_LAYOUTS = tuple(DRAWN)
OPTIMIZERS = ("adamw", "sgd", "adagrad", "adam_amsgrad", "sgd_plain", "custom")
DTYPES = ("float32", "float64", "bfloat16")
EXTRA_STATE = ("", "tensor", "dict", "object")
MODEL_KEYS = ("", "strict", "nonstrict")
# The order of the groups: by role (""), reversed in source and target alike,
# or reversed in the target only (a load must pair groups by their FQNs: OPT-KEYS-1).
GROUP_ORDERS = ("", "reversed", "reversed-target")
MODEL_KEYS_MODES = (modes.SHARDED, modes.FULL, modes.BCAST, modes.FILE)  # MODEL-2's: a model dict a rank can edit
# The modes a checkpoint can also be loaded on another layout in (OPT-RESHARD-1 and -3).
RESHARD_MODES = (modes.DCP, modes.BCAST)


@dataclass(frozen=True)
class Scenario:
    """One generated scenario. Defaults are the matrix's base model and setup."""

    layout: str = "single"
    mode: str = "sharded"
    optimizer: str = "adamw"
    # The model (conformance.world.models.ModelConfig)
    vocab: int = 16
    dim: int = 8
    hidden: int = 12
    n_layers: int = 2
    aux_out: int = 3
    dtype: str = "float32"
    tie: bool = False
    lazy: bool = False
    frozen: bool = False
    adapter: bool = False
    router: bool = False
    extra_state: str = ""
    # Parameter groups (conformance.world.models.GroupSpec)
    one_group: bool = False  # every parameter in one group, instead of split by role
    empty_at: tuple[int, ...] = ()  # positions of groups without parameters
    router_group: bool = False
    custom_fields: bool = False  # extra fields on every group
    scale: float = 1.0  # every group's lr and weight decay, scaled
    scheduler: bool = False
    group_order: str = ""  # one of GROUP_ORDERS
    # Steps
    before: int = 1
    after: int = 1
    warm: int = 0  # steps the target trains on its own before the load (0: fresh)
    # Resharding: a second layout the checkpoint is also loaded on (dcp and bcast only); "": none
    reshard_to: str = ""
    # MODEL-2: the model dict loses a key and gains one before a "strict" or "nonstrict" load; "": not checked
    model_keys: str = ""
    # An FSDP2 policy variant of an fsdp or hsdp layout (conformance.world.policies; LOOP-3); "": the base layout's
    policy: str = ""
    # A point of the loop where the get is taken, and, with a warm target, the set (conformance.world.loops; LOOP-1,
    # LOOP-2); "": at rest
    loop_point: str = ""
    # The first block is frozen after training, before the save, and in the target too (OPT-PART-3)
    freeze_after: bool = False

    # -- serialisation -----------------------------------------------------
    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["empty_at"] = list(self.empty_at)
        # Fields added after scenarios were saved are left out at their
        # default, so that those scenarios keep their tokens and case IDs.
        for name in _LATER_FIELDS:
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "Scenario":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"scenario has unknown fields {unknown}")
        data = dict(data)
        if "empty_at" in data:
            data["empty_at"] = tuple(int(i) for i in data["empty_at"])
        s = cls(**data)
        s.validate()
        return s

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def token(self) -> str:
        """The replay token: ``s1.`` and the compressed JSON, URL-safe base64."""
        return TOKEN_PREFIX + base64.urlsafe_b64encode(zlib.compress(self.to_json().encode(), 9)).decode().rstrip("=")

    @classmethod
    def from_token(cls, token: str) -> "Scenario":
        token = token.strip()
        if not token.startswith(TOKEN_PREFIX):
            raise ValueError(f"not a scenario token (expected it to start with {TOKEN_PREFIX!r}): {token[:40]!r}")
        body = token[len(TOKEN_PREFIX) :]
        try:
            text = zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))).decode()
            data = json.loads(text)
        except (ValueError, zlib.error) as exc:
            raise ValueError(f"scenario token does not decode: {exc}") from None
        return cls.from_dict(data)

    @property
    def digest(self) -> str:
        return hashlib.sha1(self.to_json().encode()).hexdigest()[:10]

    # -- what it builds ----------------------------------------------------
    def validate(self) -> None:
        problems = []
        if self.layout not in DRAWN_LAYOUTS:
            problems.append(f"layout {self.layout!r} is not one of {DRAWN_LAYOUTS}")
        if not modes.is_mode(self.mode):
            problems.append(f"mode {self.mode!r} is not one of {MODES}")
        if self.optimizer not in OPTIMIZERS:
            problems.append(f"optimizer {self.optimizer!r} is not one of {OPTIMIZERS}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype {self.dtype!r} is not one of {DTYPES}")
        if self.extra_state not in EXTRA_STATE:
            problems.append(f"extra_state {self.extra_state!r} is not one of {EXTRA_STATE}")
        for name in ("vocab", "dim", "hidden", "n_layers", "aux_out", "after"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if self.before < 0 or self.warm < 0:
            problems.append("before and warm must not be negative")
        if self.layout in DRAWN_LAYOUTS:
            pp = DRAWN[self.layout].pp
            if self.tie and pp > 1:
                problems.append(f"a tied model cannot be split into pipeline stages ({self.layout})")
            if self.n_layers < pp:
                problems.append(f"{self.layout} needs at least {pp} layers")
        if self.router_group and not self.router:
            problems.append("router_group needs router")
        if self.reshard_to:
            problems += reshard_problems(self)
        if self.group_order not in GROUP_ORDERS:
            problems.append(f"group_order {self.group_order!r} is not one of {GROUP_ORDERS}")
        if self.model_keys not in MODEL_KEYS:
            problems.append(f"model_keys {self.model_keys!r} is not one of {MODEL_KEYS}")
        elif self.model_keys and (
            not modes.is_mode(self.mode)
            or self.kind not in MODEL_KEYS_MODES
            or self.layout not in DRAWN_LAYOUTS
            or self.pp > 1
        ):
            problems.append(
                f"model_keys are checked in the modes {', '.join(map(str, MODEL_KEYS_MODES))} without pipeline stages"
            )
        problems += self._loop_problems()
        if self.freeze_after and (self.before < 1 or (self.layout in DRAWN_LAYOUTS and self.pp > 1)):
            problems.append("freeze_after needs a first step (before >= 1) and no pipeline stages")
        if problems:
            raise ValueError("invalid scenario: " + "; ".join(problems))

    def _loop_problems(self) -> list[str]:
        from . import loops, policies

        if self.layout not in DRAWN_LAYOUTS:
            return []
        lay, out = DRAWN[self.layout], []
        if self.policy:
            if self.policy not in policies.VARIANTS:
                out.append(f"policy {self.policy!r} is not one of {tuple(policies.VARIANTS)}")
            elif not lay.kind.policies:
                out.append(f"policies apply to the {' and '.join(POLICY_KINDS)} layouts, not {self.layout}")
            elif self.policy == "reshard2" and lay.world_size % 2:
                out.append(f"reshard_after_forward=2 needs an even number of ranks, {self.layout} has {lay.world_size}")
        if self.loop_point:
            point = loops.POINTS.get(self.loop_point)
            if point is None:
                out.append(f"loop_point {self.loop_point!r} is not one of {tuple(loops.POINTS)}")
            elif (why := point.applies(lay)) is not None:
                out.append(f"loop_point {self.loop_point!r} is not on {self.layout}: {why}")
            if self.before < 1:
                out.append("a loop point comes after a first step (before >= 1)")
        return out

    @property
    def where(self) -> str:
        """The layout the scenario builds: its name with the policy variant, if any."""
        return f"{self.layout}.{self.policy}" if self.policy else self.layout

    @functools.cached_property
    def built_on(self) -> Layout:
        """The layout the scenario builds, as the object cases take (parsed once, here: a record holds names)."""
        return parse_layout(self.where)

    @property
    def move(self) -> Move:
        """Where a scenario resharded to ``reshard_to`` saves and loads."""
        return Move(self.built_on, DRAWN[self.reshard_to])

    @property
    def kind(self) -> Mode:
        """The scenario's mode, as the object cases take."""
        return mode_of(self.mode)

    def cfg(self):
        import torch

        from .models import ModelConfig

        return ModelConfig(
            vocab=self.vocab,
            dim=self.dim,
            hidden=self.hidden,
            n_layers=self.n_layers,
            aux_out=self.aux_out,
            dtype=getattr(torch, self.dtype),
            tie=self.tie,
            lazy_aux=self.lazy,
            frozen=self.frozen,
            adapter=self.adapter,
            router=self.router,
            extra_state=self.extra_state,
        )

    def groups(self):
        from .groups import GroupSpec

        extra = (("custom", 7), ("tag", "scenario")) if self.custom_fields else ()
        return GroupSpec(
            split=not self.one_group,
            empty_at=self.empty_at,
            scale=self.scale,
            extra=extra,
            router_group=self.router_group,
            reverse=self.group_order == "reversed",
        )

    def recipe(self):
        from . import resuming

        return resuming.recipe(self.built_on, self.optimizer, cfg=self.cfg(), groups=self.groups())

    @property
    def world_size(self) -> int:
        return DRAWN[self.layout].world_size

    def trained_args(self, **more) -> dict:
        """The arguments of a check that trains the scenario's recipe."""
        return {"layout": self.built_on, "opt": self.optimizer, "mode": self.kind, "how": self.recipe(), **more}

    @property
    def pp(self) -> int:
        return DRAWN[self.layout].pp

    def describe(self) -> str:
        """What differs from the base scenario, in words."""
        base = Scenario()
        model = [f"{n}={getattr(self, n)}" for n in ("vocab", "dim", "hidden", "n_layers", "aux_out")]
        features = [n for n in ("tie", "lazy", "frozen", "adapter", "router") if getattr(self, n)]
        if self.extra_state:
            features.append(f"extra_state={self.extra_state}")
        groups = []
        if self.one_group:
            groups.append("one group")
        if self.empty_at:
            groups.append(f"empty groups at {list(self.empty_at)}")
        if self.router_group:
            groups.append("routers in a group of their own")
        if self.custom_fields:
            groups.append("custom group fields")
        if self.scale != base.scale:
            groups.append(f"lr and weight decay x{self.scale:g}")
        if self.scheduler:
            groups.append("an lr scheduler")
        if self.group_order == "reversed":
            groups.append("groups and their parameters in reverse order")
        elif self.group_order == "reversed-target":
            groups.append("the target's groups and their parameters in reverse order (OPT-KEYS-1)")
        target = f"a warm target ({self.warm} steps of its own)" if self.warm else "a fresh target"
        if self.model_keys:
            target += f"; the model dict loses a key and gains one ({self.model_keys} load)"
        if self.reshard_to:
            target += f"; also resharded to {self.reshard_to} ({DRAWN[self.reshard_to].world_size} ranks)"
        if self.loop_point:
            from .loops import POINTS

            target += f"; the get taken {POINTS[self.loop_point].what}" + (" (the set too)" if self.warm else "")
        if self.policy:
            from .policies import VARIANTS

            target += f"; FSDP2 policy {self.policy}: {VARIANTS[self.policy]}"
        if self.freeze_after:
            target += "; the first block frozen after training, in the source and the target"
        lines = [
            f"layout {self.layout} ({self.world_size} ranks), mode {self.mode}, optimizer {self.optimizer}",
            f"model: {', '.join(model)}, {self.dtype}; features: {', '.join(features) or 'none'}",
            f"groups: {', '.join(groups) or 'by role, as the base model'}",
            f"steps: {self.before} before the save, {self.after} after; {target}",
        ]
        return "\n".join(lines)


_LATER_FIELDS = ("group_order", "policy", "loop_point", "freeze_after")
_DEFAULTS = {f.name: f.default for f in fields(Scenario)}


def reshard_problems(s: "Scenario") -> list[str]:
    """Why ``s`` cannot also be resharded to ``s.reshard_to``, in words ([] when it can)."""
    if s.reshard_to not in DRAWN_LAYOUTS:
        return [f"reshard_to {s.reshard_to!r} is not one of {DRAWN_LAYOUTS}"]
    if s.reshard_to == s.layout:
        return ["reshard_to is the layout itself"]
    if not modes.is_mode(s.mode) or s.kind not in RESHARD_MODES:
        return [f"resharding goes through dcp or bcast, not {s.mode}"]
    a, b = DRAWN[s.layout].pp, DRAWN[s.reshard_to].pp
    out = []
    if s.kind.through_dcp and (a > 1) != (b > 1):
        out.append("through dcp, a pipeline checkpoint (flat) loads only on pipeline stages")
    if s.n_layers < b:
        out.append(f"{s.reshard_to} needs at least {b} layers")
    if s.tie and b > 1:
        out.append(f"a tied model cannot be split into pipeline stages ({s.reshard_to})")
    if s.empty_at and max(a, b) > 1:
        out.append("empty groups do not travel in a pipeline's flat layout")
    if s.policy in ("bf16", "titan"):
        out.append(
            "resharding compares training on two layouts within 1e-6, and bf16 compute on one side only differs by more"
        )
    if s.dim < 2:
        # The LayerNorm's output is its bias for every token, and the sum of
        # that bias's gradient nearly cancels: another world size's order of
        # summation moves training past the 1e-6 tolerance, whatever the load
        # does (every implementation alike).
        out.append(
            "resharding needs dim 2 or more (with one feature, training on another world size differs by more "
            "than the tolerance)"
        )
    return out
