"""Evaluation and benchmarks (installed as `dual_cache.eval`), one subpackage per job:

- `quality`: the quality harness (RULER, LongBench, fidelity to dense, word needles, metrics) and its report;
- `throughput`: the throughput and memory benchmark, its capacity search, the step profilers, and the serving
  benchmark (`dual-decoder bench-serve`);
- `selection`: host selection on its own (cost per step, recall of the exact top-k mass on real keys);
- `card`: Hub model cards (`dual-decoder card`) and the kvpress hand-off.

Top level: `results_table` (`dual-decoder report`), `tools_cli` (the analysis tools as subcommands), `outputs`
(rows + markdown side by side), `gpu_check` and `device_run.sh` (the CUDA machine).

The library (`dual_cache/`) never imports this package: `dual-decoder` finds its commands through the
`dual_cache.commands` entry points (pyproject.toml).
"""
