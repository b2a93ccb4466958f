"""The modes (SPEC §2): how a state dict leaves a setup and comes back, as kinds.

One table, as the layout catalog is one: each :class:`Mode` says what it is
(sharded or full, where the full state lives, whether it goes through a file
or through DCP, whether its keys are flat, which get it pairs with, which
options its get and its set take), and the rules that depend on a mode live
here once. Cases and sections ask a mode what it is (``mode.on_root``,
``mode.through_dcp``), never its name; declarations and case IDs use names.

``flat_dcp`` is no mode a case or an adapter names: it is ``dcp`` as it runs
on pipeline stages (:meth:`Mode.on`), where the optimizer goes flat because
nested ``param_groups.N`` keys of different stages would collide in one
checkpoint, which is why the flat layout exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Mode:
    """One mode, as data. ``get`` names the declared get mode whose result it
    loads (``bcast`` and ``file`` save a ``full_cpu`` get, ``dcp`` a sharded
    one); ``get_options`` and ``set_options`` are torch's option fields."""

    name: str
    get: str
    get_options: tuple[tuple[str, Any], ...] = ()
    set_options: tuple[tuple[str, Any], ...] = ()
    full: bool = False  # full tensors, not shards
    on_root: bool = False  # a get gives the root everything and every other rank {} (cpu_offload)
    broadcast: bool = False  # loaded with broadcast_from_rank0: the others pass {}
    file: bool = False  # through a torch.save file the root writes
    every_rank_reads: bool = False  # ... which every rank reads and sets whole (the consolidated checkpoint)
    through_dcp: bool = False  # through torch.distributed.checkpoint (or the stack's own checkpoint)
    flat: bool = False  # flatten_optimizer_state_dict: torch's flat keys
    declared: bool = True  # a mode cases and adapters name (flat_dcp is dcp on stages)
    doc: str = field(default="", compare=False)

    def __str__(self) -> str:
        return self.name

    def on(self, pipeline: bool) -> "Mode":
        """This mode as it runs on a layout with (``pipeline``) or without stages: ``dcp`` goes flat on stages."""
        return FLAT_DCP if pipeline and self is DCP else self

    def strict_on(self, pipeline: bool) -> bool:
        """Whether a load in this mode can be strict: a consolidated file holds
        every stage, and a stage loads its own part of it (``strict=False``)."""
        return not (pipeline and self.every_rank_reads)

    @property
    def carries_empty_groups(self) -> bool:
        """The flat layout has no FQN to carry a group without parameters (OPT-EMPTY-2)."""
        return not self.flat

    @property
    def gets_shards(self) -> bool:
        """Its get returns each rank's shards in the nested layout (a sharded get, or one DCP saves)."""
        return not (self.full or self.flat)

    @property
    def memory_only(self) -> bool:
        """The dicts stay in memory between get and set: no file, no checkpoint."""
        return not (self.file or self.through_dcp)


_FULL = (("full_state_dict", True),)
_ON_ROOT = (("full_state_dict", True), ("cpu_offload", True))
_BROADCAST = (("full_state_dict", True), ("broadcast_from_rank0", True))
_FLAT = (("flatten_optimizer_state_dict", True),)

SHARDED = Mode("sharded", "sharded", doc="default options, in memory")
FULL = Mode("full", "full", _FULL, _FULL, full=True, doc="full_state_dict on every rank, in memory")
FULL_CPU = Mode(
    "full_cpu",
    "full_cpu",
    _ON_ROOT,
    _BROADCAST,
    full=True,
    on_root=True,
    broadcast=True,
    doc="full_state_dict + cpu_offload (the root holds it all); loaded back with broadcast_from_rank0",
)
BCAST = replace(
    FULL_CPU, name="bcast", file=True, doc="as full_cpu, through torch.save / torch.load(weights_only=True) on the root"
)
FILE = Mode(
    "file",
    "full_cpu",
    _ON_ROOT,
    _FULL,
    full=True,
    on_root=True,
    file=True,
    every_rank_reads=True,
    doc="the root saves the full_cpu dict with torch.save; every rank reads the file and sets the full dict "
    "(no broadcast): the consolidated checkpoint. Pipeline stages take from it what is theirs (strict=False)",
)
FLAT = Mode("flat", "flat", _FLAT, _FLAT, flat=True, doc="flatten_optimizer_state_dict, in memory")
DCP = Mode(
    "dcp",
    "sharded",
    through_dcp=True,
    doc="default options through torch.distributed.checkpoint (or the stack's own checkpoint): the target's "
    "own get gives the load template, loaded with the implementation's documented load path; on pipeline "
    "stages the optimizer goes flat",
)
FLAT_DCP = Mode("flat_dcp", "flat", _FLAT, _FLAT, through_dcp=True, flat=True, declared=False, doc="dcp on stages")

#: The modes cases run in and adapters declare, in the order reports list them.
ALL: tuple[Mode, ...] = (SHARDED, FULL, FULL_CPU, BCAST, FILE, FLAT, DCP)
MODES: tuple[str, ...] = tuple(m.name for m in ALL)
#: What a get returns: the modes a get can be declared in.
GET_MODES: tuple[str, ...] = ("sharded", "full", "full_cpu", "flat")
#: The get each mode loads the result of, by name (for declarations).
GET_OF: dict[str, str] = {m.name: m.get for m in ALL}

_BY_NAME = {m.name: m for m in (*ALL, FLAT_DCP)}


def mode_of(which: "Mode | str") -> Mode:
    """The mode ``which`` names (a mode is itself); an unknown name is a ValueError naming the known ones."""
    if isinstance(which, Mode):
        return which
    try:
        return _BY_NAME[which]
    except KeyError:
        raise ValueError(f"unknown mode {which!r}; the modes are {', '.join(MODES)}") from None


def is_mode(which: str) -> bool:
    """Whether ``which`` names a mode cases and adapters name (a record's field, say)."""
    return which in MODES


def name(which: "Mode | str | None") -> str | None:
    """A mode's name (None stays None)."""
    return None if which is None else mode_of(which).name
