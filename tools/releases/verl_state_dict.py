"""verl's copy of torch 2.7's state-dict API, as an implementation the suite can judge.

verl (the RL training library) ships ``torch/distributed/checkpoint/state_dict.py`` and
``torch/distributed/_state_dict_utils.py`` of torch 2.7.0 under
``verl/third_party/torch/distributed/`` ("official torch 2.6.0 set_model_state_dict API leads to
OOM"), and its FSDP workers call that copy whatever torch is installed. Its API is torch's, so
the suite drives it as it drives torch's own (the same profiles); the adapter's version is verl's.

    pip install --no-deps verl==0.6.0
    PYTHONPATH=$PWD python -m conformance --impl tools.releases.verl_state_dict --json out/verl.json

The two files are loaded on their own, never through the ``verl`` package, whose ``__init__``
imports ray, transformers and more: ``importlib.util.find_spec("verl")`` locates the installed
package without running it, and each file is executed under its dotted name, registered in
``sys.modules`` first. The utilities go first, so the copy's
``from verl.third_party.torch.distributed._state_dict_utils import ...`` finds them there.

The parent packages (``verl``, ``verl.third_party``, ... ``verl.third_party.torch.distributed.checkpoint``)
are registered too, as modules made from their specs whose code never runs: the broadcast and
``cpu_offload`` loads pickle the copy's ``_TensorInfo`` (``broadcast_object_list``), and pickle
looks a class up by importing its module's dotted name, which imports the top package first. Without
them every such load fails in this harness with a PicklingError no installation of verl shows.
A ``verl`` already imported, or any parent already in ``sys.modules``, is used as it is.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType

from conformance.adapters import Adapter, AdapterError, from_module

NAME = "verl-vendored-torch-2.7"
PIN = "verl==0.6.0"
INSTALL = f"pip install --no-deps {PIN}"
PACKAGE = "verl.third_party.torch.distributed"
# Dotted name under PACKAGE and path under verl's third_party/torch/distributed, in load order.
FILES = (("_state_dict_utils", "_state_dict_utils.py"), ("checkpoint.state_dict", "checkpoint/state_dict.py"))
PROFILES = ("multi-optimizer", "tp")


def _verl_spec() -> importlib.machinery.ModuleSpec:
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise AdapterError(f"verl is not installed; {NAME} is verl's copy of torch 2.7's state_dict: {INSTALL}")
    return spec


def vendored_dir() -> str:
    """Where the installed verl keeps its copy of torch.distributed, found without importing verl."""
    spec = _verl_spec()
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "third_party", "torch", "distributed")
        if all(os.path.isfile(os.path.join(path, rel)) for _, rel in FILES):
            return path
    raise AdapterError(
        f"verl at {list(spec.submodule_search_locations)} has no third_party/torch/distributed/"
        f"{' or '.join(rel for _, rel in FILES)}; {NAME} is the copy verl 0.5 and 0.6 ship: {INSTALL}"
    )


def _register_parents(base: str) -> None:
    """``verl`` down to ``verl.third_party.torch.distributed.checkpoint`` in ``sys.modules``, none of them run."""
    if "verl" not in sys.modules:
        sys.modules["verl"] = importlib.util.module_from_spec(_verl_spec())
    top = os.path.dirname(os.path.dirname(os.path.dirname(base)))  # the verl folder holding third_party
    parts = PACKAGE.split(".") + ["checkpoint"]
    for depth in range(2, len(parts) + 1):
        name = ".".join(parts[:depth])
        if name in sys.modules:
            continue
        folder = os.path.join(top, *parts[1:depth])
        init = os.path.join(folder, "__init__.py")
        spec = importlib.machinery.ModuleSpec(
            name, None, origin=init if os.path.isfile(init) else None, is_package=True
        )
        spec.submodule_search_locations = [folder]
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        setattr(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], module)


def _load(name: str, path: str) -> ModuleType:
    loaded = sys.modules.get(name)
    if loaded is not None:
        if os.path.realpath(getattr(loaded, "__file__", "") or "") != os.path.realpath(path):
            raise AdapterError(f"{name} is already loaded from {getattr(loaded, '__file__', None)}, not {path}")
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    parent, _, child = name.rpartition(".")
    setattr(sys.modules[parent], child, module)
    return module


def load() -> ModuleType:
    """verl's ``third_party/torch/distributed/checkpoint/state_dict.py``, loaded without the verl package."""
    base = vendored_dir()
    _register_parents(base)
    module = None
    for dotted, rel in FILES:
        module = _load(f"{PACKAGE}.{dotted}", os.path.join(base, rel))
    return module


def verl_version() -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def conformance_adapter() -> Adapter:
    """The adapter ``--impl tools.releases.verl_state_dict`` resolves to."""
    return from_module(load(), NAME, version=verl_version(), profiles=PROFILES)
