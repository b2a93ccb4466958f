"""The kit for writing a section: what a SPEC section's module needs to
declare and run its clauses' cases, from one place.

A section (``conformance/sections/``, one module per SPEC section) imports
from here and from nowhere else in the suite, and never from another
section: what two sections share lives in the kit (the resharding scenario,
damaged state, the checks of where state is placed) or below it. What it
holds, by job:

- declare: :class:`Clause`, :func:`grid`, :func:`make_case`, the catalog's
  picks (``ENDS``, ``HALVED``, ...), :data:`MODES` and the modes' kinds;
- build and train: :class:`Setup`, :class:`ModelConfig`, :class:`GroupSpec`,
  ``resuming`` (recipes, kept runs, ``resume``), ``loops``, ``policies``;
- get and set: ``saving`` (``save``, ``load``, the options of a mode), the
  implementation itself as ``c.iut``;
- compare: the oracle (``snapshot``, ``diff_snapshots``, ``fail_if``, ...),
  ``tensors`` (distributed values, whatever their class);
- expect a refusal: ``expect_error``, ``expect_unchanged``, the damaged
  state of :mod:`.damage`;
- scenarios several sections share: :mod:`.reshard`, :mod:`.placed`.

A new clause is one entry in SPEC.md and its cases in the module of its
section (docs/ARCHITECTURE.md).
"""

from .. import modes, nested, tensors
from ..adapters import raised_by_iut
from ..judging import fsdp1, packed
from ..judging.meter import ReceiveMeter
from ..judging.oracle import (
    WRAPPER_SEGMENTS,
    canonical,
    check,
    clone_tree,
    diff_snapshots,
    diff_values,
    expect_error,
    expect_unchanged,
    fail_if,
    full_snapshot,
    grads_view,
    layout_problems,
    optimizer_view,
    snapshot,
    without_empty_groups,
)
from ..modes import MODES, Mode
from ..running.case_context import NotApplicable
from ..running.cases import Case, Phase, case_id, grid, loads, make_case, move
from ..running.clauses import Clause
from ..world import loops, many_keys, policies, resuming, saving
from ..world.catalog import (
    BASE,
    DATA_PARALLEL,
    ENDS,
    FSDP1,
    FSDP1_FLAT_PARAMS,
    FSDP1_FULL,
    FSDP1_FULL_SHARD,
    FSDP1_HYBRID,
    FSDP1_ORIGINAL,
    FSDP1_SHARD_GRAD_OP,
    HALVED,
    HYBRID,
    ONE_RANK,
    QUARTERS,
    REPLICATED,
    SHARDED,
    SHARDED_STAGES,
    STAGES,
    THIRDS,
    WRAPPERS,
    moves,
)
from ..world.groups import GroupSpec, reordered
from ..world.layouts import Layout, Move, serving
from ..world.models import ModelConfig, ToyModel, batch, loss_fn
from ..world.placing import model_group
from ..world.saving import get_options, optimizers_arg, set_options
from ..world.setup import Setup
from . import damage, placed, reshard
from .damage import GHOST, drop_from_dict, drop_from_metadata, wrong_shape
from .placed import check_get, check_loaded
from .reshard import one_group_if_flat, only_layers, resharded_case

__all__ = [
    "BASE",
    "Case",
    "Clause",
    "DATA_PARALLEL",
    "ENDS",
    "FSDP1",
    "FSDP1_FLAT_PARAMS",
    "FSDP1_FULL",
    "FSDP1_FULL_SHARD",
    "FSDP1_HYBRID",
    "FSDP1_ORIGINAL",
    "FSDP1_SHARD_GRAD_OP",
    "GHOST",
    "GroupSpec",
    "HALVED",
    "HYBRID",
    "Layout",
    "MODES",
    "Mode",
    "ModelConfig",
    "Move",
    "NotApplicable",
    "ONE_RANK",
    "Phase",
    "QUARTERS",
    "REPLICATED",
    "ReceiveMeter",
    "SHARDED",
    "SHARDED_STAGES",
    "STAGES",
    "Setup",
    "THIRDS",
    "ToyModel",
    "WRAPPERS",
    "WRAPPER_SEGMENTS",
    "batch",
    "canonical",
    "case_id",
    "check",
    "check_get",
    "check_loaded",
    "clone_tree",
    "damage",
    "diff_snapshots",
    "diff_values",
    "drop_from_dict",
    "drop_from_metadata",
    "expect_error",
    "expect_unchanged",
    "fail_if",
    "fsdp1",
    "full_snapshot",
    "get_options",
    "grads_view",
    "grid",
    "layout_problems",
    "loads",
    "loops",
    "loss_fn",
    "make_case",
    "many_keys",
    "model_group",
    "modes",
    "move",
    "moves",
    "nested",
    "one_group_if_flat",
    "only_layers",
    "optimizer_view",
    "optimizers_arg",
    "packed",
    "placed",
    "policies",
    "raised_by_iut",
    "reordered",
    "resharded_case",
    "reshard",
    "resuming",
    "saving",
    "serving",
    "set_options",
    "snapshot",
    "tensors",
    "without_empty_groups",
    "wrong_shape",
]
