"""hyperdsd on FSDP1 models, a wrapper layout (:mod:`hyperdsd.wrappers`;
:mod:`.layout` is its entry), read and loaded through a twin in FSDP2's
layout.

The state side, one rank's arithmetic: :mod:`.unit_geometry` (which elements
of each parameter's rows a rank's flat shard holds), :mod:`.units` (a
unit's layout, the twin module and optimizers built from rows) and
:mod:`.summaries` (what a rank tells the others of its state). The
transport side: :mod:`.unit_moves` (flat shards to rows and back, many units
in one exchange), :mod:`.full_moves` (flat shards to full tensors) and
:mod:`.stacks` (alike units moved as one stack). On them: :mod:`.twin`
reads an FSDP1 model into the canonical layout (each original parameter a
DTensor sharded by rows), :mod:`.landing` lands a load in the flat shards
and writes it back, :mod:`.streaming` gathers a full get from the flat
shards a run of parameters at a time.
"""
