"""A rank-side task that reports which of hyperdsd's modules the suite loaded (imports nothing of hyperdsd)."""

import sys


def hyperdsd_modules_after_a_torch_case(ctx):
    """The suite's rank-side code and torch's adapter, as a ``--impl torch`` rank loads them."""
    from conformance import modes
    from conformance.adapters import load_adapter
    from conformance.running import registry

    load_adapter("torch")
    registry.all_cases()  # every section module
    assert modes.MODES
    return sorted(m for m in sys.modules if m == "hyperdsd" or m.startswith("hyperdsd."))
