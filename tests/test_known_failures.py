"""conformance/known/torch-2.13.txt stays in step with the manifest.

The file comes from a full run against torch 2.13 (about 25 minutes, so not
repeated here): every entry must still match a case, and carry a reason.
"""

import pathlib

from conformance.registry import all_cases
from conformance.xfails import Xfails

KNOWN = pathlib.Path(__file__).resolve().parent.parent / "conformance" / "known" / "torch-2.13.txt"


def test_every_entry_matches_a_case_and_has_a_reason():
    xfails = Xfails.load(str(KNOWN))
    assert xfails.entries, "empty file"
    xfails.mark_selected([c.id for c in all_cases()])
    assert [e.pattern for e in xfails.unmatched()] == []
    assert all(len(e.reason) > 20 for e in xfails.entries), [e.pattern for e in xfails.entries if len(e.reason) <= 20]


def test_no_entry_covers_a_clause_torch_passes():
    xfails = Xfails.load(str(KNOWN))
    for passing in ("OPT-KEYS-1[", "OPT-KEYS-2[", "OPT-KEYS-3[", "OPT-DT-1[", "OPT-RESHARD-1[", "OPT-ATOM-3[", "OPT-PART-4["):
        covered = [c.id for c in all_cases() if c.id.startswith(passing) and xfails.match(c.id)]
        assert covered == [], covered
