"""`python -m dual_cache.eval.bench_retrieval`: the command issue #27 asked to keep, now
`dual_cache.eval.selection.bench_retrieval` (also `dual-decoder bench-retrieval`)."""

from .selection.bench_retrieval import main

if __name__ == "__main__":
    raise SystemExit(main())
