"""Columns worked a block at a time, so that each block stays in cache.

hyperdsd plans and checks tens of thousands of small tensors a column at a
time: ``map`` and ``zip`` over every parameter's value, in C, several passes
one after another. Each pass touches every object of its column (the tensor,
its storage, the dict that holds it). Over a whole column of a 50,000-key
model those objects no longer fit in a core's cache, so each pass fetches
them from memory again, and a key's cost grows with the model. Run over
blocks of :data:`BLOCK` positions, every pass but the first finds a block's
objects where the one before left them. A block is still long enough that
the per-block Python (a few calls and lists) is a small part of its cost.
"""

from __future__ import annotations

BLOCK = 512  # (read at each call: tests set it small, to run every pass over several blocks)


def blocks(n: int) -> list[slice]:
    """The positions ``0 .. n - 1`` of a column, as consecutive slices of at most :data:`BLOCK`."""
    return [slice(start, start + BLOCK) for start in range(0, n, BLOCK)]
