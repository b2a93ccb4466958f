"""The many-key model (SPEC SCALE, 1.5): thousands of tiny parameters, with
what breaks code that works them in blocks where a block would end.

The base model of the other clauses (:mod:`.models`) has about twenty
parameters: no column of keys an implementation works through (a group's
parameters, a state key across them, the modules of a model) is longer than
any block, bucket or batch it may cut such a column into. This one is the
base model with :data:`LANES` tiny lanes in each of :data:`BLOCKS` blocks,
2,133 parameters in three groups cut at :data:`CUTS`: 1,037, 523 and 573
parameters, no group a multiple of 64, the first longer than 1,024. So a
block size of any power of two from 64 to 512 ends inside every group, twice
or more in the first, and 1,024 once; what follows a block's end is where the
hard parts sit. By their position in the parameter list (the optimizer's
order; a pipeline stage numbers its own from 0):

- lanes that never run, so never get a gradient nor state (:data:`LAZY_AT`):
  the first lane, the lane across 511-512, the last of group 0, the first of
  the float64 block, the lane across the second cut (1559-1560), the last lane;
- lanes frozen after training, which keep their state (:data:`FROZEN_AT`):
  beside the first, the 511-512 and the last of those, the first of group 1
  (1,037) and the last of the float64 block;
- block 4 (positions 1,065 to 1,330) in float64 amid float32, state alike;
- the head tied to the embedding, the first module and the next to last
  (pipelines, whose stages cannot tie, untied: 2,134 parameters);
- lanes of 3 rows: uneven shards.

Tensors are tiny (a lane is 12 numbers) so that a case stays cheap: the
count, not the bytes, is what this model is for.
"""

from __future__ import annotations

from .models import ModelConfig

BLOCKS = 8
LANES = 130
_IN_BLOCK = 6 + 2 * LANES  # norm, fc1, fc2 (weight, bias each), then each lane's weight and bias
CUTS = (1037, 1560)
OTHER_DTYPE_BLOCK = 4
LAZY_AT = (7, 511, 1035, 1071, 1559, 2127)
FROZEN_AT = (9, 513, 1037, 1329, 2125)


def lane_at(position: int) -> tuple[int, int]:
    """(block, lane) of the lane whose weight or bias is at ``position`` of the whole model's parameters."""
    block, offset = divmod(position - 1, _IN_BLOCK)
    if not 0 <= block < BLOCKS or offset < 6:
        raise ValueError(f"position {position} is not a lane's")
    return block, (offset - 6) // 2


def lane_fqns(positions) -> list[str]:
    out = []
    for block, lane in map(lane_at, positions):
        out += [f"layers.{block}.lanes.{lane}.weight", f"layers.{block}.lanes.{lane}.bias"]
    return out


def config(pipeline: bool = False) -> ModelConfig:
    return ModelConfig(
        n_layers=BLOCKS,
        lanes=LANES,
        lazy_lanes=tuple(map(lane_at, LAZY_AT)),
        other_dtype_block=OTHER_DTYPE_BLOCK,
        tie=not pipeline,
    )


FROZEN = tuple(lane_fqns(FROZEN_AT))
