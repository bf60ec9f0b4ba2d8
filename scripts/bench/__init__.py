"""Benchmarks (``bench_*.py``), the modules only they use, and their recorded ``results/``."""
