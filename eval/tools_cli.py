"""Analysis tools as `dual-decoder` subcommands: each runs its module's own `main(argv)` (the same command line as
`python -m dual_cache.eval.<module>`)."""

from __future__ import annotations

import functools
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
    """List the tools in `dual-decoder --help`; each parses its own arguments (`run_tool`, called by
    `dual_cache.cli.main.main` for a subcommand registered with `run_argv`)."""
    for name, (_, text) in TOOLS.items():
        sub.add_parser(name, help=text, add_help=False).set_defaults(run_argv=functools.partial(run_tool, name))


def run_tool(name: str, argv: list[str]) -> int:
    """Run the tool `name` (a key of `TOOLS`) on `argv`, as `dual-decoder <name>`."""
    module = importlib.import_module(f"dual_cache.eval.{TOOLS[name][0]}")
    program, sys.argv[0] = sys.argv[0], f"dual-decoder {name}"
    try:
        return module.main(argv)
    finally:
        sys.argv[0] = program
