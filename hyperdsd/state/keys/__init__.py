"""Names: canonical FQNs, the model index and its cache, the children wrappers hide, and the flat layout's keys."""
