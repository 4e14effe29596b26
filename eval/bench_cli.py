"""`dual-decoder bench`: the throughput and memory benchmark (`bench.py`) as a subcommand of the CLI."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to `dual-decoder`'s subparsers; returns it."""
    from . import bench

    parser = subparsers.add_parser(
        "bench", help="throughput and memory benchmark: dense vs offloaded vs dual (vs quest) over a grid",
        description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(parser)
    parser.set_defaults(func=bench.run_from_args)
    return parser
