"""The interface an adapter is written against: the declarations it makes,
the boundary of the implementation's own calls (``iut_call``), its refusals,
the device a rank computes on. See :mod:`conformance.adapters`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..modes import GET_MODES, GET_OF, MODES

FUNCTIONS = ("get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict")
# The combined functions (SPEC §1, 1.3): optional; an implementation that has
# both declares ``combined`` and clause API-1 judges them.
COMBINED = ("get_state_dict", "set_state_dict")
OPTION_FIELDS = (
    "full_state_dict",
    "cpu_offload",
    "ignore_frozen_params",
    "strict",
    "broadcast_from_rank0",
    "flatten_optimizer_state_dict",
)
PROFILES = ("core", "inplace", "tp", "multi-optimizer")
# The modes (SPEC §2), by name: what cases and declarations name; conformance.modes
# says what each is (MODES in order, the declarable GET_MODES, GET_OF each mode's get).
# Layouts beyond data parallelism (single, ddp, fsdp, hsdp), as an IUT declares them (SPEC §1).
LAYOUT_CAPABILITIES = ("pipeline", "tensor_parallel", "several_meshes", "part_of_world", "policies", "fsdp1")
# Options an IUT may lack (SPEC §1): its own options type (what OPT-ATOM-3's
# contradiction is made of), ``strict=False`` loads, ``ignore_frozen_params``.
OPTION_CAPABILITIES = ("options_type", "strict", "ignore_frozen_params")
# Their names before suite 0.5, kept for adapters written against them.
LAYOUTS, OPTIONS = LAYOUT_CAPABILITIES, OPTION_CAPABILITIES


class AdapterError(RuntimeError):
    pass


class Unsupported(NotImplementedError):
    """An adapter's refusal: the implementation lacks what the case asks for
    (a mode, a layout, an option, several optimizers). The case is not
    applicable; raise it before calling the implementation."""


def not_supported(what: str) -> Unsupported:
    """``raise not_supported("several optimizers")``: a refusal naming what is lacking."""
    return Unsupported(f"the implementation does not support {what}")


IUT_ATTR = "__conformance_in_iut__"


@contextlib.contextmanager
def iut_call():
    """The implementation's own code runs inside this block (SPEC §4).

    An adapter wraps each call into the implementation with it; an exception
    leaving the block is marked as the implementation's, and only such an
    exception counts where a clause expects an error. Adapters whose
    functions are the implementation's own (``from_module``) need not: the
    suite wraps them itself.
    """
    try:
        yield
    except BaseException as exc:
        try:
            setattr(exc, IUT_ATTR, True)
        except (AttributeError, TypeError):
            pass
        raise


def raised_by_iut(exc: BaseException) -> bool:
    """Whether ``exc`` left a call into the implementation (``iut_call``)."""
    return bool(getattr(exc, IUT_ATTR, False))


# The device this rank computes on, set by the suite on each rank (--device).
_RANK_DEVICE: list = []


def set_rank_device(device) -> None:
    _RANK_DEVICE[:] = [device]


def rank_device(model=None):
    """The device a rank's tensors belong on: where ``model``'s parameters
    live, or, for a model on the meta device (or none), the device the run
    computes on (``--device``: ``cuda:<local rank>``, ...; the CPU by default).
    Adapters use it to place what they gather or load."""
    import torch

    from .. import tensors

    for p in model.parameters() if model is not None else ():
        local = tensors.local(p)
        if local.device.type != "meta":
            return local.device
    return _RANK_DEVICE[0] if _RANK_DEVICE else torch.device("cpu")


def fully_shard(module, *, mesh, **policy):
    """FSDP2's ``fully_shard``. The base layouts keep a unit's parameters
    gathered from its forward to its backward (``reshard_after_forward=False``):
    one all-gather per unit and step instead of two, the collectives that
    dominate a case's time on a small model; the backward still reshards, so
    between steps the model is sharded as with the default. ``policy``: the
    keyword arguments of a policy variant (SPEC §2: ``fsdp4.bf16``, ...),
    which may set ``reshard_after_forward`` otherwise."""
    from torch.distributed.fsdp import fully_shard as _fully_shard

    return _fully_shard(module, mesh=mesh, **{"reshard_after_forward": False, **policy})


@dataclass
class Adapter:
    """How the suite drives one implementation.

    The four functions take torch's signatures; ``options(**fields)`` takes
    torch's ``StateDictOptions`` field names and returns whatever the four
    functions accept as ``options``.
    """

    name: str
    get_model_state_dict: Callable
    set_model_state_dict: Callable
    get_optimizer_state_dict: Callable
    set_optimizer_state_dict: Callable
    options: Callable[..., Any]
    version: str = "unknown"
    shard: Callable[..., Any] = fully_shard
    profiles: frozenset[str] = field(default_factory=frozenset)
    # Declarations (SPEC §1). ``modes`` declares get and load alike (a
    # ``bcast`` or ``file`` load implies a ``full_cpu`` get); ``get_modes``
    # and ``load_modes`` declare them apart. After construction ``modes``
    # holds the modes a round trip runs in: a declared get whose result a
    # declared load reads.
    modes: frozenset[str] | None = None
    get_modes: frozenset[str] | None = None
    load_modes: frozenset[str] | None = None
    layouts: frozenset[str] = frozenset(LAYOUT_CAPABILITIES)
    supported_options: frozenset[str] = frozenset(OPTION_CAPABILITIES)
    # True when the functions (the four, and the combined ones) are the
    # implementation's own (from_module): the suite then wraps each call in
    # ``iut_call`` itself.
    functions_are_iut: bool = False
    # How --impl names it: the ranks load the adapter again by this name.
    spec: str = ""
    # The documented DCP load path (SPEC §2): called with no arguments, it
    # returns the load planner the ``dcp`` mode passes to ``dcp.load``. None:
    # DCP's default planner, nothing relaxed.
    dcp_load_planner: Callable[[], Any] | None = None
    # The combined functions (SPEC §1, 1.3), with torch's signatures: both or
    # neither. ``combined`` declares them; None: declared when both are given.
    get_state_dict: Callable | None = None
    set_state_dict: Callable | None = None
    combined: bool | None = None
    # A stack of its own (SPEC §1, 1.6). ``tensors``: how the suite reads its
    # distributed values (a conformance.tensors.TensorProtocol; None: torch's
    # DTensor). ``training``: a context (called with no arguments) the suite
    # enters wherever it builds or steps optimizers, or loads a model's own
    # state dict, for a stack whose tensors take part in plain torch ops only
    # under its own dispatch rules; None: none. ``mesh``: builds the stack's own
    # mesh from a conformance.tensors.MeshDescription, once per mesh and rank,
    # on every rank of the mesh alike; ``shard`` then receives what it
    # returns; None: torch's DeviceMesh. ``save_checkpoint(state_dict, *,
    # checkpoint_id, process_group)`` and ``load_checkpoint(state_dict, *,
    # checkpoint_id, process_group)`` (which fills ``state_dict`` in place, as
    # dcp.load does, or returns the dict it loaded): the stack's own checkpoint,
    # which the ``dcp`` mode uses instead of torch.distributed.checkpoint; both or neither.
    tensors: Any = None
    training: Callable[[], Any] | None = None
    mesh: Callable[[Any], Any] | None = None
    save_checkpoint: Callable | None = None
    load_checkpoint: Callable | None = None

    def __post_init__(self) -> None:
        unknown = set(self.profiles) - set(PROFILES)
        if unknown:
            raise AdapterError(
                f"adapter {self.name!r} claims unknown profiles {sorted(unknown)}; known: {list(PROFILES)}"
            )
        both = MODES if self.modes is None else self.modes
        loads = frozenset(both if self.load_modes is None else self.load_modes)
        gets = (
            frozenset(GET_OF[m] for m in both if m in GET_OF) if self.get_modes is None else frozenset(self.get_modes)
        )
        for what, declared, known in (
            ("modes", both, MODES),
            ("load modes", loads, MODES),
            ("get modes", gets, GET_MODES),
            ("layouts", self.layouts, LAYOUT_CAPABILITIES),
            ("options", self.supported_options, OPTION_CAPABILITIES),
        ):
            unknown = set(declared) - set(known)
            if unknown:
                raise AdapterError(f"adapter {self.name!r} declares {what} {sorted(unknown)}; known: {list(known)}")
        if not gets and not loads:
            raise AdapterError(f"adapter {self.name!r} declares no get mode and no load mode")
        given = [f for f in COMBINED if getattr(self, f) is not None]
        if len(given) not in (0, len(COMBINED)) or (self.combined and not given):
            raise AdapterError(
                f"adapter {self.name!r} gives {given or 'none'} of the combined functions {list(COMBINED)}: "
                "give both to declare combined, or neither"
            )
        if (self.save_checkpoint is None) != (self.load_checkpoint is None):
            raise AdapterError(
                f"adapter {self.name!r} gives one of save_checkpoint and load_checkpoint: give both, or neither (DCP)"
            )
        self.profiles = frozenset(self.profiles)
        self.get_modes, self.load_modes = gets, loads
        self.modes = frozenset(m for m in MODES if m in loads and GET_OF[m] in gets)
        self.layouts = frozenset(self.layouts)
        self.supported_options = frozenset(self.supported_options)
        self.combined = bool(given) if self.combined is None else self.combined

    def claims(self, profile: str) -> bool:
        return profile == "core" or profile in self.profiles

    def supports(self, mode) -> bool:
        """Whether a round trip in ``mode`` (a name or a conformance.modes.Mode) runs: a declared get, read by a
        declared load."""
        return mode is None or str(mode) in self.modes

    def lacks(self, needs: "Needs") -> list[str]:
        """What of ``needs`` this adapter does not declare, in words (SPEC §1)."""
        out = []
        if needs.get and needs.get not in self.get_modes:
            out.append(f"get mode {needs.get!r}")
        if needs.load and needs.load not in self.load_modes:
            out.append(f"load mode {needs.load!r}")
        out += [f"layout {x!r}" for x in needs.layouts if x not in self.layouts]
        out += [f"option {x!r}" for x in needs.options if x not in self.supported_options]
        if needs.combined and not self.combined:
            out.append(f"combined ({', '.join(COMBINED)})")
        return out

    def declaration(self) -> dict:
        """What the implementation declares, as data every report prints. A
        stack of its own (1.6) adds its tensor type and checkpoint; a torch
        stack's declaration reads as it did before."""
        out = {
            "get_modes": [m for m in GET_MODES if m in self.get_modes],
            "load_modes": [m for m in MODES if m in self.load_modes],
            "layouts": [x for x in LAYOUT_CAPABILITIES if x in self.layouts],
            "options": [x for x in OPTION_CAPABILITIES if x in self.supported_options],
            "profiles": sorted(self.profiles),
            "combined": self.combined,
        }
        if self.tensors is not None:
            out["tensors"] = getattr(self.tensors, "name", type(self.tensors).__name__)
        if self.save_checkpoint is not None:
            out["checkpoint"] = "own"
        return out


