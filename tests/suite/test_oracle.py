"""The suite's reference runs: the uninterrupted run a resumed one is
compared with comes from running the source ahead and putting it back
(conformance.world.resuming._run_ahead); these check that this is exactly a fresh
run, that a setup that does not come back is the suite's error, and that
a kept source a save changed is not used again."""

import oracle_tasks
import pytest
from helpers import run_task


@pytest.mark.parametrize(
    "layout,world_size,optimizer,scheduler",
    [
        ("single", 1, "custom", True),  # a string in the optimizer state, and a scheduler
        ("fsdp2", 2, "adamw", False),
        ("hsdp2x2", 4, "adam_amsgrad", True),
        ("pp2", 2, "sgd", False),
    ],
)
def test_running_ahead_gives_the_uninterrupted_run_and_puts_the_source_back(
    pools, layout, world_size, optimizer, scheduler
):
    problems = run_task(
        pools,
        world_size,
        oracle_tasks.run_ahead_is_the_uninterrupted_run,
        layout=layout,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    assert problems == [[]] * world_size


def test_a_source_that_does_not_come_back_is_refused(pools):
    (message,) = run_task(pools, 1, oracle_tasks.run_ahead_refuses_a_setup_that_does_not_come_back)
    assert message.startswith("the suite could not put a trained setup back as it was"), message
    assert "state[" in message, message


@pytest.mark.parametrize("layout,world_size", [("fsdp2", 2), ("hsdp2x2", 4), ("pp2xfsdp2", 4)])
def test_parameters_are_sharded_again_after_a_step(pools, layout, world_size):
    assert run_task(pools, world_size, oracle_tasks.sharded_between_steps, layout=layout) == [[]] * world_size


def test_a_source_that_a_save_changed_is_built_afresh(pools):
    assert run_task(pools, 1, oracle_tasks.a_changed_source_is_not_kept) == [[]]


WARM_CASES = [("single", 1, "adamw"), ("fsdp2", 2, "adagrad"), ("pp2", 2, "sgd")]


@pytest.mark.parametrize("layout,world_size,optimizer", WARM_CASES)
def test_a_warm_target_holds_its_own_value_wherever_the_checkpoint_has_one(pools, layout, world_size, optimizer):
    task = oracle_tasks.warm_target_differs_everywhere
    problems = run_task(pools, world_size, task, layout=layout, optimizer=optimizer)
    assert problems == [[]] * world_size


def test_a_tolerance_by_state_key_forgives_rounding_noise_and_nothing_larger():
    """Resharding compares within a tolerance relative to the largest value
    of each kind: a value that is rounding noise may differ by noise, not
    by a fraction of the values around it."""
    import torch

    from conformance.judging.oracle import diff_values

    big = {"exp_avg": torch.tensor([1e-2, 2e-2]), "exp_avg_sq": torch.tensor([1e-4, 2e-4])}
    want = {"a": big, "b": {"exp_avg": torch.tensor([3e-17]), "exp_avg_sq": torch.tensor([1e-33])}}
    noisy = {"a": big, "b": {"exp_avg": torch.tensor([-2e-17]), "exp_avg_sq": torch.tensor([3e-33])}}
    assert diff_values(want, noisy, "state", 1e-6) != []  # relative to themselves, noise differs wholly
    atol_of = {"exp_avg": 1e-6 * 2e-2, "exp_avg_sq": 1e-6 * 2e-4}
    assert diff_values(want, noisy, "state", 1e-6, atol_of=atol_of) == []
    lost = {"a": big, "b": {"exp_avg": torch.tensor([3e-17]), "exp_avg_sq": torch.tensor([1e-9])}}
    (problem,) = diff_values(want, lost, "state", 1e-6, atol_of=atol_of)
    assert problem.startswith("state['b']['exp_avg_sq']: values differ (rtol 1e-06, atol 2e-10)"), problem


@pytest.mark.parametrize("world_size,mesh", [(2, "2"), (4, "4"), (4, "2x2")])
def test_dtensors_gathered_at_once_are_their_full_tensors(pools, world_size, mesh):
    problems = run_task(pools, world_size, oracle_tasks.gathered_dtensors_are_full_tensors, mesh_spec=mesh)
    assert problems == [[]] * world_size
