"""What hyperdsd and the suite do differently on older torch releases (hyperdsd/_compat/,
conformance/_compat.py), exercised on this torch: both paths where the old one can run here."""

import dist_tasks
import pytest
from helpers import run_task


@pytest.mark.parametrize("suite", [False, True], ids=["hyperdsd", "suite"])
@pytest.mark.parametrize("native", [True, False], ids=["src_data_rank", "torch-2.6"])
@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_distribute_locally_cuts_each_ranks_own_tensor(pools, mesh, native, suite):
    sums = run_task(pools, 4, dist_tasks.compat_distribute_locally, mesh=mesh, native=native, suite=suite)
    # Every rank's full tensor differs (by 100 * rank): a scatter from rank 0 would make them alike.
    assert len(set(sums)) == 4, sums


def test_fsdp2_on_cpu_fills_torch_26s_gaps(pools):
    seen = run_task(pools, 2, dist_tasks.compat_fsdp2_on_cpu)
    # A gloo replica group asks for fp16's divide factors (no ReduceOp.AVG); without one, the dtype is kept.
    assert seen == [["torch.float16", "torch.bfloat16"]] * 2


def test_fsdp2_on_cpu_changes_nothing_on_this_torch():
    import torch
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    from conformance import _compat

    before = torch.cpu.Stream.__dict__.copy(), collectives._get_gradient_divide_factors
    _compat.fsdp2_on_cpu()
    assert (torch.cpu.Stream.__dict__.copy(), collectives._get_gradient_divide_factors) == before


def test_post_forward_meshes_are_shared_so_groups_stay_bounded(pools):
    """fully_shard(reshard_after_forward=2) makes process groups per call; the suite's shim shares them, so a
    rank pool running the same models again is in no more groups than after the first time."""
    first = run_task(pools, 4, dist_tasks.compat_post_forward_meshes)
    again = run_task(pools, 4, dist_tasks.compat_post_forward_meshes)
    assert first == again, (first, again)


def test_root_mesh_of_a_slice(pools):
    assert run_task(pools, 4, dist_tasks.compat_root_mesh) == [True] * 4


def test_root_mesh_before_device_mesh_had_the_method(monkeypatch):
    """torch 2.6 to 2.9: no DeviceMesh._get_root_mesh; device_mesh's registry maps slices to roots."""
    import types

    from torch.distributed import device_mesh

    from hyperdsd import _compat

    root, part = types.SimpleNamespace(), types.SimpleNamespace()
    registry = types.SimpleNamespace(get_root_mesh=lambda mesh: root if mesh is part else mesh)
    monkeypatch.setattr(device_mesh, "_mesh_resources", registry)
    assert _compat.root_mesh(part) is root and _compat.root_mesh(root) is root


def test_root_mesh_is_not_taken_from_an_equal_mesh_of_another_root(monkeypatch):
    """torch 2.6 to 2.9 map meshes to roots by value: a 1-D mesh built over ranks 0-1 equals the 'shard'
    slice of an earlier 2-D mesh, and the registry hands back that mesh's root. The root counts only if
    it holds the mesh's own groups (as torch 2.6 to 2.7 record them, and as 2.8 to 2.9 do)."""
    import types

    from torch.distributed import device_mesh

    from hyperdsd import _compat

    for infos in ("_dim_group_infos", "_dim_group_names"):
        as_recorded = (lambda n: ("tag", [0, 1], n)) if infos == "_dim_group_infos" else (lambda n: n)  # noqa: E731
        root = types.SimpleNamespace(**{infos: [as_recorded("replicate"), as_recorded("shard")]})
        flat = types.SimpleNamespace(**{infos: [as_recorded("dp")]})
        part = types.SimpleNamespace(**{infos: [as_recorded("shard")]})
        flattened = types.SimpleNamespace(**{infos: [as_recorded("dp")]})
        equal_but_own = types.SimpleNamespace(**{infos: [as_recorded("halves")]})
        registry = types.SimpleNamespace(
            get_root_mesh=lambda mesh: root if mesh is not root else root,  # every mesh "equals" a slice of root
            root_to_flatten_mapping={id(root): {"dp": flat}},
        )
        registry.root_to_flatten_mapping = _ById(registry.root_to_flatten_mapping)
        monkeypatch.setattr(device_mesh, "_mesh_resources", registry)
        assert _compat.root_mesh(part) is root, infos
        assert _compat.root_mesh(flattened) is root, infos
        assert _compat.root_mesh(equal_but_own) is equal_but_own, infos


class _ById(dict):
    def get(self, key, default=None):
        return super().get(id(key), default)


