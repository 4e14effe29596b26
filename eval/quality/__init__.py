"""The quality harness: RULER, LongBench, fidelity to dense, word needles, their metrics, and the report."""
