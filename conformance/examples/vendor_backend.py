"""A stand-in for a vendor's checkpoint backend, with an API unlike torch's.

- the optimizer functions are ``get_optim_state_dict`` / ``set_optim_state_dict``
  and take exactly one optimizer;
- options are a ``CheckpointConfig`` read by attribute, with its own names;
- in sharded mode it returns each rank's *local shard* as a plain tensor
  instead of a DTensor (and takes local shards back on load).

The last point is a real design choice some backends make, and the
conformance suite shows what it costs: DCP cannot tell a plain local shard
from a replicated tensor, so it keeps one rank's shard and drops the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

import hyperdsd

# Wrapper modules' segments, which never appear in a state dict's keys.
_WRAPPER_SEGMENTS = {"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


@dataclass
class CheckpointConfig:
    gather: bool = False  # full tensors
    to_host: bool = False  # CPU, and only on rank 0 when gathering
    skip_frozen: bool = False
    strict: bool = True
    from_rank0: bool = False
    flat_keys: bool = False

    def _as_options(self) -> hyperdsd.StateDictOptions:
        return hyperdsd.StateDictOptions(
            full_state_dict=self.gather,
            cpu_offload=self.to_host,
            ignore_frozen_params=self.skip_frozen,
            strict=self.strict,
            broadcast_from_rank0=self.from_rank0,
            flatten_optimizer_state_dict=self.flat_keys,
        )


def _to_local(obj):
    if isinstance(obj, DTensor):
        return obj.to_local()
    if isinstance(obj, dict):
        return {k: _to_local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_local(v) for v in obj]
    return obj


def _localise_state(osd: dict, flat: bool) -> dict:
    if flat:
        return {k: _to_local(v) for k, v in osd.items()}
    return {"state": _to_local(osd.get("state", {})), "param_groups": osd.get("param_groups", [])}


def _params_by_name(model) -> dict[str, torch.nn.Parameter]:
    """The model's parameters by the names its state dict uses (wrapper segments dropped)."""
    return {
        ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS): p
        for name, p in model.named_parameters(remove_duplicate=False)
    }


def _as_dtensor_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """A local shard as a DTensor laid out like ``param``."""
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _relayout(model, osd: dict, flat: bool) -> dict:
    """Wrap plain local shards back into DTensors laid out like their parameters."""
    params = _params_by_name(model)

    def wrap(fqn, value):
        p = params.get(fqn)
        if (
            isinstance(p, DTensor)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DTensor)
            and value.dim() > 0
        ):
            return _as_dtensor_like(p, value)
        return value

    if flat:
        out = {}
        for key, value in osd.items():
            head, _, rest = key.partition(".")
            fqn = next((f for f in params if head == "state" and rest.startswith(f + ".")), None)
            out[key] = wrap(fqn, value) if fqn else value
        return out
    if not isinstance(osd.get("state"), dict):
        return osd  # malformed: hyperdsd says what is wrong with it
    state = {
        fqn: ({k: wrap(fqn, v) for k, v in entry.items()} if isinstance(entry, dict) else entry)
        for fqn, entry in osd["state"].items()
    }
    return {**osd, "state": state}


def get_model_state_dict(model, config: CheckpointConfig | None = None) -> dict:
    config = config or CheckpointConfig()
    sd = hyperdsd.get_model_state_dict(model, options=config._as_options())
    return sd if config.gather else _to_local(sd)


def set_model_state_dict(model, state_dict: dict, config: CheckpointConfig | None = None):
    config = config or CheckpointConfig()
    if not config.gather:
        params = _params_by_name(model)
        state_dict = {
            k: _as_dtensor_like(params[k], v)
            if isinstance(params.get(k), DTensor) and not isinstance(v, DTensor)
            else v
            for k, v in state_dict.items()
        }
    return hyperdsd.set_model_state_dict(model, state_dict, options=config._as_options())


def get_optim_state_dict(model, optimizer: torch.optim.Optimizer, config: CheckpointConfig | None = None) -> dict:
    config = config or CheckpointConfig()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("this backend takes exactly one optimizer")
    osd = hyperdsd.get_optimizer_state_dict(model, optimizer, options=config._as_options())
    return osd if config.gather or not osd else _localise_state(osd, config.flat_keys)


def set_optim_state_dict(
    model, optimizer: torch.optim.Optimizer, state_dict: dict, config: CheckpointConfig | None = None
) -> None:
    config = config or CheckpointConfig()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("this backend takes exactly one optimizer")
    if not config.gather and state_dict:
        state_dict = _relayout(model, state_dict, config.flat_keys)
    hyperdsd.set_optimizer_state_dict(model, optimizer, state_dict, options=config._as_options())
