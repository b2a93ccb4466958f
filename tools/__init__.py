"""Benchmarks and report helpers, run from the repository root as modules:
``python -m tools.bench``, ``python -m tools.bench_harness``,
``python -m tools.verdict_table``. Not part of the installed distribution."""
