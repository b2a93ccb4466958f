"""The benchmarks' summaries and tasks (no timing asserted)."""

import pytest
from helpers import run_task

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


@pytest.mark.parametrize("variant", ["orig-full", "flat-hybrid"])
def test_the_fsdp1_benchmark_times_each_call_on_both_models(pools, variant):
    """Every mode of tools/benchmarks/bench_fsdp1.py runs on the FSDP1 model and
    its FSDP2 counterpart (two blocks): a wall and a CPU time for each, and a profile when asked."""
    from tools.benchmarks import bench_fsdp1

    for mode in bench_fsdp1.MODES:
        got = run_task(
            pools,
            4,
            bench_fsdp1.time_pair,
            size="80",
            variant=variant,
            mode=mode,
            reps=1,
            torch_too=False,
            profile=mode == "set",
        )
        times, cpu, profile = got[0]["times"], got[0]["cpu"], got[0]["profile"]
        assert sorted(times) == ["fsdp1", "fsdp2"] and all(len(t) == 1 and t[0] > 0 for t in times.values()), times
        assert sorted(cpu) == ["fsdp1", "fsdp2"] and all(len(t) == 1 and t[0] > 0 for t in cpu.values()), cpu
        assert ("function calls" in profile) == (mode == "set"), profile[:200]
        # The floor of making every value new: timed where FSDP1 must, and only there.
        assert len(got[0]["new"]) == (mode in bench_fsdp1.NEW_VALUE_MODES), got[0]["new"]
        assert all(ms > 0 for ms in got[0]["new"]), got[0]["new"]
