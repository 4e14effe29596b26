"""What the speculated token should be after a miss (issue 64), measured: the speculation hit rate of variants of
the self speculator through `generate()` with the dual cache, on natural-text prompts, greedy and sampled.

    python -m dual_cache.eval.selection.speculator_variants --tokens 2048 --seeds 0-3 --budgets 256 --threads 1 \
        --out results/selection/speculator-variants-smollm2-natural-2k

After a hit every variant proposes the model's own chained guess (the speculated slot's argmax, computed on the true
context). After a miss (and on a request's first step, where every variant uses prompt lookup) they differ:

- `current`: the library's `SelfSpeculator`: prompt lookup (transformers' `PromptLookupCandidateGenerator`, n-grams
  of 3 down to 1, the first match), falling back to the chained guess where nothing matches.
- `chain`: the chained guess (computed on a wrong context after a miss, but the model's own words).
- `adaptive`: lookup only where lookup would have predicted the newest real token (the text is being copied from
  earlier in the sequence), else the chained guess.
- `scored`: per sequence, whichever of lookup and the chained guess was right more often on its earlier miss steps
  (ties: lookup).

Reported per variant, budget and decoding: hits / speculated steps per prompt at batch 1, and the rate over all.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import torch

from ...cache.cache import DualDecoderCache
from ...cli.help_format import DefaultsHelpFormatter
from ...generate import step as step_module
from ...generate.speculators import PromptLookupSpeculator, SelfSpeculator, Speculator
from ...model.inputs import cache_kwarg_name
from ..outputs import default_out, write_rows_and_table
from ..quality.natural_text import natural_prompt_ids
from ..quality.needle_sweep import load_tool_model, parse_seeds, threads_arg


class ChainSpeculator(Speculator):
    """After a miss, the chained guess; prompt lookup on the first step only."""

    def __init__(self, ngram_size: int = 3) -> None:
        self.lookup = PromptLookupSpeculator(ngram_size)

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None) -> list[int]:
        return self.lookup.propose(sequences, None, None) if chained is None else list(chained)


class AdaptiveSpeculator(ChainSpeculator):
    """After a miss, lookup where it would have predicted the newest real token, else the chained guess."""

    def propose(self, sequences, chained, last_hit):
        if chained is None or last_hit is None:
            return self.lookup.propose(sequences, None, None)
        out = list(chained)
        for i, sequence in enumerate(sequences):
            if not last_hit[i] and self.lookup.propose([sequence[:-1]], [-1], None)[0] == int(sequence[-1]):
                out[i] = self.lookup.propose([sequence], [chained[i]], None)[0]
        return out


class ScoredSpeculator(ChainSpeculator):
    """After a miss, whichever source (lookup, chained guess) was right more often on the row's earlier miss steps;
    its tallies are per batch row of one `generate()` call."""

    def __init__(self, ngram_size: int = 3) -> None:
        super().__init__(ngram_size)
        self.right: dict[int, list[int]] = {}  # row -> [lookup right, chained right]
        self.pending: dict[int, tuple[int, int]] = {}  # row -> the last miss step's (lookup, chained) proposals

    def propose(self, sequences, chained, last_hit):
        out = []
        for i, sequence in enumerate(sequences):
            looked = self.lookup.propose([sequence], None if chained is None else [chained[i]], None)[0]
            if i in self.pending:  # the newest real token tells which source was right
                by_lookup, by_chain = self.pending.pop(i)
                tally = self.right.setdefault(i, [0, 0])
                tally[0] += by_lookup == int(sequence[-1])
                tally[1] += by_chain == int(sequence[-1])
            if chained is None or last_hit is None:
                out.append(looked)
            elif last_hit[i]:
                out.append(chained[i])
            else:
                self.pending[i] = (looked, chained[i])
                tally = self.right.get(i, [0, 0])
                out.append(chained[i] if tally[1] > tally[0] else looked)
        return out


VARIANTS = {"current": SelfSpeculator, "chain": ChainSpeculator, "adaptive": AdaptiveSpeculator,
            "scored": ScoredSpeculator}


def hits(model, tokenizer, prompt: list[int], variant: str, budget: int, new_tokens: int,
         sample: bool) -> tuple[int, int]:
    """`(hits, speculated steps)` of one batch-1 `generate()` with `variant` as the self speculator."""
    made = step_module.make_speculator
    step_module.make_speculator = lambda name, ngram_size: VARIANTS[variant](ngram_size)
    try:
        torch.manual_seed(0)
        options = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0) if sample else dict(do_sample=False)
        with DualDecoderCache(model.config, budget=budget) as cache:
            options[cache_kwarg_name(model, "forward")] = cache  # the installed transformers' name for it
            model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=tokenizer.eos_token_id, **options)
            stats = cache.stats()
    finally:
        step_module.make_speculator = made
    return int(stats["spec_hits"]), int(stats["spec_steps"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speculator_variants", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="natural-text prompt length (tokens)")
    parser.add_argument("--seeds", default="0-7", help="prompts, e.g. 0-7")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 768])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--threads", type=threads_arg, default=None)
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--out", default=None, help="output path without extension (.json, .md)")
    args = parser.parse_args(argv)
    model, tokenizer = load_tool_model(args.threads, args.model)
    prompts = [natural_prompt_ids(tokenizer, args.tokens, seed) for seed in parse_seeds(args.seeds)]
    rows = []
    for budget in args.budgets:
        for sample in (False, True):
            for variant in args.variants:
                counts = [hits(model, tokenizer, prompt, variant, budget, args.new_tokens, sample) for prompt in prompts]
                row = {"variant": variant, "budget": budget, "decoding": "sampled" if sample else "greedy",
                       "per_prompt": [f"{h}/{s}" for h, s in counts],
                       "rate": sum(h for h, _ in counts) / max(1, sum(s for _, s in counts))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = [f"Speculation hit rate after a miss, by variant: natural-text prompts of {args.tokens} tokens, seeds "
             f"{args.seeds}, batch 1, {args.new_tokens} new tokens; sampled: temperature 0.7, top-p 0.9, seed 0.", "",
             "| budget | decoding | variant | hit rate | hits per prompt |", "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['budget']} | {row['decoding']} | {row['variant']} | {row['rate']:.3f} | "
                     f"{' '.join(row['per_prompt'])} |")
    table = "\n".join(lines) + "\n"
    print(table)
    meta = {"tokens": args.tokens, "seeds": args.seeds, "new_tokens": args.new_tokens}
    write_rows_and_table(args.out or default_out("speculator-variants"), [{"meta": meta}] + rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
