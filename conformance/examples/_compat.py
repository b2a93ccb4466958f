"""Private names the worked examples use, each with its reason, in one place
(as the suite's and hyperdsd's are: tests/repository/test_fences.py)."""

from __future__ import annotations

import importlib

import torch

# A tensor subclass that holds its local part and reports another (global)
# shape is made as torch's own DTensor is: a wrapper subclass, whose storage is
# its local tensor's. No public constructor makes one.
wrapper_subclass = torch.Tensor._make_wrapper_subclass

# torch's way for a tensor subclass to opt out of __torch_function__ and see
# every op in __torch_dispatch__ alone (what DTensor does): no public name.
NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl


def forget_hyper_parallel_groups(device_mesh_class) -> None:
    """hyper_parallel's ``DeviceMesh`` keeps the process groups it made in a
    module-level map that nothing of its public API clears; the suite's ranks
    re-create the default group between worlds, and a mesh built afterwards
    would find a destroyed group there."""
    module = importlib.import_module(device_mesh_class.__module__)
    getattr(module, "_group_map", {}).clear()
