"""Deliberately wrong implementations under test, in one place, for the
suite's own tests and tools: ``twists`` (hyperdsd with one thing twisted in
what it returns or does to the objects it is handed; ``python -m
tools.perverse`` runs the matrix against each and lists every ``error``),
``faulty`` (ranks that hang, die or raise, and single deviations the suite
must catch), ``combined`` (defects of the combined functions, API-1),
``declared`` (declarations and the pass boundary, SPEC §1 and §4)."""
