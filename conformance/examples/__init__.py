"""Worked examples for certifying an implementation whose API is not torch's."""
