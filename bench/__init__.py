"""Benchmarks: the training service against a plain DDP loop (docs/benchmarks.md)."""
