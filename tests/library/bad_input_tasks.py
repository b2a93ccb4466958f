"""Rank side of the bad-input property test: damage a valid state dict as a
spec says, on the ranks it says, and check that set raises everywhere and
changes nothing."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from helpers import same
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import hyperdsd
from hyperdsd import StateDictOptions


def _setup(ctx):
    if "setup" not in ctx.cache:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        mesh = ctx.mesh("2")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        # The same ranks under another name: a DTensor on it is on the wrong mesh.
        other = init_device_mesh("cpu", (2,), mesh_dim_names=("elsewhere",))
        ctx.cache["setup"] = (model, opt, other)
    return ctx.cache["setup"]


def _view(model, opt):
    def local(t):
        return (
            t.to_local().clone()
            if isinstance(t, DTensor)
            else (t.clone() if isinstance(t, torch.Tensor) else copy.deepcopy(t))
        )

    return {
        "params": [local(p.detach()) for p in model.parameters()],
        "state": [
            {k: local(v) for k, v in opt.state[p].items()} if p in opt.state else None for p in model.parameters()
        ],
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


def _like(value, shape=None, dtype=None, mesh=None):
    """A tensor like ``value`` (DTensor stays DTensor) with another shape, dtype or mesh."""
    if isinstance(value, DTensor):
        local = value.to_local()
        if shape is not None:
            shape = torch.Size(shape)
            local = torch.zeros(
                (local.shape[0] + 1, *local.shape[1:]) if shape[0] != value.shape[0] else local.shape, dtype=local.dtype
            )
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )
        if dtype is not None:
            local = local.to(dtype)
        return DTensor.from_local(
            local,
            mesh or value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if shape is not None:
        return torch.zeros(shape, dtype=value.dtype)
    return value.to(dtype) if dtype is not None else value


def damage(sd: dict, spec: dict, other_mesh) -> None:
    kind, pick = spec["kind"], spec["pick"]
    flat = spec["mode"] == "flat"
    if spec["target"] == "model":
        keys = sorted(sd)
        key = keys[pick % len(keys)]
        if kind == "missing_key":
            sd.pop(key)
        elif kind == "extra_key":
            sd["ghost.weight"] = torch.zeros(2)
        elif kind == "wrong_shape":
            sd[key] = _like(sd[key], shape=(sd[key].shape[0] + 2, *sd[key].shape[1:]))
        elif kind == "wrong_dtype":
            sd[key] = _like(sd[key], dtype=torch.int64)
        elif kind == "non_tensor":
            sd[key] = spec["junk"]
        elif kind == "wrong_mesh":
            sd[key] = _like(sd[key], mesh=other_mesh)
        return
    if flat:
        keys = sorted(k for k in sd if k.startswith("state.") and not k.endswith(".step"))
        key = keys[pick % len(keys)]
        if kind == "unknown_key":
            sd["state.ghost.weight.exp_avg"] = torch.zeros(3)
        elif kind == "wrong_shape":
            sd[key] = _like(sd[key], shape=(sd[key].shape[0] + 2, *sd[key].shape[1:]))
        elif kind == "wrong_dtype":
            sd[key] = _like(sd[key], dtype=torch.int32)
        elif kind == "non_tensor":
            sd[key] = spec["junk"]
        elif kind == "non_tensor_step":
            sd[key.rsplit(".", 1)[0] + ".step"] = "7"  # (a number is a step torch's optimizers load)
        elif kind == "wrong_mesh":
            sd[key] = _like(sd[key], mesh=other_mesh)
        elif kind == "nested_under_value":
            sd[key + ".x"] = torch.zeros(2)
        elif kind == "missing_fqn":
            fqn = key[len("state.") :].rsplit(".", 1)[0]
            for k in [k for k in sd if k.startswith((f"state.{fqn}.", f"param_groups.{fqn}."))]:
                del sd[k]
        return
    fqns = sorted(sd["state"])
    fqn = fqns[pick % len(fqns)]
    entry = sd["state"][fqn]
    if kind == "no_state":
        del sd["state"]
    elif kind == "no_groups":
        del sd["param_groups"]
    elif kind == "state_not_dict":
        sd["state"] = list(sd["state"].values())
    elif kind == "entry_not_dict":
        sd["state"][fqn] = spec["junk"]
    elif kind == "group_without_params":
        del sd["param_groups"][0]["params"]
    elif kind == "params_not_strings":
        sd["param_groups"][0]["params"][0] = 0
    elif kind == "unknown_fqn":
        sd["param_groups"][0]["params"].append("ghost.weight")
    elif kind == "unknown_state":
        sd["state"]["ghost.weight"] = {"exp_avg": torch.zeros(2)}
    elif kind == "missing_fqn":
        del sd["state"][fqn]
        sd["param_groups"][0]["params"].remove(fqn)
    elif kind == "missing_key":
        del entry["exp_avg_sq"]
    elif kind == "wrong_shape":
        entry["exp_avg"] = _like(entry["exp_avg"], shape=(entry["exp_avg"].shape[0] + 2, *entry["exp_avg"].shape[1:]))
    elif kind == "wrong_dtype":
        entry["exp_avg"] = _like(entry["exp_avg"], dtype=torch.int64)
    elif kind == "non_tensor":
        entry["exp_avg"] = spec["junk"]
    elif kind == "non_tensor_step":
        entry["step"] = "3"  # (a number is a step torch's optimizers load)
    elif kind == "wrong_mesh":
        entry["exp_avg"] = _like(entry["exp_avg"], mesh=other_mesh)
    else:
        raise ValueError(kind)


def bad_input(ctx, spec: dict):
    model, opt, other = _setup(ctx)
    bcast = spec["mode"] == "bcast"
    get_opts = StateDictOptions(
        full_state_dict=bcast, cpu_offload=bcast, flatten_optimizer_state_dict=spec["mode"] == "flat"
    )
    set_opts = StateDictOptions(
        full_state_dict=bcast, broadcast_from_rank0=bcast, flatten_optimizer_state_dict=spec["mode"] == "flat"
    )
    if spec["target"] == "model":
        sd = copy.deepcopy(hyperdsd.get_model_state_dict(model, options=get_opts))
    else:
        sd = copy.deepcopy(hyperdsd.get_optimizer_state_dict(model, opt, options=get_opts))
    bad_ranks = [0] if bcast else ([1] if spec["where"] == "one" else [0, 1])
    if ctx.rank in bad_ranks:
        damage(sd, spec, other)
    before = _view(model, opt)
    try:
        if spec["target"] == "model":
            hyperdsd.set_model_state_dict(model, sd, options=set_opts)
        else:
            hyperdsd.set_optimizer_state_dict(model, opt, sd, options=set_opts)
        raised = None
    except Exception as exc:  # noqa: BLE001 - the type is checked by the controller
        raised = (type(exc).__name__, str(exc)[:500])
    return {"raised": raised, "unchanged": same(before, _view(model, opt))}
