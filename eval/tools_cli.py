"""Analysis tools as `dual-decoder` subcommands: each runs its module's own `main(argv)` (the same command line as
`python -m dual_cache.eval.<module>`)."""

from __future__ import annotations

import importlib
import sys

TOOLS = {  # subcommand: (module in dual_cache.eval, help)
    "bench-retrieval": ("selection.bench_retrieval", "host selection cost per decode step, selector by selector, at a model shape"),
    "needle": ("quality.needle_sweep", "word-needle sweep: methods x prompts, answers and agreement with dense"),
    "recall": ("selection.selection_recall", "recall of the exact top-k attention mass per selector and layer, on real keys"),
    "agentic": ("throughput.agentic", "shared-document batch and multi-turn conversation vs re-prefill"),
    "gpu-check": ("gpu_check", "CUDA checks: full budget == dense, pipelined == synchronous"),
}


def add_parsers(sub) -> None:
    """List the tools in `dual-decoder --help` (their arguments are parsed by the tools themselves, see `run`)."""
    for name, (_, text) in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False)


def run(argv: list[str]) -> int | None:
    """Run `argv[0]`'s tool on `argv[1:]` if it names one; None otherwise."""
    if not argv or argv[0] not in TOOLS:
        return None
    module = importlib.import_module(f"dual_cache.eval.{TOOLS[argv[0]][0]}")
    program, sys.argv[0] = sys.argv[0], f"dual-decoder {argv[0]}"
    try:
        return module.main(argv[1:])
    finally:
        sys.argv[0] = program
