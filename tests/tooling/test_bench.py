"""The benchmark's growth summary (no timing asserted)."""

from tools.benchmarks import bench


def test_growth_is_large_over_small_per_key_where_both_ran(capsys):
    per_key = {("10k", "get"): 2.0, ("50k", "get"): 2.5, ("10k", "set"): 1.0, ("50k", "full_get"): 9.0}
    per_key.update({("10k", "torch (get)"): 10.0, ("50k", "torch (get)"): 11.0})
    bench._growth(per_key)
    out = capsys.readouterr().out
    assert "50k over 10k" in out
    assert [line.split() for line in out.splitlines()[2:]] == [["get", "1.25"], ["torch", "(get)", "1.10"]]


def test_growth_says_nothing_without_both_sizes(capsys):
    bench._growth({("10k", "get"): 2.0})
    assert capsys.readouterr().out == ""
