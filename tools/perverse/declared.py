"""Implementations under test for the declaration and pass-boundary tests (SPEC 1.2 §1, §4).

Each wraps hyperdsd and differs from it in one way.
"""

from dataclasses import replace

import torch

from conformance.adapters import Unsupported, iut_call, load_adapter


def _base(name, **changes):
    return replace(load_adapter("hyperdsd"), name=name, version="0", functions_are_iut=False, **changes)


def _contradiction(options) -> bool:
    return getattr(options, "broadcast_from_rank0", False) and not getattr(options, "full_state_dict", False)


def adapter_raises():
    """The adapter itself raises the ValueError OPT-ATOM-3 expects, before calling the implementation."""
    base = load_adapter("hyperdsd")

    def set_optimizer_state_dict(model, optimizers, osd, *, options=None):
        if _contradiction(options):
            raise ValueError("broadcast_from_rank0 needs full_state_dict")
        with iut_call():
            return base.set_optimizer_state_dict(model, optimizers, osd, options=options)

    return _base("adapter-raises", set_optimizer_state_dict=set_optimizer_state_dict)


def adapter_refuses():
    """The adapter refuses contradictory options: the implementation has no way to express them."""
    base = load_adapter("hyperdsd")

    def set_optimizer_state_dict(model, optimizers, osd, *, options=None):
        if _contradiction(options):
            raise Unsupported("the implementation has no options type to contradict")
        with iut_call():
            return base.set_optimizer_state_dict(model, optimizers, osd, options=options)

    return _base("adapter-refuses", set_optimizer_state_dict=set_optimizer_state_dict)


def tensors_only():
    """A model gather that keeps tensors only: extra state that is not a tensor is lost (MODEL-5)."""
    base = load_adapter("hyperdsd")

    def get_model_state_dict(model, *, options=None):
        return {
            k: v for k, v in base.get_model_state_dict(model, options=options).items() if isinstance(v, torch.Tensor)
        }

    return replace(base, name="tensors-only", version="0", get_model_state_dict=get_model_state_dict)
