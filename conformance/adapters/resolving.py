"""``--impl NAME`` resolved to an adapter: hyperdsd or torch by name, a module
with torch's names, or a module's or object's ``Adapter``."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
from typing import Any

from .interface import COMBINED, FUNCTIONS, OPTION_FIELDS, Adapter, AdapterError


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
        functions_are_iut=True,
        **{f: getattr(obj, f) for f in FUNCTIONS},
        **({f: getattr(obj, f) for f in COMBINED} if all(hasattr(obj, f) for f in COMBINED) else {}),
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
