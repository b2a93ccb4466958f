"""The mutation campaign (docs/MUTATION.md): ``mutants`` lists small,
realistic bugs in hyperdsd, ``anchor`` finds where each applies by syntax
tree, ``python -m tools.mutation.mutate`` runs the suite against each."""
