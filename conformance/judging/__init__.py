"""How a case judges what the implementation under test did: the checks and comparisons
(oracle.py), what came back judged as input, and the bytes a rank received."""
