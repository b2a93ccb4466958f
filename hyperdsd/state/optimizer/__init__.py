"""Optimizer state by FQN: read, parsed against its target, planned value by value, applied."""
