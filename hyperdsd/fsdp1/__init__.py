"""hyperdsd on FSDP1 models, a wrapper layout (:mod:`hyperdsd.wrappers`;
:mod:`.layout` is its entry), read and loaded through a twin in FSDP2's
layout.

The state side, one rank's arithmetic: :mod:`.unit_geometry` (which elements
of each parameter's rows a rank's flat shard holds), :mod:`.units` (a
unit's layout, the twin's rows and optimizers), :mod:`.twin_tree` (the twin
module built from rows), :mod:`.summaries` (what a rank tells the others of
its state) and :mod:`.twin_entries` (a twin parameter's state entry from
them). The transport side: :mod:`.unit_groups` (a unit's mesh and group,
what every rank of it holds), :mod:`.unit_moves` (flat shards to rows and
back, many units in one exchange), :mod:`.full_moves` (flat shards to full
tensors) and :mod:`.stacks` (alike units moved as one stack). On them:
:mod:`.twin` reads an FSDP1 model into the canonical layout (each original
parameter a DTensor sharded by rows); :mod:`.load` takes a load on from the
twin: :mod:`.landing` lands a broadcast in the flat shards,
:mod:`.model_writeback` and :mod:`.state_writeback` write a load back
(:mod:`.state_refill` first reads the state a lazy twin left unread);
:mod:`.streaming` gathers a full get from the flat shards a run of
parameters at a time, in rounds.
"""
