"""How cases are declared and run: clauses and cases, the registry (the manifest), the runner that
hands each case's phases to a world of ranks, what a case sees on its rank, expected failures, and
what each case's run came to."""