@dataclass(frozen=True)
class Needs:
    """What a case needs the implementation to declare (SPEC §1)."""

    get: str | None = None  # a get mode (GET_MODES)
    load: str | None = None  # a load mode (MODES)
    layouts: tuple[str, ...] = ()
    options: tuple[str, ...] = ()
    combined: bool = False  # the combined functions (API-1)


def describe_declaration(decl: dict) -> str:
    """One line: ``get full_cpu; load file; layouts none; options strict; combined no``.
    A report written before SPEC 1.3 has no ``combined``: its line names none."""

    def listed(xs, everything):
        if set(xs) == set(everything):
            return "all"
        return ", ".join(xs) if xs else "none"

    line = (
        f"get {listed(decl['get_modes'], GET_MODES)}; load {listed(decl['load_modes'], MODES)}; "
        f"layouts {listed(decl['layouts'], LAYOUT_CAPABILITIES)}; "
        f"options {listed(decl['options'], OPTION_CAPABILITIES)}"
    )
    if "combined" in decl:
        line += f"; combined {'yes' if decl['combined'] else 'no'}"
    if "tensors" in decl:
        line += f"; tensors {decl['tensors']}"
    if "checkpoint" in decl:
        line += f"; checkpoint {decl['checkpoint']}"
    return line
