"""Command-line options several evaluation tools share, each defined once: the attention shape of the tools that time
selection or attention on random keys, and sampling. (The method's own options take their defaults from
`DualDecoderConfig` in each tool, `default=DualDecoderConfig.budget` and the like: no tool restates them,
tests/test_option_defaults.py.)"""

from __future__ import annotations

import argparse

# the default shape: Llama-3.1-8B's attention (32 query heads, 8 KV heads of 128 channels)
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def add_shape_options(parser: argparse.ArgumentParser) -> None:
    """`--heads`, `--kv-heads`, `--head-dim`: the attention shape of random keys and queries (default: Llama-3.1-8B's,
    32 query heads and 8 KV heads of 128 channels)."""
    group = parser.add_argument_group("attention shape (default: Llama-3.1-8B's)")
    group.add_argument("--heads", type=int, default=HEADS, help="query heads")
    group.add_argument("--kv-heads", type=int, default=KV_HEADS, help="KV heads")
    group.add_argument("--head-dim", type=int, default=HEAD_DIM, help="channels per head")


def add_sampling_options(parser: argparse.ArgumentParser, top_p: bool = False) -> None:
    """`--temperature` (0, the default: greedy; above it the dual loop samples, the speculated token coupled to the
    real one) and, with `top_p`, `--top-p` (1, the default: off)."""
    group = parser.add_argument_group("sampling")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="0: greedy; above 0: sampled at this temperature (coupled sampling in the dual loop)")
    if top_p:
        group.add_argument("--top-p", type=float, default=1.0,
                           help="nucleus mass kept when sampling, in (0, 1] (1: off; < 1 needs --temperature > 0)")
