"""Placeholder state for never-stepped optimizers: marked, built on a copy, told once saved."""
