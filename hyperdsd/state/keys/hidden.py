"""The children a module hides from canonical FQNs: wrappers' (DDP's
``module``, ``torch.compile``'s ``_orig_mod``, activation checkpointing's,
a wrapper layout's: :mod:`hyperdsd.wrappers`) and those a module's own
``_fqn_modifiers`` names."""

from __future__ import annotations

import torch.nn as nn

from ... import _compat, wrappers

_CHECKPOINT_CHILD = "_checkpoint_wrapped_module"


def hidden_children(module: nn.Module, modifiers_attr: str) -> set[str]:
    """Names of children whose name does not appear in FQNs."""
    # Children and methods are looked up where they live: a missing attribute
    # on a Module goes through a slow __getattr__ that raises.
    hidden = set()
    if isinstance(module, nn.parallel.DistributedDataParallel):
        hidden.add("module")
    if _compat.is_compiled_module(module):
        hidden.add("_orig_mod")
    if _CHECKPOINT_CHILD in _compat.child_modules(module):
        hidden.add(_CHECKPOINT_CHILD)
    for layout in wrappers.registered():
        hidden |= layout.hidden_children(module)
    if callable(getattr(type(module), modifiers_attr, None)):
        hidden.update(getattr(module, modifiers_attr)().values())
    return hidden
