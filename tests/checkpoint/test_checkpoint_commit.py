"""hyperdsd.checkpoint's atomic saves: a save that fails or is cut short,
on any rank and at any stage, leaves the checkpoint committed before, which
the next load returns exactly; load refuses what was never committed; the
Manager keeps the last ``keep`` steps and resumes from the newest committed one.

Faults are injected through the real API on real ranks (checkpoint_tasks):
a storage writer that fails, passed as ``storage_writer``, and SIGKILLs of a
rank, after which a new pool (a restarted job) loads.
"""

import json
import os

import checkpoint_tasks
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_task
from torch import nn

import hyperdsd
from hyperdsd import StateDictError, checkpoint
from hyperdsd.checkpoint import commit

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def run(pools, world_size, fn, **kwargs):
    return run_task(pools, world_size, getattr(checkpoint_tasks, fn), **kwargs)


# -- on ranks --------------------------------------------------------------


def test_plain_dcp_save_over_a_checkpoint_that_fails_on_one_rank_loads_a_mix(pools):
    """The bug, reproduced with plain dcp.save, so that the tests below are known to catch a mix."""
    results = run(pools, 2, "plain_dcp_mixes", layout="fsdp2")
    assert not all(r["first"] for r in results) and not all(r["second"] for r in results), results


@pytest.mark.parametrize(
    "world_size, fault, ranks, async_save",
    [
        (2, "write", [1], ""),
        (2, "write", [0, 1], ""),
        (2, "metadata", [], ""),
        (2, "torn", [1], "future"),
        (2, "write", [1], "next_call"),
        (4, "torn", [2], ""),
        (4, "write", [0, 1, 2, 3], ""),
        (4, "metadata", [], ""),
        (4, "write", [3], "future"),
    ],
)
def test_a_failed_save_raises_alike_and_the_previous_checkpoint_loads_exactly(
    pools, world_size, fault, ranks, async_save
):
    texts = run(
        pools, world_size, "failed_save", layout=f"fsdp{world_size}", fault=fault, ranks=ranks, async_save=async_save
    )
    assert len(set(texts)) == 1, texts
    if fault != "metadata" and not async_save:
        assert f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: OSError" in texts[0], texts[0]


def test_a_failed_first_save_leaves_nothing_that_loads(pools):
    texts = run(pools, 2, "failed_save", layout="fsdp2", fault="torn", ranks=[0], previous=False)
    assert len(set(texts)) == 1, texts


@pytest.mark.parametrize(
    "world_size, where",
    [
        (2, "write"),
        (4, "write"),
        (2, "before_commit"),
        (2, "mid_commit"),
        (4, "mid_commit"),
    ],
)
def test_a_save_cut_short_by_sigkill_leaves_the_previous_checkpoint_for_the_restarted_job(
    pools, tmp_path, world_size, where
):
    from hyperdsd.testing import Task

    kwargs = {"layout": f"fsdp{world_size}", "root": str(tmp_path), "where": where}
    outcome = pools.run(world_size, Task(checkpoint_tasks.crash_in_save, kwargs), 120)
    killed = 1 if where == "write" else 0
    assert outcome.results[killed].status.name == "DIED", outcome.describe()
    run(pools, world_size, "resume_after_crash", layout=f"fsdp{world_size}", root=str(tmp_path), where=where)


def test_the_manager_keeps_steps_skips_a_failed_one_and_resumes_on_ranks(pools):
    assert run(pools, 2, "manager_on_ranks", layout="fsdp2") == [True, True]


# -- in one process ------------------------------------------------------------


def _trained(seed=0, steps=2):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_save_over_an_existing_path_loads_the_new_state_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "latest"
    old, old_opt = _trained(steps=1)
    checkpoint.save(path, old, old_opt)
    new, new_opt = _trained(steps=3)
    checkpoint.save(path, new, new_opt)
    assert checkpoint_tasks.left_in(tmp_path) == ["latest"]
    assert (path / commit.RECORD).is_file()
    fresh, fresh_opt = _trained(seed=1, steps=0)
    checkpoint.load(path, fresh, fresh_opt)
    assert _same(fresh, new) and not _same(fresh, old)


def test_the_metadata_a_commit_leaves_for_dcp_to_send_every_rank_is_emptied_and_the_file_is_whole(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from hyperdsd.checkpoint.save_planner import SavePlanner
    from hyperdsd.checkpoint.writer import Writer

    path = tmp_path / "ckpt"
    model, opt = _trained(steps=1)
    msd, osd = hyperdsd.get_state_dict(model, opt)
    staging = commit.staging_of(path)
    writer = commit.CommittingWriter(Writer(str(staging)), path)
    returned = dcp.save(
        {"model": msd, "optim": osd}, checkpoint_id=str(staging), storage_writer=writer, planner=SavePlanner()
    )
    assert (returned.state_dict_metadata, returned.storage_data, returned.planner_data) == ({}, {}, None)
    on_disk = FileSystemReader(str(path)).read_metadata()
    assert {"model.weight", "optim.state.bias.exp_avg"} <= set(on_disk.state_dict_metadata)
    assert len(on_disk.storage_data) == len(on_disk.state_dict_metadata) and on_disk.planner_data
    fresh, fresh_opt = _trained(seed=1, steps=0)
    checkpoint.load(path, fresh, fresh_opt)
    assert _same(fresh, model)

    class Keeping(Writer):  # a writer of its own finish step may keep the object: it is left whole
        def finish(self, metadata, results):
            super().finish(metadata, results)
            self.kept = metadata

    inner = Keeping(str(staging))
    writer = commit.CommittingWriter(inner, path)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(staging), storage_writer=writer, planner=SavePlanner())
    assert set(inner.kept.state_dict_metadata) == set(on_disk.state_dict_metadata) and inner.kept.storage_data


