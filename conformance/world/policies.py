"""FSDP2 policy variants of the ``fsdp`` and ``hsdp`` layouts (SPEC §2, 1.3).

A variant is named after a dot in the layout (``fsdp4.bf16``) and is the
keyword arguments each ``fully_shard`` call of the layout gets: the blocks,
the last block and the root apart, since real stacks shard them differently.
The base layouts pass none, and the suite's default shard keeps
``reshard_after_forward=False`` (see ``adapters.fully_shard``).
"""

from __future__ import annotations

import torch


def _mixed_precision():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _offload(setup):
    from torch.distributed.fsdp import CPUOffloadPolicy

    # Pinned host memory needs an accelerator to pin for.
    return CPUOffloadPolicy(pin_memory=setup.device.type != "cpu")


# name -> (what it stands for, {"block" | "last" | "root": kwargs maker}).
VARIANTS = {
    "reshard": "fully_shard's default: every unit resharded after forward",
    "reshard2": "reshard_after_forward=2: resharded to groups of 2 ranks after forward",
    "bf16": "MixedPrecisionPolicy: bf16 parameters in compute, fp32 reduction",
    "offload": "CPUOffloadPolicy: sharded parameters, gradients and state on the CPU",
    "titan": "as torchtitan: bf16 compute, blocks resharded after forward, the last block and the root not",
}


def reshards(policy: str) -> bool:
    """Whether some unit of the variant reshards after forward."""
    return policy in ("reshard", "reshard2", "titan")


def arguments(policy: str, unit: str, setup) -> dict:
    """``fully_shard``'s keyword arguments for ``unit`` ("block", "last" or
    "root") under ``policy`` ("" for the base layouts: none)."""
    if policy == "":
        return {}
    if policy == "reshard":
        return {"reshard_after_forward": True}
    if policy == "reshard2":
        return {"reshard_after_forward": 2}
    if policy == "bf16":
        return {"mp_policy": _mixed_precision()}
    if policy == "offload":
        return {"offload_policy": _offload(setup)}
    if policy == "titan":
        return {"mp_policy": _mixed_precision(), "reshard_after_forward": unit == "block"}
    raise ValueError(f"unknown FSDP2 policy variant {policy!r}; known: {', '.join(VARIANTS)}")
