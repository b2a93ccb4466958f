"""The implementation under test (IUT), behind one small interface.

``--impl NAME`` picks it:

* ``hyperdsd`` or ``torch`` (``torch.distributed.checkpoint.state_dict``);
* ``some.module``: a module with the four functions and ``StateDictOptions``
  under torch's names works as it is; a module may instead define
  ``conformance_adapter`` (an :class:`Adapter`, or a function returning one);
* ``some.module:attr``: an :class:`Adapter`, a function returning one, or an
  object with the four functions.

An adapter may rename functions, build its own options, shard models its own
way (default: ``fully_shard``), claim optional profiles, declare the modes
it supports (default: all of them) and name its DCP load path (a load
planner factory; a module names it as ``DCP_LOAD_PLANNER``; default: none,
DCP's default planner).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

FUNCTIONS = ("get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict", "set_optimizer_state_dict")
OPTION_FIELDS = ("full_state_dict", "cpu_offload", "ignore_frozen_params", "strict", "broadcast_from_rank0", "flatten_optimizer_state_dict")
PROFILES = ("core", "inplace", "tp", "multi-optimizer")
# How a state dict leaves a setup and comes back (SPEC §2; see flows.py).
MODES = ("sharded", "full", "full_cpu", "bcast", "file", "flat", "dcp")


class AdapterError(RuntimeError):
    pass


def fully_shard(module, *, mesh):
    """FSDP2's ``fully_shard``, keeping a unit's parameters gathered from its
    forward to its backward: one all-gather per unit and step instead of
    two, the collectives that dominate a case's time on a small model. The
    backward still reshards, so between steps, where every state-dict call
    of the suite happens, the model is sharded as with the default."""
    from torch.distributed.fsdp import fully_shard as _fully_shard

    return _fully_shard(module, mesh=mesh, reshard_after_forward=False)


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
    modes: frozenset[str] = frozenset(MODES)
    # How --impl names it: the ranks load the adapter again by this name.
    spec: str = ""
    # The documented DCP load path (SPEC §2): called with no arguments, it
    # returns the load planner the ``dcp`` mode passes to ``dcp.load``. None:
    # DCP's default planner, nothing relaxed.
    dcp_load_planner: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        unknown = set(self.profiles) - set(PROFILES)
        if unknown:
            raise AdapterError(f"adapter {self.name!r} claims unknown profiles {sorted(unknown)}; known: {list(PROFILES)}")
        unknown = set(self.modes) - set(MODES)
        if unknown or not self.modes:
            raise AdapterError(f"adapter {self.name!r} declares modes {sorted(self.modes)}; known: {list(MODES)}")
        self.profiles = frozenset(self.profiles)
        self.modes = frozenset(self.modes)

    def claims(self, profile: str) -> bool:
        return profile == "core" or profile in self.profiles

    def supports(self, mode: str | None) -> bool:
        return mode is None or mode in self.modes


def from_module(obj: Any, name: str, version: str | None = None, profiles=()) -> Adapter:
    """An adapter for anything exposing torch's names (a module or an object)."""
    missing = [f for f in FUNCTIONS + ("StateDictOptions",) if not hasattr(obj, f)]
    if missing:
        raise AdapterError(
            f"{name!r} does not provide {', '.join(missing)}; write an adapter "
            "(conformance.adapters.Adapter) for implementations with other names"
        )
    options_cls = obj.StateDictOptions
    params = inspect.signature(options_cls).parameters
    lacking = [f for f in OPTION_FIELDS if f not in params]
    if lacking:
        raise AdapterError(f"{name}.StateDictOptions lacks the fields {lacking}")
    return Adapter(
        name=name,
        version=version or _version_of(obj),
        options=options_cls,
        profiles=frozenset(getattr(obj, "CONFORMANCE_PROFILES", profiles)),
        dcp_load_planner=getattr(obj, "DCP_LOAD_PLANNER", None),
        **{f: getattr(obj, f) for f in FUNCTIONS},
    )


def _version_of(obj: Any) -> str:
    version = getattr(obj, "__version__", None)
    if version:
        return str(version)
    top = getattr(obj, "__name__", type(obj).__module__).split(".")[0]
    try:
        return importlib.metadata.version(top)
    except importlib.metadata.PackageNotFoundError:
        top_module = importlib.import_module(top)
        return str(getattr(top_module, "__version__", "unknown"))


def _builtin_torch() -> Adapter:
    import torch
    import torch.distributed.checkpoint.state_dict as dsd

    return from_module(dsd, "torch", version=torch.__version__, profiles=("multi-optimizer", "tp"))


def _builtin_hyperdsd() -> Adapter:
    import hyperdsd

    return from_module(hyperdsd, "hyperdsd", version=hyperdsd.__version__)


BUILTIN = {"torch": _builtin_torch, "hyperdsd": _builtin_hyperdsd}


def _coerce(obj: Any, name: str) -> Adapter:
    if isinstance(obj, Adapter):
        return obj
    if callable(obj) and not inspect.ismodule(obj) and not hasattr(obj, FUNCTIONS[0]):
        made = obj()
        if not isinstance(made, Adapter):
            raise AdapterError(f"{name} returned {type(made).__name__}, expected a conformance.adapters.Adapter")
        return made
    adapter = getattr(obj, "conformance_adapter", None) if inspect.ismodule(obj) else None
    if adapter is not None:
        return _coerce(adapter, name)
    return from_module(obj, name)


@functools.lru_cache(maxsize=None)
def load_adapter(spec: str) -> Adapter:
    """Resolve ``--impl``; errors say what was looked for and what was missing."""
    adapter = _resolve(spec)
    if adapter.spec and adapter.spec != spec:
        adapter = dataclasses.replace(adapter)
    adapter.spec = spec
    return adapter


def _resolve(spec: str) -> Adapter:
    if spec in BUILTIN:
        return BUILTIN[spec]()
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise AdapterError(f"cannot import the implementation {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in filter(None, attr.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AdapterError(f"{module_name!r} has no attribute {attr!r}") from None
    return _coerce(obj, spec)
