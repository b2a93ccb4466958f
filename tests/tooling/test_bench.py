"""The benchmark's per-tensor floors and its growth summary (no timing asserted)."""

import torch

from tools.benchmarks import bench, bench_tasks


def _stepped():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_kept_floor_holds_a_new_copy_of_every_local_tensor():
    model, opt = _stepped()
    expected = [t for p in model.parameters() for t in (p, *opt.state[p].values())]
    kept = bench_tasks._clone_kept(model, opt)
    assert len(kept) == len(expected) == 4 * 4  # each parameter, its step, exp_avg and exp_avg_sq
    for copy, original in zip(kept, expected):
        assert torch.equal(copy, original.detach())
        assert copy.data_ptr() != original.data_ptr()


def test_growth_is_large_over_small_per_key_where_both_ran(capsys):
    per_key = {("10k", "get"): 2.0, ("50k", "get"): 2.5, ("10k", "set"): 1.0, ("50k", "full_get"): 9.0}
    bench._growth(per_key)
    out = capsys.readouterr().out
    assert "50k over 10k" in out
    assert [line.split() for line in out.splitlines()[2:]] == [["get", "1.25"]]


def test_growth_says_nothing_without_both_sizes(capsys):
    bench._growth({("10k", "get"): 2.0})
    assert capsys.readouterr().out == ""
