"""Param groups: how a model's parameters are split into groups, each with
its own hyperparameters, and where groups without parameters go. Several
groups with different hyperparameters are the norm (SPEC §2), and a setup
built with another seed has other values, so that they can only come from a
checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class GroupSpec:
    """How parameters are split into groups, and where empty groups go.

    ``empty_at`` lists positions (in the final group list) of groups without
    parameters; each gets its own lr, weight decay and ``name``. ``scale``
    multiplies every group's lr and weight decay: a target built with
    another scale than the checkpoint's shows a load that loses them.
    """

    split: bool = True
    empty_at: tuple[int, ...] = ()
    scale: float = 1.0
    extra: tuple[tuple[str, object], ...] = ()  # extra fields on every group
    router_group: bool = False  # the routers (ModelConfig.router) in a group of their own, second
    # The groups with parameters in reverse order, each listing its parameters
    # in reverse order; empty groups keep their positions (see ``reordered``).
    reverse: bool = False
    # Only the target (a setup built with a seed other than the source's 0) is
    # reversed: a checkpoint loads into an optimizer that lists its groups in
    # another order, which pairing groups by their FQNs must not notice.
    target_reverse: bool = False
    # Groups cut by position instead of by role: group i holds the parameters
    # from ``cuts[i - 1]`` up to ``cuts[i]``, each group its own hyperparameters
    # (SPEC SCALE: groups that end where no block of keys would).
    cuts: tuple[int, ...] = ()

    @classmethod
    def for_seed(cls, seed: int, **kw) -> "GroupSpec":
        """Setups built with another seed differ in their hyperparameters too."""
        return cls(scale=1.0 + 0.5 * seed, **kw)


def param_groups(named_params: list[tuple[str, nn.Parameter]], spec: GroupSpec = GroupSpec()) -> list[dict]:
    """Groups by role: embedding, matrices (decayed), vectors (not decayed); or cut by position (``spec.cuts``)."""
    extra = dict(spec.extra)
    if spec.cuts:
        bounds = [0, *(min(cut, len(named_params)) for cut in spec.cuts), len(named_params)]
        groups = [
            {
                "params": [p for _, p in named_params[start:stop]],
                "lr": 1e-2 * (1 + i) * spec.scale,
                "weight_decay": 0.01 * (i + 1) * spec.scale,
                **extra,
            }
            for i, (start, stop) in enumerate(zip(bounds, bounds[1:]))
            if stop > start
        ]
    elif not spec.split:
        groups = [{"params": [p for _, p in named_params], "lr": 1e-2 * spec.scale, **extra}]
    else:
        roles: dict[str, list] = {"embed": [], "router": [], "decay": [], "no_decay": []}
        for name, p in named_params:
            if spec.router_group and ".router." in name:
                role = "router"
            else:
                role = "embed" if "embedding" in name else ("decay" if p.dim() >= 2 else "no_decay")
            roles[role].append(p)
        settings = {"embed": (5e-3, 0.01), "router": (3e-2, 0.05), "decay": (1e-2, 0.1), "no_decay": (2e-2, 0.001)}
        groups = [
            {"params": ps, "lr": settings[r][0] * spec.scale, "weight_decay": settings[r][1] * spec.scale, **extra}
            for r, ps in roles.items()
            if ps
        ]
    if spec.reverse:
        groups = reordered(groups)
    for i, pos in enumerate(sorted(spec.empty_at)):
        empty = {
            "params": [],
            "lr": (0.5 + i) * spec.scale,
            "weight_decay": 0.01 * (i + 1) * spec.scale,
            "name": f"empty{i}",
            **extra,
        }
        groups.insert(min(pos, len(groups)), empty)
    return groups


def reordered(groups: list[dict]) -> list[dict]:
    """``groups`` with the ones that have parameters in reverse order, each
    with its parameters reversed, and empty groups where they were: what
    :attr:`GroupSpec.reverse` builds from the groups it would build otherwise.
    Works on optimizers' groups and on snapshots' (FQNs for parameters)."""
    full = [{**g, "params": list(g["params"])[::-1]} for g in groups if g["params"]][::-1]
    return [full.pop(0) if g["params"] else g for g in groups]


# -- optimizers -----------------------------------------------------------
