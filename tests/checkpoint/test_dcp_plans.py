"""hyperdsd's global save plan, in one process: the plans and metadata DCP's default planner makes of the
same local plans, item for item and byte for byte, and DCP's own error where DCP refuses them.

Ranks' local plans are built here by hand (write items as DCP's local planner makes them) or from
state dicts through DCP's own local planner; the multi-rank cases (FSDP2, HSDP, pipeline stages) are
in test_checkpoint.py."""

import inspect
import pickle
import random

import pytest
import torch
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from hyperdsd.checkpoint import save_planner as dcp_plans
from hyperdsd.checkpoint.save_planner import SavePlanner, global_save_plan

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _shard(fqn, size, offsets, sizes, dtype=torch.float32, kind=WriteItemType.SHARD) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _tensor(fqn, size, dtype=torch.float32) -> WriteItem:
    """A plain tensor as DCP plans it: one item of type TENSOR, its chunk the whole tensor."""
    return _shard(fqn, size, [0] * len(size), size, dtype, WriteItemType.TENSOR)


def _bytes(fqn) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _plans(items_by_rank, mappings=None) -> list[SavePlan]:
    if mappings is None:
        mappings = [{item.index.fqn: ("sd", item.index.fqn) for item in items} for items in items_by_rank]
    return [SavePlan(list(items), planner_data=m) for items, m in zip(items_by_rank, mappings)]


def _dcps(plans, **kw):
    planner = DefaultSavePlanner(**kw)
    return planner.create_global_plan(pickle.loads(pickle.dumps(plans)))


def _ours(plans, **kw):
    planner = SavePlanner(**kw)
    made = planner.create_global_plan(pickle.loads(pickle.dumps(plans)))
    assert planner.global_plan is made[0] and planner.metadata is made[1]
    return made


def _assert_same(plans, **kw):
    """Our global plans and metadata are DCP's: equal, in the same order, index hints and all, and they
    pickle to the same bytes (what is scattered to the ranks and written as .metadata)."""
    assert global_save_plan(plans, kw.get("dedup_save_to_lowest_rank", False)) is not None  # not DCP's fallback
    theirs, ours = _dcps(plans, **kw), _ours(plans, **kw)
    assert repr(ours) == repr(theirs)
    assert [[i.index.index for i in p.items] for p in ours[0]] == [[i.index.index for i in p.items] for p in theirs[0]]
    assert list(ours[1].state_dict_metadata) == list(theirs[1].state_dict_metadata)
    assert list(ours[1].planner_data or ()) == list(theirs[1].planner_data or ())
    assert pickle.dumps(ours) == pickle.dumps(theirs)
    return ours


