"""The state layer: reading, checking and applying state on one rank.

Names (:mod:`.fqn`), the model's and the optimizers' state (:mod:`.model`,
:mod:`.optimizer`), a state dict to load parsed against its target
(:mod:`.optimizer_input`), load plans that check everything before anything
changes (:mod:`.optimizer_load`; the plans' types :mod:`.load_plan`, their
checks :mod:`.load_checks`), placeholder state for
never-stepped optimizers (:mod:`.placeholders`, :mod:`.placeholder_state`,
:mod:`.saved_placeholders`) and the flat layout (:mod:`.flat`). Nothing here issues a
collective: who sends what to whom is :mod:`hyperdsd.transport`'s.
"""
