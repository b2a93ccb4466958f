"""hyperdsd's distributed paths on real CPU ranks: batched gathers, bucketed
scatters, agreement, and interoperability with torch's implementation."""

import dist_tasks
import pytest
from helpers import run_task


def run(pools, world_size, fn, **kwargs):
    return run_task(pools, world_size, getattr(dist_tasks, fn), **kwargs)


@pytest.mark.parametrize("mesh, root", [("4", False), ("4", True), ("2x2", False), ("2x2", True)])
@pytest.mark.parametrize("big", [False, True], ids=["small", "with-large"])
def test_gather_in_small_buckets_with_uneven_and_empty_shards(pools, mesh, root, big):
    values = run(pools, 4, "gather", mesh=mesh, root=root, bucket_bytes=64, big=big)
    assert values[0] == (10 if big else 6)


@pytest.mark.parametrize("root", [False, True])
def test_gather_of_large_pieces_in_one_bucket(pools, root):
    """Runs of pieces too large to stack, several in a bucket, uneven among ranks."""
    assert run(pools, 4, "gather", mesh="4", root=root, bucket_bytes=1 << 26, big=True)[0] == 10


def test_gather_on_three_ranks_uneven(pools):
    assert run(pools, 3, "gather", mesh="3", root=False, bucket_bytes=40)[0] == 6


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("big", [False, True], ids=["small", "with-large"])
def test_scatter_delivers_each_rank_only_its_pieces(pools, world_size, big):
    assert all(run(pools, world_size, "scatter", bucket_bytes=48, big=big))


@pytest.mark.parametrize("world_size", [2, 4])
def test_scatter_delivers_runs_of_elements_uneven_and_large_point_to_point(pools, world_size):
    assert all(run(pools, world_size, "scatter", bucket_bytes=48, big=True, runs=True))


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 4096])
def test_scatter_packs_small_tensors_by_group(pools, bucket_bytes):
    """One bucket, and many (a group split across buckets)."""
    assert run(pools, 4, "scatter_many", bucket_bytes=bucket_bytes) == [240] * 4


@pytest.mark.parametrize("extra_state", [False, True], ids=["plain", "extra-state"])
def test_get_reads_an_unsharded_model_without_resharding_it(pools, extra_state):
    keys = 15 if extra_state else 12  # three Linear pairs' weights and biases, and three extra states
    assert run(pools, 2, "read_unsharded", extra_state=extra_state) == [keys, keys]


@pytest.mark.parametrize("reshard_after_forward", [False, 1], ids=["noreshard", "int1"])
@pytest.mark.parametrize("mode", ["sharded", "full", "full_cpu", "flat", "dcp"])
def test_a_get_after_an_eval_forward_resumes_exactly(pools, mode, reshard_after_forward):
    """The parameters left unsharded by an evaluation forward (SPEC LOOP-1)."""
    assert run(pools, 2, "loop_resume", mode=mode, reshard_after_forward=reshard_after_forward) == [True, True]


@pytest.mark.parametrize("broadcast", [False, True], ids=["sharded", "broadcast"])
def test_a_users_load_post_hook_sees_the_whole_load_on_fsdp2(pools, broadcast):
    assert run(pools, 2, "post_hook_load", broadcast=broadcast) == [True, True]


def test_a_model_on_part_of_the_world_keeps_its_collectives_there(pools):
    values = run(pools, 4, "group_rule")
    assert values == [[0, 1], None, [2, 3], None]


def test_agreement_raises_on_every_rank(pools):
    assert run(pools, 4, "agree", bad_rank=1) == ["raised"] * 4


@pytest.mark.parametrize("layout", ["single", "fsdp2"])
@pytest.mark.parametrize("writer, reader", [("torch", "hyperdsd"), ("hyperdsd", "torch")])
@pytest.mark.parametrize("mode", ["sharded", "flat", "dcp", "flat_dcp"])
def test_interop_with_torch(pools, layout, writer, reader, mode):
    world_size = 1 if layout == "single" else 2
    assert (
        run(pools, world_size, "interop", layout=layout, writer=writer, reader=reader, mode=mode) == [True] * world_size
    )


def test_set_state_dict_broadcast_with_empty_dicts_off_rank_0(pools):
    assert run(pools, 2, "combined_broadcast") == [True, True]


@pytest.mark.parametrize("writer, broadcast", [(None, False), (0, False), (1, False), (None, True), (0, True)], ids=str)
def test_a_saved_template_is_no_state_unless_any_rank_sees_real_values(pools, writer, broadcast):
    kept = writer is not None
    assert run(pools, 2, "step0_agreement", writer=writer, broadcast=broadcast) == [(kept, [])] * 2


@pytest.mark.parametrize("writer, broadcast", [(None, False), (1, False), (None, True), (0, True)], ids=str)
def test_a_saved_sgd_template_is_no_state_unless_any_rank_sees_real_values(pools, writer, broadcast):
    got = run(pools, 2, "stepless_agreement", writer=writer, broadcast=broadcast)
    assert got[0] == got[1]
    assert (len(got[0]) > 1) == (writer is not None), got[0]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "fresh"])
def test_dtensor_state_of_other_placements_is_redistributed(pools, warm):
    assert run(pools, 2, "other_placements", warm=warm) == [True, True]


@pytest.mark.parametrize("fsdp", [2, 1], ids=["fsdp2", "fsdp1"])
def test_calls_leave_nothing_for_the_cyclic_collector(pools, fsdp):
    """A call's objects are freed when it returns, none kept by a cycle."""
    for left in run(pools, 2, "garbage_left", fsdp=fsdp):
        for call, (kinds, made_here) in left.items():
            assert not made_here, (call, made_here)
            if not call.startswith("checkpoint"):  # (torch.save's pickler classes aside)
                assert not kinds, (call, kinds)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_layout_wraps_a_local_tensor_as_from_local_does(pools, world_size):
    assert run(pools, world_size, "wrap_as_from_local") == [10] * world_size