def test_the_committing_writer_passes_on_its_writers_storage_meta(tmp_path):
    """What DCP records of the save in the checkpoint's metadata comes from the wrapped writer."""
    from hyperdsd.checkpoint.writer import Writer

    inner = Writer(str(tmp_path / "staging"))
    writer = commit.CommittingWriter(inner, tmp_path / "ckpt")
    assert inner.storage_meta() is not None
    assert writer.storage_meta() == inner.storage_meta()


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("no_metadata", "has no .metadata"),
        ("truncated", "its commit recorded"),
        ("missing_file", "which its commit recorded"),
        ("staging_only", "is what a save that did not finish left"),
        ("nothing", "there is no checkpoint at"),
    ],
)
def test_load_refuses_what_was_never_committed(tmp_path, damage, needle):
    path = tmp_path / "latest"
    model, opt = _trained()
    checkpoint.save(path, model, opt)
    data = sorted(p for p in path.iterdir() if p.suffix == ".distcp")
    if damage == "no_metadata":
        (path / ".metadata").unlink()
    elif damage == "truncated":
        os.truncate(data[0], data[0].stat().st_size - 1)
    elif damage == "missing_file":
        data[0].unlink()
    elif damage == "staging_only":
        path.rename(commit.staging_of(path))
    else:
        path = tmp_path / "elsewhere"
    fresh, fresh_opt = _trained(seed=1, steps=0)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateDictError, match=needle):
        checkpoint.load(path, fresh, fresh_opt)
    assert not fresh_opt.state and all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def test_a_plain_dcp_checkpoint_is_checked_against_its_metadata(tmp_path):
    model, opt = _trained()
    msd, osd = hyperdsd.get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    fresh, fresh_opt = _trained(seed=1, steps=0)
    checkpoint.load(tmp_path, fresh, fresh_opt)
    assert _same(fresh, model)
    data = next(p for p in tmp_path.iterdir() if p.suffix == ".distcp")
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(StateDictError, match="its metadata points up to byte"):
        checkpoint.load(tmp_path, fresh, fresh_opt)


def test_a_commit_cut_short_after_setting_the_previous_aside_loads_the_previous(tmp_path):
    path = tmp_path / "latest"
    old, old_opt = _trained(steps=1)
    checkpoint.save(path, old, old_opt)
    path.rename(commit.previous_of(path))  # the state between the commit's two renames
    fresh, fresh_opt = _trained(seed=1, steps=0)
    checkpoint.load(path, fresh, fresh_opt)
    assert _same(fresh, old)
    new, new_opt = _trained(steps=3)
    checkpoint.save(path, new, new_opt)  # puts the previous back first, then commits over it
    assert checkpoint_tasks.left_in(tmp_path) == ["latest"]
    checkpoint.load(path, fresh, fresh_opt)
    assert _same(fresh, new)


def test_the_manager_keeps_the_last_steps_and_latest_skips_partial_ones(tmp_path):
    manager = checkpoint.Manager(tmp_path, keep=2)
    assert manager.latest() is None
    with pytest.raises(StateDictError, match="no committed checkpoint"):
        manager.load(*_trained(steps=0))
    models = {}
    for step in (10, 20, 30):
        models[step] = _trained(seed=step)
        manager.save(step, *models[step])
    assert checkpoint_tasks.left_in(tmp_path) == ["step-20", "step-30"]
    # A newer step whose save did not finish, in each way it can look: never the latest.
    (tmp_path / "step-40").mkdir()  # no .metadata
    commit.staging_of(tmp_path / "step-50").mkdir()
    torn = tmp_path / "step-60"
    manager.save(60, *_trained(seed=60))
    # Only committed steps count towards keep: 60 and 30 stay, 20 goes, the partial ones are left alone.
    assert checkpoint_tasks.left_in(tmp_path) == [".step-50.staging", "step-30", "step-40", "step-60"]
    record = json.loads((torn / commit.RECORD).read_text())
    name = min(record["files"])
    os.truncate(torn / name, record["files"][name] - 1)
    assert manager.latest() == 30
    fresh, fresh_opt = _trained(seed=1, steps=0)
    assert manager.load(fresh, fresh_opt) == 30
    assert _same(fresh, models[30][0])
    with pytest.raises(StateDictError, match="its commit recorded"):
        manager.load(fresh, fresh_opt, step=60)


def test_keep_never_deletes_the_only_committed_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="keep must be at least 1"):
        checkpoint.Manager(tmp_path, keep=0)
    manager = checkpoint.Manager(tmp_path, keep=1)
    first = _trained(seed=1)
    manager.save(1, *first)
    writer = checkpoint_tasks.FailingWriter(str(tmp_path), "torn", [0])
    failing = checkpoint.Manager(tmp_path, keep=1, storage_writer=writer)
    with pytest.raises(StateDictError, match="was not saved"):
        failing.save(2, *_trained(seed=2))
    assert checkpoint_tasks.left_in(tmp_path) == ["step-1"]
    assert manager.latest() == 1
    manager.save(3, *_trained(seed=3))
    assert checkpoint_tasks.left_in(tmp_path) == ["step-3"]