@pytest.mark.parametrize("version", ["2.5.1", "2.6.0", "2.13.0+cpu"])
def test_import_on_torch_below_the_floor_names_the_release_needed(version):
    """pyproject.toml declares torch>=2.6; an older torch gets one ImportError that says so.
    One interpreter per release tries each package in turn (a failed import leaves nothing in
    sys.modules, so the next package meets the check afresh)."""
    import subprocess
    import sys

    from helpers import ROOT

    packages = ("hyperdsd", "conformance.cli", "conformance.running.registry")
    code = (
        f"import torch; torch.__version__ = {version!r}\n"
        f"for name in {packages!r}:\n"
        "    try:\n        __import__(name)\n    except ImportError as e:\n        print(name, '|', e)\n"
        "    else:\n        print(name, '| imported')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    said = dict(line.split(" | ", 1) for line in done.stdout.splitlines() if " | " in line)
    assert set(said) == set(packages), done.stdout
    for package, what in said.items():
        if version.startswith("2.5"):
            # The suite's runner imports hyperdsd.testing first; either package's error names the release.
            assert "needs torch 2.6 or later, found torch 2.5.1" in what and "fully_shard" in what, (package, what)
        else:
            assert what == "imported", (package, what)


def test_pipeline_start_sends_float32_like_its_receive_buffer(monkeypatch):
    """torch 2.9's first pipeline exchange sends an int64 into a float32 buffer (gloo aborts); given such ops,
    the suite's shim sends float32 and leaves receives alone, once however often it is applied."""
    import types

    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import stage

    from conformance import _compat

    def torch_29_ops(self):
        return [
            types.SimpleNamespace(op=dist.irecv, tensor=torch.zeros(1)),
            types.SimpleNamespace(op=dist.isend, tensor=torch.tensor(1)),
        ]

    # raising=False: releases before the method (2.6) run the shim's logic on the stand-in all the same.
    monkeypatch.setattr(stage._PipelineStageBase, "_get_init_p2p_neighbors_ops", torch_29_ops, raising=False)
    _compat.gloo_safe_pipeline_start()
    _compat.gloo_safe_pipeline_start()
    recv, send = stage._PipelineStageBase._get_init_p2p_neighbors_ops(None)
    assert (recv.tensor.dtype, send.tensor.dtype, send.tensor.item()) == (torch.float32, torch.float32, 1.0)
    assert stage._PipelineStageBase._get_init_p2p_neighbors_ops.__wrapped__ is torch_29_ops


@pytest.mark.parametrize("torch_26", [False, True], ids=["scale_grads", "torch-2.6"])
def test_pipeline_schedule_averages_gradients_over_microbatches(pools, torch_26):
    """A pipeline layout trains on the gradients of a whole-model step on the same batch (mean loss), with
    schedules that scale gradients and with torch 2.6's, which sum them over the microbatches."""
    for ratios in run_task(pools, 2, dist_tasks.compat_pipeline_schedule, torch_26=torch_26):
        assert ratios and all(abs(r - 1.0) < 1e-12 for r in ratios), ratios


def test_pipeline_schedule_like_torch_26s_sums_gradients_without_the_shim(pools):
    """The stand-in for torch 2.6's schedule behaves as 2.6's: built without the shim, it trains on the sum of
    the microbatches' gradients (what the shim's division makes up for)."""
    for ratios in run_task(pools, 2, dist_tasks.compat_pipeline_schedule, torch_26=True, shim=False):
        assert ratios and all(abs(r - 2.0) < 1e-12 for r in ratios), ratios


def test_dcp_on_subgroups_changes_nothing_where_dcp_has_a_global_coordinator():
    from torch.distributed.checkpoint import utils

    from conformance import _compat

    before = utils._DistWrapper.__init__
    _compat.dcp_on_subgroups()
    assert utils._DistWrapper.__init__ is before


def test_dcp_on_subgroups_gives_torch_26s_wrapper_the_global_coordinator(monkeypatch):
    """torch 2.6's and 2.7's _DistWrapper broadcast from the group rank as if global; the shim makes it global."""
    from torch.distributed.checkpoint import utils

    from conformance import _compat

    class Wrapper26:
        def __init__(self, group, use_dist, coordinator_rank):
            self.coordinator_rank = coordinator_rank

        def broadcast_object(self, obj):  # as 2.6 and 2.7 do: the group rank as the source
            return self.coordinator_rank

    monkeypatch.setattr(utils, "_DistWrapper", Wrapper26)
    monkeypatch.setattr("torch.distributed.get_global_rank", lambda group, rank: {0: 2, 1: 3}[rank])
    _compat.dcp_on_subgroups()
    _compat.dcp_on_subgroups()
    assert Wrapper26(object(), True, 0).coordinator_rank == 2
    assert Wrapper26(None, True, 0).coordinator_rank == 0 and Wrapper26(object(), False, 0).coordinator_rank == 0


def test_forgetting_meshes_clears_the_caches_older_releases_keep(monkeypatch):
    """Before 2.10 the sharding propagator's cache is a thread-local wrapper without cache_clear, and the
    mesh registry is keyed by value: both must be emptied when the groups are formed again, or a mesh of
    the new groups is handed an old one's ("Could not resolve the process group registered under ...")."""
    import functools
    import types

    from torch.distributed import device_mesh
    from torch.distributed.tensor import DTensor

    from hyperdsd.testing import _compat

    cached = functools.lru_cache(None)(lambda key: object())
    cached("spec")
    propagator = DTensor._op_dispatcher.sharding_propagator
    monkeypatch.setattr(propagator, "propagate_op_sharding", types.SimpleNamespace(cache=cached))
    registry = types.SimpleNamespace(child_to_root_mapping={1: 2}, root_to_flatten_mapping={3: {}}, mesh_stack=[4])
    monkeypatch.setattr(device_mesh, "_mesh_resources", registry)
    _compat.forget_device_meshes()
    assert cached.cache_info().currsize == 0
    assert registry.child_to_root_mapping == {} and registry.root_to_flatten_mapping == {}
    assert registry.mesh_stack == [4]  # a mesh entered as a context stays entered
