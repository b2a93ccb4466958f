"""The state layer: reading, checking and applying state on one rank, by topic.

- :mod:`.keys`: names (canonical FQNs, the model index and its cache, the
  children wrappers hide) and the flat layout's keys;
- :mod:`.model`: the model's state, read and loaded;
- :mod:`.optimizer`: the optimizers' state, read (:mod:`.optimizer.state`),
  parsed against its target (:mod:`.optimizer.input`), planned
  (:mod:`.optimizer.plan`, each value by :mod:`.optimizer.values`) and applied;
- :mod:`.loading`: what model and optimizer loads share: the plans' types
  (:mod:`.loading.plan`), each tensor's checks (:mod:`.loading.checks`), loads
  that land in the tensors they replace (:mod:`.loading.in_place`);
- :mod:`.placeholders`: placeholder state for never-stepped optimizers
  (:mod:`.placeholders.marks`, built on a copy by :mod:`.placeholders.scratch`,
  told by its values once saved: :mod:`.placeholders.saved`).

Nothing here issues a collective: who sends what to whom is :mod:`hyperdsd.transport`'s.
"""
