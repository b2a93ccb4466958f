"""Deliberately faulty implementations under test, for the harness's own tests.

Each wraps torch's functions and misbehaves inside ``get_optimizer_state_dict``
on one rank, but only for AdamW, so the next (SGD) case of a run passes.
With ``FAULTY_IMPL_MARKERS`` set to a directory, a fault leaves a file there
as it strikes: a test can tell a fault that struck from one never reached.
"""

import os
import signal
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from conformance.adapters import load_adapter


def reached(fault: str) -> None:
    """Leave ``FAULTY_IMPL_MARKERS/<fault>-rank<rank>``, if that directory is set."""
    folder = os.environ.get("FAULTY_IMPL_MARKERS")
    if folder:
        open(os.path.join(folder, f"{fault}-rank{dist.get_rank()}"), "w").close()


def _hang():
    if dist.get_rank() == 1:
        reached("hang")
        try:
            dist.all_reduce(torch.ones(1))  # a collective nobody else joins
        except RuntimeError:
            pass  # gloo may give up on it first; a hung rank stays hung all the same
        time.sleep(3600)


def _exit3():
    if dist.get_rank() == 2:
        os._exit(3)


def _sigkill():
    if dist.get_rank() == 3:
        os.kill(os.getpid(), signal.SIGKILL)


def _raises():
    if dist.get_rank() == 1:
        raise ValueError("faulty implementation fails on rank 1")
    dist.barrier()  # the others wait for rank 1 in a collective


def _faulty(name, fault):
    base = load_adapter("torch")

    def get_optimizer_state_dict(model, optimizers, *, options=None):
        first = optimizers if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)[0]
        if isinstance(first, torch.optim.AdamW):
            fault()
        return base.get_optimizer_state_dict(model, optimizers, options=options)

    return replace(base, name=f"faulty-{name}", version="0", get_optimizer_state_dict=get_optimizer_state_dict)


def hang():
    return _faulty("hang", _hang)


def exit3():
    return _faulty("exit3", _exit3)


def sigkill():
    return _faulty("sigkill", _sigkill)


def raises():
    return _faulty("raises", _raises)


def _own(fn):
    """A hyperdsd function unchanged: its errors are the implementation's own."""

    def call(*args, **kwargs):
        from conformance.adapters import iut_call

        with iut_call():
            return fn(*args, **kwargs)

    return call


def _judged(base, name: str, **changed):
    """``base`` named ``name`` with ``changed`` functions; the others are hyperdsd's own."""
    from conformance.adapters import FUNCTIONS

    own = {f: _own(getattr(base, f)) for f in FUNCTIONS if f not in changed}
    return replace(base, name=name, version="0", **own, **changed)


def halves_router_state():
    """hyperdsd, but a load into a model with routers (a feature the base
    model lacks) halves every floating-point tensor of optimizer state: a
    bug no base-model case can reach, for exploration to find and shrink."""
    base = replace(load_adapter("hyperdsd"), functions_are_iut=False)

    def set_optimizer_state_dict(model, optimizers, osd, *, options=None):
        from conformance.adapters import iut_call

        if any(".router." in name for name, _ in model.named_parameters()):
            for entry in osd.get("state", {}).values():
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                        entry[key] = value * 0.5
        with iut_call():
            return base.set_optimizer_state_dict(model, optimizers, osd, options=options)

    return _judged(base, "halves-router-state", set_optimizer_state_dict=set_optimizer_state_dict)


def groups_by_position():
    """hyperdsd, but a nested checkpoint with as many param groups as the
    optimizers is paired with them group by group, in order (its groups take
    the optimizers' parameters by position): right whenever the target lists
    its groups as the source did, which every fixed case does."""
    base = replace(load_adapter("hyperdsd"), functions_are_iut=False)

    def set_optimizer_state_dict(model, optimizers, osd, *, options=None):
        from conformance.adapters import iut_call

        with iut_call():
            own = base.get_optimizer_state_dict(model, optimizers)  # every rank alike: it is a collective
            groups = osd.get("param_groups") if isinstance(osd, dict) else None
            if isinstance(groups, list) and len(groups) == len(own["param_groups"]):
                osd = {
                    **osd,
                    "param_groups": [{**g, "params": m["params"]} for g, m in zip(groups, own["param_groups"])],
                }
            return base.set_optimizer_state_dict(model, optimizers, osd, options=options)

    return replace(base, name="groups-by-position", version="0", set_optimizer_state_dict=set_optimizer_state_dict)


def _unsharded_modules(model):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return [
        m
        for m in model.modules()
        if isinstance(m, FSDPModule) and any(not isinstance(p, DTensor) for p in m.parameters())
    ]


