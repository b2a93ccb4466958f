"""The transport layer: who sends what to whom.

The ranks a model's collectives run among (:mod:`.group`), agreement and
object exchanges (:mod:`.collectives`), full tensors gathered from shards
(:mod:`.gather`) into full state dicts (:mod:`.consolidate`), and pieces of
the root's tensors delivered to the ranks that need them (:mod:`.needs`,
:mod:`.scatter`, :mod:`.delivery`). It moves tensors and small objects and knows nothing of
state dicts' meaning: that is :mod:`hyperdsd.state`'s.
"""
