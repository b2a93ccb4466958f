"""What exploration may draw, and how: the layouts and modes an adapter
declares (:func:`choices`) and a hypothesis strategy of scenarios within
them (:func:`strategy`), each field shrinking towards the base model."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..adapters import MODES
from ..modes import mode_of
from ..running.generated import scenario_case
from ..running.runner import undeclared
from ..world.loops import POINTS
from ..world.policies import VARIANTS
from ..world.scenario import (
    DRAWN,
    DRAWN_LAYOUTS,
    DTYPES,
    EXTRA_STATE,
    GROUP_ORDERS,
    MODEL_KEYS,
    MODEL_KEYS_MODES,
    OPTIMIZERS,
    Scenario,
    reshard_problems,
)


class ExploreUsageError(ValueError):
    """A request exploration cannot serve (a budget that does not parse, nothing declared to draw)."""


def parse_budget(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1h`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text or "")
    if not m or float(m.group(1)) <= 0:
        raise ExploreUsageError(f"expected a budget such as 90s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass(frozen=True)
class Choices:
    """What scenarios may contain for one adapter and set of world sizes."""

    modes_of: tuple[tuple[str, tuple[str, ...]], ...]  # (layout, modes declared on it), simplest first
    optimizers: tuple[str, ...] = OPTIMIZERS
    policies: tuple[str, ...] = ()  # FSDP2 policy variants, where the adapter declares the layout "policies"

    @property
    def layouts(self) -> tuple[str, ...]:
        return tuple(layout for layout, _ in self.modes_of)

    def modes(self, layout: str) -> tuple[str, ...]:
        return dict(self.modes_of)[layout]


def choices(adapter, world_sizes) -> Choices:
    """The layouts and modes whose round trip the adapter declares (SPEC §1),
    on the world sizes given: the same rule as the matrix's (registry.needs_of)."""
    allowed = set(world_sizes)
    modes_of = []
    for layout in DRAWN_LAYOUTS:
        if DRAWN[layout].world_size not in allowed:
            continue
        modes = tuple(
            m for m in MODES if not undeclared(adapter, scenario_case(Scenario(layout=layout, mode=m), "OPT-RT-1"))
        )
        if modes:
            modes_of.append((layout, modes))
    if not modes_of:
        raise ExploreUsageError(f"{adapter.name} declares no round trip on a layout of world sizes {sorted(allowed)}")
    # reshard_after_forward=2 makes fully_shard build a mesh, and so process
    # groups torch never frees, at every call: hundreds of draws would leave a
    # rank with thousands of threads. The matrix runs it in a bounded number of cases.
    drawn = tuple(v for v in VARIANTS if v != "reshard2") if "policies" in adapter.layouts else ()
    return Choices(tuple(modes_of), policies=drawn)


def strategy(ch: Choices):
    """A hypothesis strategy of scenarios within ``ch``; each field shrinks
    towards the base model (fewer layers, smaller dims, features off, the
    first layout, mode and optimizer, fewer steps, a fresh target)."""
    from hypothesis import strategies as st

    @st.composite
    def scenarios(draw):
        layout = draw(st.sampled_from(ch.layouts))
        f = {"layout": layout, "mode": draw(st.sampled_from(ch.modes(layout)))}
        f["optimizer"] = draw(st.sampled_from(ch.optimizers))
        pp = DRAWN[layout].pp
        f["n_layers"] = draw(st.integers(max(1, pp), 3))
        f["dim"], f["hidden"] = draw(st.integers(1, 9)), draw(st.integers(1, 12))
        f["vocab"], f["aux_out"] = draw(st.integers(2, 16)), draw(st.integers(1, 5))
        f["dtype"] = draw(st.sampled_from(DTYPES))
        # Every draw is made whatever the others gave, and ignored where it
        # does not apply: the choices stay aligned, so hypothesis can turn
        # one off (a pipeline, one group) without shifting the rest.
        f["tie"] = draw(st.booleans()) and pp == 1
        f["lazy"], f["frozen"], f["adapter"], f["router"] = (draw(st.booleans()) for _ in range(4))
        f["extra_state"] = draw(st.sampled_from(EXTRA_STATE))
        f["one_group"] = draw(st.booleans())
        f["empty_at"] = tuple(sorted(draw(st.sets(st.integers(0, 5), max_size=3))))
        f["router_group"] = draw(st.booleans()) and f["router"] and not f["one_group"]
        f["custom_fields"] = draw(st.booleans())
        f["scale"] = draw(st.sampled_from((1.0, 0.5, 2.0)))
        f["scheduler"] = draw(st.booleans())
        f["before"], f["after"] = draw(st.sampled_from((1, 2, 0, 3))), draw(st.sampled_from((1, 2)))
        f["warm"] = draw(st.sampled_from((0, 1, 2)))
        reshard, target = draw(st.booleans()), draw(st.sampled_from(ch.layouts))
        model_keys = draw(st.sampled_from(MODEL_KEYS))
        f["group_order"] = draw(st.sampled_from(GROUP_ORDERS))
        policy = draw(st.sampled_from(("",) + ch.policies))
        loop_point = draw(st.sampled_from(("",) + tuple(POINTS)))
        freeze_after = draw(st.booleans())
        s = Scenario(**f)
        if model_keys and mode_of(f["mode"]) in MODEL_KEYS_MODES and pp == 1:
            s = replace(s, model_keys=model_keys)
        for extra in ({"policy": policy}, {"loop_point": loop_point}, {"freeze_after": freeze_after}):
            drawn = replace(s, **extra)
            try:
                drawn.validate()
            except ValueError:
                continue  # not on this layout, or not with what was drawn before
            s = drawn
        if reshard:
            resharded = replace(s, reshard_to=target)
            if not reshard_problems(resharded):
                return resharded
        return s

    return scenarios()
