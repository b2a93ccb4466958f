"""The specification the suite checks (SPEC.md, shipped with the suite) and
the text of each clause, for reports that show a clause beside its verdict."""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

_CLAUSE = re.compile(r"^- ((?:OPT|MODEL)-[A-Z]+(?:-[A-Z]+)?-\d+|(?:MODEL|LOOP|API|SCALE|REPEAT)-\d+) (.*)$")


@lru_cache(maxsize=None)
def text() -> str:
    return resources.files(__package__).joinpath("SPEC.md").read_text(encoding="utf-8")


@lru_cache(maxsize=None)
def clauses() -> dict[str, str]:
    """Clause ID -> its text, in the order SPEC.md gives them."""
    out = {}
    for line in text().splitlines():
        match = _CLAUSE.match(line)
        if match:
            out[match.group(1)] = match.group(2).strip()
    return out


def version() -> str:
    match = re.search(r"specification, version ([\d.]+)", text())
    return match.group(1) if match else "?"
