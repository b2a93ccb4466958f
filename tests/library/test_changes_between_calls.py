"""What a call works out (verdicts, layouts, plans, runs) holds for that call
alone: a model or optimizer changed between calls (sharded again, a state
dtype changed, parameters regrouped or replaced, a model cast, a scheduler's
new lr) loads and reads exactly as a first call would."""

import change_tasks
import pytest
from helpers import run_task


@pytest.mark.parametrize("mode", ["nested", "flat"])
def test_sets_after_the_model_and_optimizer_change(pools, mode):
    assert run_task(pools, 2, change_tasks.sets_after_changes, mode=mode) == [True, True]


def test_flat_gets_after_the_optimizer_changes(pools):
    assert run_task(pools, 2, change_tasks.flat_gets_after_changes) == [True, True]


def test_broadcast_sets_after_the_model_and_optimizer_change(pools):
    assert run_task(pools, 2, change_tasks.broadcasts_after_changes) == [True, True]


def test_a_replaced_parameter_and_a_cast_model(pools):
    assert run_task(pools, 1, change_tasks.plain_model_changes) == [True]


# Each check above, with every column worked in blocks of 2 (hyperdsd.blocks): the same results.
@pytest.mark.parametrize(
    "world, task, kwargs",
    [
        (2, change_tasks.sets_after_changes, {"mode": "nested"}),
        (2, change_tasks.sets_after_changes, {"mode": "flat"}),
        (2, change_tasks.flat_gets_after_changes, {}),
        (2, change_tasks.broadcasts_after_changes, {}),
        (1, change_tasks.plain_model_changes, {}),
    ],
    ids=["sets-nested", "sets-flat", "flat-gets", "broadcasts", "plain-model"],
)
def test_the_same_in_blocks_of_two(pools, world, task, kwargs):
    assert run_task(pools, world, change_tasks.in_blocks_of, size=2, task=task, **kwargs) == [True] * world


def test_blocks_that_take_different_paths(pools):
    assert run_task(pools, 2, change_tasks.sets_across_blocks) == [True, True]


def test_gets_in_blocks_give_what_they_give_in_one(pools):
    assert run_task(pools, 2, change_tasks.gets_across_blocks) == [True, True]
