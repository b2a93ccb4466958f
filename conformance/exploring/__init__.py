"""Exploration (``python -m conformance explore``): a scenario as data, the checks of its clauses,
the found scenarios the matrix keeps as cases, and the engine that draws and shrinks scenarios."""
