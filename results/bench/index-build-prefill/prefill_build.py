"""Prefill wall time with exact selection vs the 2-bit index (`lowbit`), alternating, on a real model.

The two configurations differ only in the selector, so the difference is the index build over the prompt
(`LowBitSelector.extend` per prefill chunk). Each call prefills `--tokens` random tokens and decodes one token.

    python results/bench/index-build-prefill/prefill_build.py --model gemma3-270m --tokens 32768 --rounds 2
"""

import argparse
import json
import time

import torch

from dual_cache.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="name or path (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model, _ = load_model(args.model)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size - 100, (1, args.tokens), generator=generator)
    seconds = {"exact": [], "lowbit": []}
    for _ in range(args.rounds):
        for selector in seconds:
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False, cache_implementation="dual",
                           cache_config={"budget": 256, "selector": selector})
            seconds[selector].append(time.perf_counter() - start)
    best = {name: min(values) for name, values in seconds.items()}
    print(json.dumps({"model": args.model or "embedded", "tokens": args.tokens, "threads": torch.get_num_threads(),
                      "seconds": seconds, "best": best, "lowbit_over_exact": best["lowbit"] / best["exact"]}))


if __name__ == "__main__":
    main()
