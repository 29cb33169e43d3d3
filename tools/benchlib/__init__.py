"""Helpers of tools/bench.py: the spawn/barrier harness, limits, and one module per section."""
