"""hyperdsd on FSDP1 (FullyShardedDataParallel) models, on CPU ranks over gloo,
where the matrix's FSDP1 cases do not reach (they resume in every mode on
every FSDP1 layout, move DCP checkpoints to and from FSDP2, and load nested
state: tests/suite/test_conformance_hyperdsd.py runs them): FQN keys and
state per original parameter, bad input, checkpoints shared with torch's
own implementation, tied weights, Adagrad's padding, partial loads, the
full get unit by unit, and what a broadcast load sends each rank."""

import fsdp1_tasks
import pytest
from helpers import run_task

KEYS = sorted(
    ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "1.num_batches_tracked"]
    + ["3.0.weight", "3.0.bias", "3.2.weight", "3.2.bias"]
)


def run(pools, world_size, fn, **kwargs):
    return run_task(pools, world_size, getattr(fsdp1_tasks, fn), **kwargs)


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_sharded_get_is_keyed_by_fqn_with_state_per_original_parameter(pools, uop):
    assert run(pools, 2, "sharded_get", uop=uop) == [KEYS, KEYS]


@pytest.mark.parametrize("what", ["model", "optim", "shape"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_bad_input_raises_on_every_rank_and_changes_nothing(pools, uop, what):
    assert run(pools, 2, "bad_input", uop=uop, what=what) == [True, True]


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_never_stepped_optimizer_gives_placeholders_that_dcp_fills(pools, uop):
    assert run(pools, 2, "never_stepped", uop=uop) == [0, 0]


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_get_and_set_after_an_eval_forward_of_shard_grad_op(pools, uop):
    assert run(pools, 2, "loop_point", uop=uop) == [True, True]


@pytest.mark.parametrize("writer", ["torch", "hyperdsd"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_dcp_checkpoint_moves_between_torch_and_hyperdsd(pools, uop, writer):
    """torch's sharded FSDP1 state is ShardedTensor, hyperdsd's DTensor: DCP
    records the same FQNs, global shapes and row chunks for both."""
    assert run(pools, 2, "torch_interop", writer=writer, uop=uop) == [True, True]


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_tied_parameters_keep_both_names_and_one_state(pools, uop):
    names = ["0.bias", "0.weight", "2.bias", "2.weight", "3.bias", "3.weight"]
    state = ["0.bias", "0.weight", "2.bias", "3.bias", "3.weight"]
    assert run(pools, 2, "tied", uop=uop) == [(names, state)] * 2


@pytest.mark.parametrize("mode", ["full_cpu", "sharded"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_adagrad_state_of_ranks_without_elements_and_of_padding_resumes_exactly(pools, uop, mode):
    """Found by the suite's FSDP1 layouts (OPT-RT-1[fsdp1-2-adagrad-bcast], [fsdp1-4-flat-adagrad-full_cpu]):
    a full get took ``step`` from a rank whose Adagrad entry was never stepped, a set dropped that rank's
    entry, and a set zeroed a flat shard's padding, where Adagrad keeps its initial sum."""
    world = 2 if uop else 4  # (four ranks pad the flat shards: 30 and 58 elements)
    assert run(pools, world, "adagrad_resume", uop=uop, mode=mode) == [True] * world


@pytest.mark.parametrize("broadcast", [False, True], ids=["own", "broadcast"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_partial_load_of_other_keys_on_each_rank_ends_as_through_an_eager_twin(pools, uop, broadcast):
    """A load's twin starts empty and reads flat state only where some rank leaves some:
    the same end as a twin that reads it all first."""
    assert run(pools, 2, "partial_load", uop=uop, broadcast=broadcast) == [True, True]


@pytest.mark.parametrize("tied", [False, True], ids=["plain", "tied"])
@pytest.mark.parametrize("mode", ["full", "full_cpu"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_full_get_read_unit_by_unit_equals_one_read_all_first(pools, uop, mode, tied):
    """A full get gathers from FSDP1's flat shards, a run of parameters at a
    time: its result is that of a twin whose rows are read first."""
    assert run(pools, 2, "streamed_full_get", uop=uop, mode=mode, tied=tied) == [True, True]


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_full_get_with_an_optimizer_state_dict_hook_equals_one_read_all_first(pools, uop):
    assert run(pools, 2, "streamed_full_get", uop=uop, mode="full_cpu", hooked=True) == [True, True]


@pytest.mark.parametrize("mode", ["full", "full_cpu"])
def test_a_full_get_of_hybrid_shard_read_unit_by_unit_equals_one_read_all_first(pools, mode):
    got = run(pools, 4, "streamed_full_get", uop=False, mode=mode, strategy="HYBRID_SHARD", mesh="2x2")
    assert got == [True] * 4


@pytest.mark.parametrize("cpu", [False, True], ids=["full", "full_cpu"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_full_get_of_a_never_stepped_optimizer_gathers_its_placeholders(pools, uop, cpu):
    names = sorted(k for k in KEYS if "running" not in k and "num_batches" not in k)
    assert run(pools, 4, "never_stepped_full", uop=uop, cpu=cpu) == [names] + [[] if cpu else names] * 3


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_nested_state_of_other_shapes_is_refused_on_every_rank(pools, uop):
    assert run(pools, 2, "nested_state_refused", uop=uop) == [True, True]


@pytest.mark.parametrize(
    "world, fsdp, uop, strategy, mesh",
    [
        (2, 1, False, "FULL_SHARD", None),
        (2, 1, True, "FULL_SHARD", None),
        (4, 1, False, "FULL_SHARD", None),
        (4, 1, True, "FULL_SHARD", None),
        (4, 1, False, "HYBRID_SHARD", "2x2"),
        (4, 1, True, "HYBRID_SHARD", "2x2"),
        (2, 2, True, None, None),
        (4, 2, True, None, None),
    ],
    ids=[
        "fsdp1-2-flat-params",
        "fsdp1-2-orig-params",
        "fsdp1-4-flat-params",
        "fsdp1-4-orig-params",
        "hsdp1-2x2-flat-params",
        "hsdp1-2x2-orig-params",
        "fsdp2-2",
        "fsdp2-4",
    ],
)
def test_a_broadcast_load_of_optimizer_state_sends_each_rank_its_share(pools, world, fsdp, uop, strategy, mesh):
    """As for a model (MODEL-3): a non-root rank receives the part of each
    per-element state tensor it holds (on FSDP1, its flat shards' part, not
    rows it would then exchange into them), every parameter's scalars and one
    tensor in flight."""
    got = run(pools, world, "optimizer_broadcast_traffic", fsdp=fsdp, uop=uop, strategy=strategy, mesh=mesh)
    for rank, (received, bound) in enumerate(got[1:], start=1):
        assert received <= bound, f"rank {rank} received {received} bytes of state; its share and one tensor: {bound}"


@pytest.mark.parametrize("fresh_target", [False, True], ids=["stepped-target", "fresh-target"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_broadcast_load_ends_as_a_full_load_of_the_same_dicts(pools, uop, fresh_target):
    """Landed in the optimizer's own state (a stepped target) or in a buffer (a
    fresh one), with one entry a saved template that ends without state."""
    assert run(pools, 2, "broadcast_equals_full_load", uop=uop, fresh_target=fresh_target) == [True, True]


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_broadcast_loads_state_that_lands_nowhere_straight_gets_rows_of_its_own(pools, uop):
    """A broadcast load's twin state stands in hollow, one tensor shared by many
    values; what does not land in the flat shards is received into rows of its
    own, and ends as a full load of the same dicts."""
    assert run(pools, 2, "broadcast_equals_full_load", uop=uop, fresh_target=False, unlanded=True) == [True, True]


@pytest.mark.parametrize("cpu", [False, True], ids=["every-rank", "rank0-cpu"])
@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_full_get_hands_out_copies_of_what_it_does_not_gather(pools, uop, cpu):
    """Every key's step is its own tensor where a rank hands it out (rank 0 alone with cpu_offload)."""
    held = run(pools, 2, "full_get_hands_out_copies", uop=uop, cpu=cpu)
    assert held[0] > 0 and (held[1] > 0) == (not cpu), held


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_an_optimizer_load_hook_changes_what_a_broadcast_load_writes_as_a_full_loads(pools, uop):
    assert run(pools, 2, "hooked_broadcast_equals_full_load", uop=uop) == [True, True]


# (world size, the FSDP1 model's arguments): flat and original parameters on two ranks, HYBRID_SHARD on 2x2
MOVES = [(2, {"uop": False}), (2, {"uop": True}), (4, {"uop": False, "strategy": "HYBRID_SHARD", "mesh": "2x2"})]
MOVES_IDS = ["flat-params", "orig-params", "hybrid-shard"]


@pytest.mark.parametrize("world, model", MOVES, ids=MOVES_IDS)
def test_moves_by_index_equal_moves_piece_by_piece(pools, world, model):
    assert run(pools, world, "indexed_moves_equal_piecewise", **model) == [True] * world


@pytest.mark.parametrize("uop", [False, True], ids=["flat-params", "orig-params"])
def test_a_kept_twin_gets_what_a_new_twin_gets_across_changes(pools, uop):
    assert run(pools, 2, "kept_twin_gets_equal_fresh_ones", uop=uop) == [True, True]


@pytest.mark.parametrize("world, model", MOVES, ids=MOVES_IDS)
def test_alike_units_moved_as_stacks_equal_each_unit_moved_alone(pools, world, model):
    assert run(pools, world, "stacked_moves_equal_unit_by_unit", **model) == [True] * world
