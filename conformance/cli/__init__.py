"""``python -m conformance``: the command line, every command of it.

``python -m conformance`` runs the matrix (:mod:`.run`); ``explore`` draws
and shrinks generated scenarios (:mod:`.explore`); ``diff`` compares two
runs' JSON reports (``conformance.reporting.diff``).
"""

from __future__ import annotations

import sys

from .run import verdict_changes

__all__ = ["main", "verdict_changes"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["diff"]:
        from ..reporting.diff import main as diff_main

        return diff_main(argv[1:])
    if argv[:1] == ["explore"]:
        from .explore import explore_main

        return explore_main(argv[1:])
    from .run import run_main

    return run_main(argv)
