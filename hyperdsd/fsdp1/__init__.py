"""hyperdsd on FSDP1 models, through a twin in FSDP2's layout: ``twin`` reads
an FSDP1 model into the canonical layout (each original parameter a DTensor
sharded by rows), ``landing`` lands a load in the flat layout and writes it
back into the flat shards, ``streaming`` gathers a full get from the flat
shards a run of parameters at a time. The flat-shard geometry they share is
``hyperdsd.state.flat_shards`` (one rank's arithmetic) and
``hyperdsd.transport.flat_shards`` (what moves between ranks)."""
