"""hyperdsd against torch's implementation, side by side (docs/PERFORMANCE.md):
``python -m tools.benchmarks.bench`` with its rank-side ``bench_tasks`` and
``bench_breakdown``, ``bench_commit`` (atomic saves against plain DCP),
``bench_harness`` (a warm pool against a process group per test),
``peak_memory`` (the peak memory of a command and its processes)."""