def reshards_on_get():
    """hyperdsd, but every get reshards the FSDP2 modules a forward left
    unsharded first (as model.state_dict() does): right values, a changed
    sharding state, which only a get in the middle of a loop can see (LOOP-1)."""
    base = replace(load_adapter("hyperdsd"), functions_are_iut=False)

    def resharding(fn):
        def call(model, *args, **kwargs):
            from conformance.adapters import iut_call

            with iut_call():
                for module in _unsharded_modules(model):
                    module.reshard()
                return fn(model, *args, **kwargs)

        return call

    return replace(
        base,
        name="reshards-on-get",
        version="0",
        get_model_state_dict=resharding(base.get_model_state_dict),
        get_optimizer_state_dict=resharding(base.get_optimizer_state_dict),
        set_model_state_dict=_own(base.set_model_state_dict),
        set_optimizer_state_dict=_own(base.set_optimizer_state_dict),
    )


def stale_unsharded_copy():
    """hyperdsd, but a model load into FSDP2 modules that a forward left
    unsharded copies into the sharded parameters and then gathers them back
    from before the load, as if the unsharded copy had been kept: the next
    forward computes with the old values. Only a set in the middle of a loop
    reaches it (LOOP-2)."""
    from torch.distributed.tensor import DTensor

    base = replace(load_adapter("hyperdsd"), functions_are_iut=False)

    def set_model_state_dict(model, sd, *, options=None):
        from conformance.adapters import iut_call

        with iut_call():
            stale = [(m, [p.detach().clone() for p in m.parameters()]) for m in _unsharded_modules(model)]
            out = base.set_model_state_dict(model, sd, options=options)
            for module, old in stale:
                module.unshard()
                with torch.no_grad():
                    for p, value in zip(module.parameters(), old):
                        if not isinstance(p, DTensor):
                            p.copy_(value)
            return out

    return replace(
        base,
        name="stale-unsharded-copy",
        version="0",
        set_model_state_dict=set_model_state_dict,
        get_model_state_dict=_own(base.get_model_state_dict),
        get_optimizer_state_dict=_own(base.get_optimizer_state_dict),
        set_optimizer_state_dict=_own(base.set_optimizer_state_dict),
    )


def frozen_keep_their_own_state():
    """hyperdsd, but a load into an optimizer that has stepped skips the
    parameters that no longer require gradients, as if their state could not
    have changed: they keep the target's own state instead of the
    checkpoint's. A fresh target has none to keep, so only a resume into a
    warm optimizer with parameters frozen after training reaches it (OPT-PART-3)."""
    base = replace(load_adapter("hyperdsd"), functions_are_iut=False)

    def set_optimizer_state_dict(model, optimizers, osd, *, options=None):
        from conformance.adapters import iut_call

        with iut_call():
            optims = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
            kept = [
                (o, p, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in o.state[p].items()})
                for o in optims
                for g in o.param_groups
                for p in g["params"]
                if not p.requires_grad and p in o.state
            ]
            out = base.set_optimizer_state_dict(model, optimizers, osd, options=options)
            for o, p, entry in kept:
                o.state[p] = entry
            return out

    return _judged(base, "frozen-keep-their-own-state", set_optimizer_state_dict=set_optimizer_state_dict)


# A value no report may show (SPEC §4, 1.4: a report names tensors, never
# prints their values). Built, not written out, so that no traceback's
# source line shows it either.
PLANTED = 4000 + 242.25


def _planted(like: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.full(tuple(like.shape) or (3,), PLANTED))


def tensor_messages():
    """hyperdsd, with tensors where reports would print them: the model get
    returns a tensor as a key and a wrong value under a real one; a full
    optimizer get raises a KeyError on a parameter it made; the optimizer set
    raises an error whose text embeds a tensor's printout."""
    base = load_adapter("hyperdsd")
    own = _own(base.get_model_state_dict)

    def get_model_state_dict(model, **kw):
        sd = own(model, **kw)
        first = next(iter(sd))
        wrong = _planted(sd[first])
        return {**sd, first: wrong[..., :1] if wrong.dim() else wrong, wrong: _planted(wrong)}

    def get_optimizer_state_dict(model, optims, **kw):
        from conformance.adapters import iut_call

        if not getattr(kw.get("options"), "full_state_dict", False):
            return _own(base.get_optimizer_state_dict)(model, optims, **kw)
        with iut_call():
            raise KeyError(_planted(next(iter(model.parameters()))))

    def set_optimizer_state_dict(model, optims, sd, **kw):
        from conformance.adapters import iut_call

        with iut_call():
            raise ValueError(f"cannot load {_planted(next(iter(model.parameters())))!r} here")

    return _judged(
        base,
        "tensor-messages",
        get_model_state_dict=get_model_state_dict,
        get_optimizer_state_dict=get_optimizer_state_dict,
        set_optimizer_state_dict=set_optimizer_state_dict,
    )