def _fsdp(rank, world, fqn, rows, cols=4):
    """Rank ``rank``'s row shard of a (rows, cols) tensor over ``world`` ranks, as FSDP2 shards it."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return _shard(fqn, (rows, cols), (start, 0), (min(per, rows - start), cols))


def test_sharded_replicated_plain_and_bytes_state_plans_as_dcp():
    world = 4
    ranks = []
    for r in range(world):
        items = []
        for layer in range(3):
            for name, rows in (("weight", 8), ("bias", 5)):  # bias: uneven shards, rank 3 empty
                fqn = f"model.layers.{layer}.{name}"
                items.append(_fsdp(r, world, fqn, rows))
                items.append(_fsdp(r, world, f"optim.state.{fqn}.exp_avg", rows))
                items.append(_tensor(f"optim.state.{fqn}.step", ()))  # plain, on every rank
            items.append(_shard(f"model.layers.{layer}.norm", (6,), (0,), (6,)))  # replicated DTensor
        items.append(_bytes("optim.param_groups.0.lr"))
        items.append(_bytes("extra.note"))
        if r == 2:
            items.append(_tensor("extra.only_on_rank_2", (3,)))
        ranks.append(items)
    ours = _assert_same(_plans(ranks))
    kept = [{i.index.fqn for i in p.items} for p in ours[0]]
    # each replicated key written once, by the rank with the least planned so far
    assert sum("model.layers.0.norm" in k for k in kept) == 1 and sum("extra.note" in k for k in kept) == 1
    _assert_same(_plans(ranks), dedup_save_to_lowest_rank=True)


def test_ties_go_where_dcp_sends_them_with_more_ranks_than_a_small_set_holds():
    # Keys replicated over scattered subsets of 12 ranks, all of one size: the plan DCP keeps a key in
    # follows its set's iteration order, which for ints of 8 and more is not ascending.
    rng = random.Random(0)
    world = 12
    ranks = [[] for _ in range(world)]
    for k in range(200):
        holders = sorted(rng.sample(range(world), rng.randint(1, 5)))
        for r in holders:
            ranks[r].append(_tensor(f"k{k}", (2,) if k % 3 else (7, 3)))
    for lowest in (False, True):
        _assert_same(_plans(ranks), dedup_save_to_lowest_rank=lowest)


def test_random_plans_plan_as_dcp():
    rng = random.Random(1)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    for trial in range(30):
        world = rng.randint(1, 10)
        ranks = [[] for _ in range(world)]
        for k in range(rng.randint(0, 40)):
            kind = rng.choice(["sharded", "replicated", "plain", "bytes", "empty"])
            fqn = f"s.{k}"
            if kind == "sharded":
                rows, cols = rng.randint(1, 9), rng.randint(1, 3)
                for r in range(world):
                    ranks[r].append(_fsdp(r, world, fqn, rows, cols))
            else:
                holders = rng.sample(range(world), rng.randint(1, world))
                size = (rng.randint(1, 4),) * rng.randint(0, 2)
                for r in holders:
                    if kind == "bytes":
                        ranks[r].append(_bytes(fqn))
                    elif kind == "empty":
                        ranks[r].append(_tensor(fqn, (0, 3)))
                    else:
                        ranks[r].append(_tensor(fqn, size, dtypes[k % len(dtypes)]))
        for items in ranks:
            rng.shuffle(items)
        mappings = [
            {i.index.fqn: ("sd", f"{i.index.fqn}@{r}") for i in rng.sample(items, len(items))}
            for r, items in enumerate(ranks)
        ]
        _assert_same(_plans(ranks, mappings), dedup_save_to_lowest_rank=trial % 2 == 1)


def test_state_dicts_planned_by_dcp_plan_as_dcp():
    # Local plans from DCP's own local planner: plain tensors of every rank, some alike, and values of
    # other kinds, which it plans as bytes.
    ranks = []
    for r in range(3):
        state = {
            "w": torch.ones(4, 2),
            "own": torch.full((2,), float(r)),
            "step": torch.tensor(5.0),
            "lr": 0.1,
            "name": "run",
            "ids": [1, 2, r],
        }
        ranks.append(create_default_local_save_plan(state, r == 0).items)
    _assert_same(_plans(ranks))
    _assert_same(_plans(ranks), flatten_state_dict=False)


@pytest.mark.parametrize(
    "case",
    [
        "overlap",
        "hole",
        "out of bounds",
        "plain tensor twice",
        "one rank's item twice",
        "bytes then tensor",
        "no chunk",
        "no mappings",
    ],
)
def test_plans_dcp_refuses_raise_what_dcp_raises(case):
    shards = [[_fsdp(r, 2, "w", 4)] for r in range(2)]
    if case == "overlap":
        shards[1] = [_shard("w", (4, 4), (1, 0), (3, 4))]
    elif case == "hole":
        shards[1] = [_shard("w", (4, 4), (3, 0), (1, 4))]
    elif case == "out of bounds":
        shards[1] = [_shard("w", (4, 4), (2, 0), (3, 4))]
    elif case == "plain tensor twice":  # one key at two offsets, as no rank's DCP plans a plain tensor
        shards = [[_tensor("t", (2,))], [_shard("t", (2,), (1,), (1,), kind=WriteItemType.TENSOR)]]
    elif case == "one rank's item twice":
        shards = [[_tensor("a", (2,))], [_tensor("a", (2,)), _bytes("c"), _bytes("c")]]
    elif case == "bytes then tensor":
        shards = [[_bytes("x")], [_fsdp(1, 2, "x", 4)]]
    elif case == "no chunk":
        item = _fsdp(1, 2, "w", 4)
        shards[1] = [
            WriteItem(
                item.index,
                item.type,
                tensor_data=TensorWriteData(None, item.tensor_data.properties, item.tensor_data.size),
            )
        ]
    plans = _plans(shards)
    if case == "no mappings":
        plans[1] = SavePlan(plans[1].items, planner_data=None)
    assert global_save_plan(plans) is None  # DCP's planner is asked, and says why
    with pytest.raises(Exception) as theirs:
        _dcps(plans)
    with pytest.raises(Exception) as ours:
        _ours(plans)
    assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value)


def test_layouts_are_checked_once_each(monkeypatch):
    seen = []
    check = dcp_plans._validate_global_plan

    def spy(plan, metadata):
        seen.extend(metadata.state_dict_metadata)
        return check(plan, metadata)

    monkeypatch.setattr(dcp_plans, "_validate_global_plan", spy)
    ranks = [[_fsdp(r, 2, f"w{k}", 4) for k in range(50)] + [_tensor(f"s{k}", ()) for k in range(50)] for r in range(2)]
    _ours(_plans(ranks))
    assert seen == ["w0", "s0"]


def test_plan_caching_is_left_to_dcp(monkeypatch):
    if "enable_plan_caching" not in inspect.signature(DefaultSavePlanner.__init__).parameters:
        pytest.skip(f"torch {torch.__version__} has no plan caching")
    asked = []
    monkeypatch.setattr(dcp_plans, "global_save_plan", lambda *a: asked.append(a))
    ranks = [[_fsdp(r, 2, "w", 4), _tensor("s", ())] for r in range(2)]
    planner = SavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key = "hyperdsd-test-plan-caching"  # its own entries in DCP's caches
    try:
        made = planner.create_global_plan(_plans(ranks))
    finally:
        for cache in ("_cached_all_plans", "_cached_global_plan", "_cached_metadata"):
            getattr(planner, cache, {}).pop(key, None)
    assert asked == [] and repr(made) == repr(_dcps(_plans(ranks)))
