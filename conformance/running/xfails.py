"""Expected failures: ``CASE_ID_OR_PREFIX  # reason, link`` per line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class XfailEntry:
    pattern: str
    reason: str
    line: int
    used: bool = False


class Xfails:
    def __init__(self, entries: list[XfailEntry], source: str = ""):
        self.entries = entries
        self.source = source

    @classmethod
    def load(cls, path: str) -> "Xfails":
        entries = []
        with open(path, encoding="utf-8") as f:
            for lineno, raw in enumerate(f, 1):
                text = raw.strip()
                if not text or text.startswith("#"):
                    continue
                pattern, _, reason = text.partition("#")
                pattern = pattern.strip()
                if not pattern:
                    continue
                entries.append(XfailEntry(pattern, reason.strip(), lineno))
        return cls(entries, path)

    def match(self, case_id: str) -> XfailEntry | None:
        """The longest entry that is the case ID or a prefix of it."""
        best = None
        for entry in self.entries:
            if case_id == entry.pattern or case_id.startswith(entry.pattern):
                if best is None or len(entry.pattern) > len(best.pattern):
                    best = entry
        return best

    def mark_selected(self, case_ids: list[str]) -> None:
        for cid in case_ids:
            entry = self.match(cid)
            if entry is not None:
                entry.used = True

    def unmatched(self) -> list[XfailEntry]:
        return [e for e in self.entries if not e.used]
