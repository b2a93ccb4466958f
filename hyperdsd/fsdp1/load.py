"""A load's end on an FSDP1 model, through its twin (:class:`hyperdsd.fsdp1.twin.FSDP1Twin`).

Once a load is planned against the twin, :meth:`FSDP1Load.land` lands a
broadcast's pieces straight in FSDP1's flat parameters' shards
(:mod:`.landing`); once it is agreed and applied to the twin,
:meth:`FSDP1Load.write_back` writes what the twin holds into FSDP1's flat
shards (:mod:`.model_writeback`), its optimizers' state and their param
groups (:mod:`.state_refill`, :mod:`.state_writeback`).
"""

from __future__ import annotations

from .landing import BroadcastLanding, owners
from .model_writeback import write_model
from .state_refill import refill_state
from .state_writeback import StateWriteBack
from .twin import FSDP1Twin


class FSDP1Load:
    """One load into an FSDP1 model and its optimizers, through their twin
    (FSDP1's :class:`hyperdsd.wrappers.TwinLoad`)."""

    def __init__(self, twin: FSDP1Twin):
        self.twin = twin
        self.owner = owners(twin)
        self.landing = BroadcastLanding(twin, self.owner)

    def land(self, model_plan, optim_plan) -> None:
        """Route a broadcast load's pieces straight into FSDP1's flat
        parameters' shards (:meth:`BroadcastLanding.land`); called after
        planning, before the agreement."""
        self.landing.land(model_plan, optim_plan)

    def write_back(self, model_plan, optim_plan) -> None:
        """Write what the twin now holds into the FSDP1 model and optimizers
        (after a load, whose plans are given, has been agreed and applied to
        the twin; None: that part was not loaded)."""
        if model_plan is not None:
            write_model(self.twin, model_plan, self.landing.landed)
        if optim_plan is not None:
            if self.twin.lazy_state:
                refill_state(self.twin, optim_plan)
            StateWriteBack(self.twin, self.owner, self.landing.state_landed).run()
