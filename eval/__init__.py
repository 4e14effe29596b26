"""Evaluation and benchmarks (installed as `dual_cache.eval`)."""
