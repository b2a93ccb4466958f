"""hyperdsd: distributed state dicts for PyTorch models and optimizers."""

__version__ = "0.1.0"
