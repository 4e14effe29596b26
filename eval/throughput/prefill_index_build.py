"""Prefill wall time with exact selection vs the 2-bit index (`lowbit`), alternating, on a real model.

    python -m dual_cache.eval.throughput.prefill_index_build --tokens 8192 --rounds 2 \
        --out results/bench/index-build-prefill/smollm2-8k
    python -m dual_cache.eval.throughput.prefill_index_build --model gemma3-270m --tokens 32768 --rounds 2

The two configurations differ only in the selector, so the difference is the index build over the prompt
(`LowBitSelector.extend` per prefill chunk). Each call prefills `--tokens` random tokens and decodes one token; each
selector's best round is kept (rounds alternate the selectors, so a drift in the machine's load touches both).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from .step_profile import prompt_ids

SELECTORS = ("exact", "lowbit")


def time_prefills(model, tokens: int, rounds: int, budget: int = 256, seed: int = 0) -> dict:
    """Time `rounds` alternating `generate()` calls per selector (one new token after `tokens` random token ids,
    batch 1, `budget` tokens per KV head). Returns seconds per round and the best (minimum) per selector, and
    `lowbit_over_exact`, the ratio of the two best rounds; random token ids (`step_profile.prompt_ids`) from `seed`."""
    ids = prompt_ids(None, model.config.vocab_size, tokens, 1, "random", seed)
    seconds: dict[str, list[float]] = {name: [] for name in SELECTORS}
    for _ in range(rounds):
        for selector in SELECTORS:
            start = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                           cache_implementation="dual", cache_config={"budget": budget, "selector": selector})
            seconds[selector].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in seconds.items()}
    return {"tokens": tokens, "budget": budget, "threads": torch.get_num_threads(), "seconds": seconds, "best": best,
            "lowbit_over_exact": best["lowbit"] / best["exact"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.throughput.prefill_index_build",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--model", default=None, help="name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each selector once per round)")
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget, help="tokens per KV head")
    parser.add_argument("--out", default=None, help="output path without extension (.json)")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1 or args.budget < 1:
        parser.error("--tokens, --rounds and --budget must be >= 1")
    from ...model.loading import load_model

    model, _ = load_model(args.model)
    row = {"model": args.model or "embedded", **time_prefills(model, args.tokens, args.rounds, args.budget)}
    print(json.dumps(row))
    if args.out:
        with open(args.out + ".json", "w", encoding="utf-8") as handle:
            json.dump(row, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
