"""One module per section of SPEC.md §3; each defines ``cases()``."""
