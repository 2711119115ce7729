"""Benchmark modules run through the entry points in benchmarks/ (see benchmarks/harness.py)."""
