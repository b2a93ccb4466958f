"""The project's tools, run from the repository root as modules, by concern:
``benchmarks`` (hyperdsd against torch, side by side), ``mutation`` (the
mutation campaign), ``releases`` (the suite across torch releases, and the
causes of torch's deviations), ``perverse`` (deliberately wrong
implementations, and ``python -m tools.perverse``, which runs the matrix
against them). Not part of the installed distribution."""
