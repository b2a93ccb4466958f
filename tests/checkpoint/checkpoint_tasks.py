"""Rank-side functions for hyperdsd.checkpoint's multi-rank tests (run through the harness).

The models are the conformance suite's (layouts, routers that never get a
gradient, schedulers), driven here through hyperdsd's checkpoint API in the
three ways users write it: the load planner, one call, and AppState.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pathlib
import pickle
import shutil
import signal
import tempfile
from concurrent.futures import wait as futures_wait

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import hyperdsd
from hyperdsd import StateDictOptions, checkpoint

LAZY = "layers.0.router.weight"


def _c(ctx):
    """A case context for conformance's Setup, driving hyperdsd."""
    from conformance.adapters import load_adapter
    from conformance.running.case_context import CaseContext

    return CaseContext(ctx, None, 0, load_adapter("hyperdsd"), "")


def _setup(ctx, layout: str, seed: int, **kw):
    from conformance.world.groups import GroupSpec
    from conformance.world.models import ModelConfig
    from conformance.world.setup import Setup

    cfg = ModelConfig(**{"router": True, **kw.pop("cfg", {})})
    groups = GroupSpec.for_seed(seed, **kw.pop("groups", {}))
    return Setup(_c(ctx), layout, "adamw", seed=seed, cfg=cfg, groups=groups, **kw)


def _options(setup) -> StateDictOptions:
    # Pipeline stages write disjoint keys only in the flat layout.
    return StateDictOptions(flatten_optimizer_state_dict=setup.layout.pp > 1)


def _snapshot(setup):
    from conformance.judging.oracle import snapshot

    return snapshot(setup)


def _diff(a, b) -> list[str]:
    from conformance.judging.oracle import diff_snapshots

    return diff_snapshots(a, b)


