"""The suite across torch releases (docs/TORCH_RELEASES.md):
``python -m tools.releases.torch_matrix`` runs it on each release,
``trace_known`` traces torch's failures to the causes of ``causes.json`` and
writes the expected-failures files, ``verdict_table`` and
``verl_state_dict`` (verl's copy of torch 2.7's implementation, one more
implementation under test)."""
