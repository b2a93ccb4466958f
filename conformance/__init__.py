"""A conformance suite for distributed state-dict implementations.

Runs the scenario matrix of SPEC.md (spec version below) against any
implementation of the ``torch.distributed.checkpoint.state_dict`` API.
"""

__version__ = "0.6.0"
SPEC_VERSION = "1.6"