@contextlib.contextmanager
def _checkpoint_dir(ctx):
    """A directory every rank sees, removed afterwards."""
    box = [tempfile.mkdtemp(prefix="hyperdsd-ckpt-") if ctx.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    try:
        yield box[0]
    finally:
        if dist.is_initialized():
            dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(box[0], ignore_errors=True)


def _save(way: str, path: str, setup, options) -> None:
    if way == "planner":
        msd, osd = hyperdsd.get_state_dict(setup.model, setup.optimizers[0], options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    elif way == "one_call":
        checkpoint.save(path, setup.model, setup.optimizers, options=options)
    else:
        dcp.save({"app": checkpoint.AppState(setup.model, setup.optimizers, options=options)}, checkpoint_id=path)


def _load(way: str, path: str, setup, options) -> None:
    if way == "planner":  # the flow users write, with the planner as its only change
        msd, osd = hyperdsd.get_state_dict(setup.model, setup.optimizers[0], options=options)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path, planner=checkpoint.LoadPlanner())
        hyperdsd.set_state_dict(
            setup.model, setup.optimizers[0], model_state_dict=msd, optim_state_dict=osd, options=options
        )
    elif way == "one_call":
        checkpoint.load(path, setup.model, setup.optimizers, options=options)
    else:
        app = checkpoint.AppState(setup.model, setup.optimizers, options=options)
        dcp.load({"app": app}, checkpoint_id=path, planner=checkpoint.LoadPlanner())


def _routers_with_state(setup) -> list[str]:
    return [f for f, p in setup.named_parameters() if ".router." in f and setup.optimizers[0].state.get(p)]


def lazy_resume(ctx, layout: str, way: str, own_group: bool = False):
    """Routers never get a gradient: the checkpoint has no state for them; a
    fresh optimizer resumes, they stay without state, training matches."""
    a = _setup(ctx, layout, 0, groups={"router_group": own_group})
    opts = _options(a)
    with _checkpoint_dir(ctx) as path:
        a.train(2)
        assert not _routers_with_state(a)
        _save(way, path, a, opts)
        saved = _snapshot(a)
        a.train(1)
        b = _setup(ctx, layout, 1, groups={"router_group": own_group})
        b.set_steps_done(2)
        _load(way, path, b, opts)
        assert not _routers_with_state(b), _routers_with_state(b)
        diffs = _diff(saved, _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
        b.train(1)
        diffs = _diff(_snapshot(a), _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
    return True


def _drop_from_metadata(ctx, path: str, keys: list[str]) -> None:
    if ctx.rank == 0:
        metadata = FileSystemReader(path).read_metadata()
        for key in keys:
            del metadata.state_dict_metadata[key]
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(metadata, f)
    if dist.is_initialized():
        dist.barrier()


def partial_state_refused(ctx, layout: str, way: str, fqn: str, key: str):
    """A checkpoint whose metadata lacks one key of one parameter's state:
    every rank raises naming the FQN and the key; nothing changes."""
    a = _setup(ctx, layout, 0)
    opts = _options(a)
    with _checkpoint_dir(ctx) as path:
        a.train(2)
        _save(way, path, a, opts)
        prefix = "app.optim" if way == "app_state" else "optim"
        _drop_from_metadata(ctx, path, [f"{prefix}.state.{fqn}.{key}"])
        b = _setup(ctx, layout, 1)
        before = _snapshot(b)
        try:
            _load(way, path, b, opts)
        except BaseException as exc:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
            error = exc
        else:
            raise AssertionError("the load did not raise")
        text = str(error)
        assert fqn in text and key in text, text
        diffs = _diff(before, _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
    return type(error).__name__, text


def other_model_refused(ctx, layout: str, kind: str):
    """A checkpoint of another model: every rank raises the same error; nothing changes."""
    a = _setup(ctx, layout, 0)
    opts = _options(a)
    target = {
        "more_layers": {"cfg": {"n_layers": 3}},
        "fewer_layers": {"cfg": {"n_layers": 1}},
        "wider": {"cfg": {"hidden": 16}},
        "extra_group": {},
    }[kind]
    with _checkpoint_dir(ctx) as path:
        if kind == "extra_group":  # the source has an empty group more than the target
            a = _setup(ctx, layout, 0, groups={"empty_at": (1,)})
        a.train(1)
        checkpoint.save(path, a.model, a.optimizers, options=opts)
        b = _setup(ctx, layout, 1, **target)
        b.train(1)
        before = _snapshot(b)
        try:
            checkpoint.load(path, b.model, b.optimizers, options=opts)
        except hyperdsd.StateDictError as exc:
            text = str(exc)
        else:
            raise AssertionError("the load did not raise")
        diffs = _diff(before, _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
    return text


class Progress:
    """A user's Stateful: where the data loader is."""

    def __init__(self, step: int = 0):
        self.step = step
        self.seen = torch.zeros(3)

    def state_dict(self):
        return {"step": self.step, "seen": self.seen}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.seen = state["seen"].clone()


def schedulers_and_extra(ctx, layout: str, async_save: bool = False):
    """Schedulers and the user's Stateful objects round-trip with the model and optimizers."""
    a = _setup(ctx, layout, 0, scheduler=True)
    opts = _options(a)
    progress = Progress()
    with _checkpoint_dir(ctx) as path:
        a.train(2)
        progress.step, progress.seen = 2, torch.arange(3.0)
        sched_state = copy.deepcopy(a.schedulers[0].state_dict())
        extra = {"progress": progress, "note": {"epoch": torch.tensor(7)}}
        result = checkpoint.save(
            path, a.model, a.optimizers, schedulers=a.schedulers, extra=extra, options=opts, async_save=async_save
        )
        if async_save:
            result.result()  # the background write has finished
        saved = _snapshot(a)
        lrs_a = []
        for _ in range(2):
            a.train(1)
            lrs_a.append([g["lr"] for g in a.optimizers[0].param_groups])
        b = _setup(ctx, layout, 1, scheduler=True)
        b.set_steps_done(2)
        mine, note = Progress(), {"epoch": torch.tensor(0)}
        checkpoint.load(
            path, b.model, b.optimizers, schedulers=b.schedulers, extra={"progress": mine, "note": note}, options=opts
        )
        assert mine.step == 2 and torch.equal(mine.seen, torch.arange(3.0)), (mine.step, mine.seen)
        assert int(note["epoch"]) == 7
        assert b.schedulers[0].state_dict() == sched_state, (b.schedulers[0].state_dict(), sched_state)
        diffs = _diff(saved, _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
        lrs_b = []
        for _ in range(2):
            b.train(1)
            lrs_b.append([g["lr"] for g in b.optimizers[0].param_groups])
        assert lrs_a == lrs_b, (lrs_a, lrs_b)
        diffs = _diff(_snapshot(a), _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
    return True


# -- faults during a save ------------------------------------------------------


class FailingWriter(FileSystemWriter):
    """DCP's filesystem writer, failing as told on the ranks ``ranks``.

    ``write``: raises before writing anything (a full disk); ``torn``: writes
    half of its data file, then raises; ``kill``: writes half, then the
    process is SIGKILLed; ``metadata``: the coordinator writes a torn
    ``.metadata``, then raises.
    """

    def __init__(self, path: str, fault: str, ranks=()):
        super().__init__(path)
        self.fault, self.ranks = fault, set(ranks)

    def _mine(self) -> bool:
        return (dist.get_rank() if dist.is_initialized() else 0) in self.ranks

    def write_data(self, plan, planner):
        if self.fault == "write" and self._mine():
            raise OSError(28, "No space left on device (injected)")
        written = super().write_data(plan, planner)
        if self.fault in ("torn", "kill") and self._mine():
            for result in written.value():
                file = os.path.join(self.path, result.storage_data.relative_path)
                os.truncate(file, os.path.getsize(file) // 2)
            if self.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(28, "No space left on device (injected, after writing half)")
        return written

    def finish(self, metadata, results):
        if self.fault == "metadata":
            with open(os.path.join(self.path, ".metadata"), "wb") as f:
                f.write(b"torn")
            raise OSError(5, "Input/output error (injected while writing .metadata)")
        return super().finish(metadata, results)


def _two_states(ctx, layout: str):
    """A run trained 2 steps (its snapshot: what the first save holds), then 2 more."""
    a = _setup(ctx, layout, 0)
    a.train(2)
    return a, _snapshot(a)


def _loads_exactly(ctx, layout: str, path, expected, opts) -> None:
    b = _setup(ctx, layout, 1)
    checkpoint.load(path, b.model, b.optimizers, options=opts)
    diffs = _diff(expected, _snapshot(b))
    assert not diffs, "a mix, or not the checkpoint committed:\n" + "\n".join(diffs[:10])


def _refused(ctx, layout: str, path, opts) -> str:
    b = _setup(ctx, layout, 1)
    before = _snapshot(b)
    try:
        checkpoint.load(path, b.model, b.optimizers, options=opts)
    except hyperdsd.StateDictError as exc:
        text = str(exc)
    else:
        raise AssertionError(f"{path} loaded, but no save to it finished")
    assert not _diff(before, _snapshot(b))
    return text


def left_in(root) -> list[str]:
    """What is in ``root``, but for the emptied trash of replaced and pruned checkpoints
    (every rank has removed its files from it; the next save removes the folder)."""
    checkpoint.settle()  # this rank's deletions have finished (other ranks: a barrier after theirs)

    def emptied(name):
        folder = os.path.join(root, name)
        return ".trash-" in name and os.path.isdir(folder) and not os.listdir(folder)

    return sorted(name for name in os.listdir(root) if not emptied(name))


def _staging_left(path: str) -> bool:
    from hyperdsd.checkpoint.commit import staging_of

    return staging_of(pathlib.Path(path)).exists()


def failed_save(ctx, layout: str, fault: str, ranks, previous: bool = True, async_save: str = ""):
    """A save over a committed checkpoint fails: every rank raises the same
    StateDictError, and the next load returns exactly the previous checkpoint
    (or refuses, if there was none); a save that succeeds then loads exactly.

    ``async_save``: "" (a synchronous save), "future" (the failure is read
    from the future) or "next_call" (nobody reads the future: the next load
    raises it, once).
    """
    a, first = _two_states(ctx, layout)
    opts = _options(a)
    with _checkpoint_dir(ctx) as root:
        path = os.path.join(root, "latest")
        if previous:
            checkpoint.save(path, a.model, a.optimizers, options=opts)
        a.train(2)
        writer = FailingWriter(path, fault, ranks)
        error = None
        try:
            fut = checkpoint.save(
                path, a.model, a.optimizers, options=opts, storage_writer=writer, async_save=bool(async_save)
            )
            if async_save == "future":
                fut.result()
            elif async_save == "next_call":
                futures_wait([fut], timeout=120)
                b = _setup(ctx, layout, 1)
                checkpoint.load(path, b.model, b.optimizers, options=opts)
        except hyperdsd.StateDictError as exc:
            error = str(exc)
        assert error is not None, "the failed save raised nothing"
        assert f"checkpoint {path} was not saved" in error or "an earlier async save failed" in error, error
        if dist.is_initialized():
            dist.barrier()
        assert not _staging_left(path), "the failed save left its staging directory"
        if previous:
            _loads_exactly(ctx, layout, path, first, opts)
        else:
            refusal = _refused(ctx, layout, path, opts)
            assert "there is no checkpoint at" in refusal, refusal
        checkpoint.save(path, a.model, a.optimizers, options=opts)
        _loads_exactly(ctx, layout, path, _snapshot(a), opts)
    return error


def plain_dcp_mixes(ctx, layout: str):
    """The bug hyperdsd's save fixes, as plain dcp.save has it: rank 1's write
    fails, the old metadata stays, and the load returns a state nobody saved."""
    a, first = _two_states(ctx, layout)
    opts = _options(a)
    with _checkpoint_dir(ctx) as path:
        msd, osd = hyperdsd.get_state_dict(a.model, a.optimizers[0], options=opts)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        a.train(2)
        second = _snapshot(a)
        msd, osd = hyperdsd.get_state_dict(a.model, a.optimizers[0], options=opts)
        try:
            dcp.save({"model": msd, "optim": osd}, storage_writer=FailingWriter(path, "write", [1]))
        except dcp.CheckpointException:
            pass
        else:
            raise AssertionError("the failing writer did not fail")
        b = _setup(ctx, layout, 1)
        checkpoint.load(path, b.model, b.optimizers, options=opts)
        got = _snapshot(b)
    # Each rank holds only its shards: rank 0 sees the second save, rank 1 the first.
    return {"first": not _diff(first, got), "second": not _diff(second, got)}


def crash_in_save(ctx, layout: str, root: str, where: str):
    """The first job: a committed checkpoint, then a save cut short by a
    SIGKILL: of rank 1 while it writes (``where="write"``), or of rank 0 in
    the commit, before it renames anything (``before_commit``) or between
    setting the previous checkpoint aside and renaming the new one in place
    (``mid_commit``). The process dies here; :func:`resume_after_crash` is the restarted job."""
    from hyperdsd.checkpoint import commit

    a, _ = _two_states(ctx, layout)
    opts = _options(a)
    path = pathlib.Path(root) / "latest"
    checkpoint.save(path, a.model, a.optimizers, options=opts)
    a.train(2)
    if where == "write":
        writer = FailingWriter(str(path), "kill", [1])
        checkpoint.save(path, a.model, a.optimizers, options=opts, storage_writer=writer)
    else:
        real = os.rename

        def rename(src, dst, *args, **kwargs):
            cut = pathlib.Path(src) == path if where == "before_commit" else pathlib.Path(dst) == path
            if ctx.rank == 0 and cut:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(src, dst, *args, **kwargs)

        commit.os.rename = rename
        try:
            checkpoint.save(path, a.model, a.optimizers, options=opts)
        finally:
            commit.os.rename = real
    raise AssertionError("the save was not cut short")


def resume_after_crash(ctx, layout: str, root: str, where: str):
    """The restarted job: the load returns exactly the checkpoint committed
    before the crash; the next save clears what the crash left and commits."""
    from hyperdsd.checkpoint import commit

    path = pathlib.Path(root) / "latest"
    if ctx.rank == 0:
        left = {
            "write": commit.staging_of(path),
            "before_commit": commit.staging_of(path),
            "mid_commit": commit.previous_of(path),
        }[where]
        assert left.exists(), f"the crash left no {left.name}: it did not cut the save where meant"
        assert path.exists() == (where != "mid_commit"), sorted(os.listdir(root))
    a, first = _two_states(ctx, layout)
    opts = _options(a)
    _loads_exactly(ctx, layout, path, first, opts)
    a.train(2)
    checkpoint.save(path, a.model, a.optimizers, options=opts)
    _loads_exactly(ctx, layout, path, _snapshot(a), opts)
    if dist.is_initialized():
        dist.barrier()
    assert left_in(root) == ["latest"], left_in(root)
    return True


def manager_on_ranks(ctx, layout: str):
    """Manager on ranks: keeps ``keep``; a failed step is skipped; resumes the newest committed step exactly."""
    a = _setup(ctx, layout, 0)
    opts = _options(a)
    with _checkpoint_dir(ctx) as root:
        manager = checkpoint.Manager(root, keep=2, options=opts)
        assert manager.latest() is None
        saved = {}
        for step in (1, 2, 3):
            a.train(1)
            manager.save(step, a.model, a.optimizers)
            saved[step] = _snapshot(a)
        a.train(1)
        failing = checkpoint.Manager(root, keep=2, options=opts, storage_writer=FailingWriter(root, "torn", [1]))
        try:
            failing.save(4, a.model, a.optimizers)
        except hyperdsd.StateDictError:
            pass
        else:
            raise AssertionError("the failing step 4 raised nothing")
        if dist.is_initialized():
            dist.barrier()
        assert left_in(root) == ["step-2", "step-3"], left_in(root)
        assert manager.latest() == 3
        b = _setup(ctx, layout, 1)
        assert manager.load(b.model, b.optimizers) == 3
        diffs = _diff(saved[3], _snapshot(b))
        assert not diffs, "\n".join(diffs[:10])
        fut = manager.save(5, a.model, a.optimizers, async_save=True)
        fut.result()
        assert manager.latest() == 5
        if dist.is_initialized():
            dist.barrier()
        assert left_in(root) == ["step-3", "step-5"], left_in(root)
    return True


# -- repeated saves that plain DCP reads ----------------------------------------------


def _torch_load(path: str, setup) -> None:
    """Load ``path`` with nothing of hyperdsd: torch's state-dict functions and plain dcp.load."""
    from torch.distributed.checkpoint import state_dict as tsd

    msd, osd = tsd.get_state_dict(setup.model, setup.optimizers[0])
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    tsd.set_state_dict(setup.model, setup.optimizers[0], model_state_dict=msd, optim_state_dict=osd)


def saves_that_plain_dcp_loads(ctx, layout: str):
    """Saves of the same shapes, of another model in between and after a failed
    save, each read back by torch's plain dcp.load and by hyperdsd's load, equal to what was saved."""
    # No routers: torch's own flow cannot load lazy optimizer state.
    a = _setup(ctx, layout, 0, cfg={"router": False})
    other = _setup(ctx, layout, 3, cfg={"router": False, "hidden": 24})  # other shapes: other plans
    with _checkpoint_dir(ctx) as root:
        path = os.path.join(root, "ckpt")
        for round_ in range(3):
            a.train(1)
            if round_ == 1:
                checkpoint.save(os.path.join(root, "other"), other.model, other.optimizers)
            if round_ == 2:
                writer = FailingWriter(os.path.join(root, ".bad.staging"), "write", ranks=(ctx.world_size - 1,))
                try:
                    checkpoint.save(os.path.join(root, "bad"), a.model, a.optimizers, storage_writer=writer)
                except hyperdsd.StateDictError:
                    pass
                else:
                    raise AssertionError("the failing save did not raise")
            checkpoint.save(path, a.model, a.optimizers)
            saved = _snapshot(a)
            b = _setup(ctx, layout, 1, cfg={"router": False})
            _torch_load(path, b)
            diffs = _diff(saved, _snapshot(b))
            assert not diffs, f"round {round_}, plain dcp.load:\n" + "\n".join(diffs[:10])
            c = _setup(ctx, layout, 2, cfg={"router": False})
            checkpoint.load(path, c.model, c.optimizers)
            diffs = _diff(saved, _snapshot(c))
            assert not diffs, f"round {round_}, hyperdsd load:\n" + "\n".join(diffs[:10])
        o = _setup(ctx, layout, 4, cfg={"router": False, "hidden": 24})
        checkpoint.load(os.path.join(root, "other"), o.model, o.optimizers)
    return True


def bulk_plans_match_dcp(ctx, layout: str):
    """hyperdsd's local save and load plans, built once per kind of DTensor, are DCP's own."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.default_planner import (
        create_default_local_load_plan,
        create_default_local_save_plan,
    )

    from hyperdsd.checkpoint.load_planner import local_load_plan
    from hyperdsd.checkpoint.save_planner import local_save_plan

    a = _setup(ctx, layout, 0)
    a.train(1)
    opts = _options(a)
    with _checkpoint_dir(ctx) as path:
        msd, osd = hyperdsd.get_state_dict(a.model, a.optimizers[0], options=opts)
        saver = DefaultSavePlanner()
        saver.set_up_planner({"model": msd, "optim": osd}, is_coordinator=ctx.rank == 0)
        ours = local_save_plan(saver.state_dict, ctx.rank == 0).items
        theirs = create_default_local_save_plan(saver.state_dict, ctx.rank == 0).items
        assert list(map(repr, ours)) == list(map(repr, theirs)), (len(ours), len(theirs))  # in DCP's order
        assert [i.index.fqn for i in ours] != [] and all(i.index.fqn in saver.state_dict for i in ours)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        metadata = FileSystemReader(path).read_metadata()
        msd, osd = hyperdsd.get_state_dict(a.model, a.optimizers[0], options=opts)
        loader = DefaultLoadPlanner()
        loader.set_up_planner({"model": msd, "optim": osd}, metadata, ctx.rank == 0)
        ours = local_load_plan(loader.state_dict, metadata, True).items
        theirs = create_default_local_load_plan(loader.state_dict, metadata, True).items
        assert sorted(map(repr, ours)) == sorted(map(repr, theirs)), (len(ours), len(theirs))
    _global_plan_matches_dcp(ctx, a, opts)
    return True


def _global_plan_matches_dcp(ctx, setup, opts):
    """hyperdsd's global save plan (on the coordinator, from every rank's local plan) is DCP's own, byte for
    byte, on the model and optimizer state (sharded, replicated DTensors, plain tensors on every rank, bytes)
    and extra values: a tensor alike on every rank, one that differs, non-tensors. A checkpoint saved with it
    has DCP's metadata, and torch's own ``dcp.load`` loads from it what it loads from DCP's."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    from hyperdsd.checkpoint.save_planner import SavePlanner

    def state():
        msd, osd = hyperdsd.get_state_dict(setup.model, setup.optimizers[0], options=opts)
        extra = {"same": torch.arange(6.0).reshape(2, 3), "mine": torch.full((2,), float(ctx.rank)), "n": 7, "s": "x"}
        return {"model": msd, "optim": osd, "extra": extra}

    planner = SavePlanner()
    planner.set_up_planner(state(), is_coordinator=ctx.rank == 0)
    plans = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(planner.create_local_plan(), plans, dst=0)
    if ctx.rank == 0:
        ours = SavePlanner().create_global_plan(copy.deepcopy(plans))
        theirs = DefaultSavePlanner().create_global_plan(copy.deepcopy(plans))
        assert repr(ours) == repr(theirs)
        assert pickle.dumps(ours) == pickle.dumps(theirs)
        kept = [i.index.fqn for plan in ours[0] for i in plan.items]
        assert kept.count("extra.same") == kept.count("extra.n") == 1, kept
    with _checkpoint_dir(ctx) as path:
        saved = state()
        dcp.save(saved, checkpoint_id=f"{path}/ours", planner=SavePlanner())
        dcp.save(saved, checkpoint_id=f"{path}/dcps", planner=DefaultSavePlanner())
        ours, theirs = (FileSystemReader(f"{path}/{name}").read_metadata() for name in ("ours", "dcps"))
        # the same entries in the same order; objects DCP makes per item may be one object in ours (a
        # kind of DTensor's properties), which pickle writes once
        for field in ("state_dict_metadata", "planner_data", "storage_data"):
            mine, dcps = getattr(ours, field), getattr(theirs, field)
            assert list(mine) == list(dcps), field
            assert all(pickle.dumps(mine[k]) == pickle.dumps(dcps[k]) for k in mine), field
        expected = {key: _local_copy(value) for key, value in _flat(saved).items()}
        got = {name: _loaded_by_torch(ctx, state, f"{path}/{name}") for name in ("ours", "dcps")}
        kept = [None] * ctx.world_size
        dist.all_gather_object(kept, float(got["ours"]["extra.mine"][0]))
        assert len(set(kept)) == 1 and kept[0] in range(ctx.world_size), kept  # one rank's, as DCP keeps it
        assert got["ours"].keys() == got["dcps"].keys()  # lists DCP loads whole (param groups) may be another rank's
        for key, value in got["dcps"].items():
            mine = got["ours"][key]
            same = torch.equal(value, mine) if isinstance(value, torch.Tensor) else value == mine
            assert same, f"{key}: loaded {mine} from ours, {value} from DCP's"
        for key in ("extra.same", "extra.n", "extra.s"):
            assert str(got["ours"][key]) == str(expected[key]), key


def _loaded_by_torch(ctx, state, path):
    """What torch's own ``dcp.load`` loads from ``path`` into ``state()`` with its tensors zeroed first
    (the model's own storage: left as loaded); local values, copied."""
    loaded = state()
    for value in _flat(loaded).values():
        if isinstance(value, torch.Tensor):
            _local_copy(value, keep=True).zero_()
    loaded["extra"].update(n=0, s="")
    dcp.load(loaded, checkpoint_id=path)
    return {key: _local_copy(value) for key, value in _flat(loaded).items()}


def _flat(sd, prefix=""):
    out = {}
    for key, value in sd.items() if isinstance(sd, dict) else enumerate(sd):
        if isinstance(value, (dict, list)):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _local_copy(value, keep: bool = False):
    """A tensor's local values (a DTensor's shard), copied unless ``keep``; anything else as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor) and not keep:
        value = value.detach().clone()
    return value
