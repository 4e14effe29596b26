"""`dual-decoder bench`: the throughput and memory benchmark (`bench.py`) as a subcommand of the CLI."""

from __future__ import annotations

import argparse

from ...cli.help_format import DefaultsHelpFormatter


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to `dual-decoder`'s subparsers; returns it."""
    from . import bench

    parser = subparsers.add_parser(
        "bench", help="throughput and memory benchmark: dense vs offloaded vs dual (vs quest) over a grid",
        description="Throughput and memory benchmark: dense vs offloaded vs dual (vs Quest) over method x batch x "
                    "context x budget, and each method's throughput at its max batch under a device-memory cap and "
                    "the host memory available. Per-cell fields and the capacity search: docs at the top of "
                    "eval/throughput/bench.py.",
        formatter_class=DefaultsHelpFormatter,
    )
    bench.add_arguments(parser)
    parser.set_defaults(func=bench.run_from_args)
    return parser
