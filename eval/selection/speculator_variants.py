"""What the speculated token should be after a miss (issues 64 and 71), measured: the speculation hit rate of
variants of the self speculator through `generate()` with the dual cache, per prompt (per batch row), on two prompt
kinds, greedy and sampled, at several batch sizes.

    python -m dual_cache.eval.selection.speculator_variants --kinds natural own-words --tokens 2048 --seeds 0-7 \
        --budgets 256 --batches 1 4 --variants current library --threads 1 \
        --out results/selection/speculator-recovery/smollm2-2k

Prompt kinds: `natural` (passages of the Python Language Reference asked to be continued in the same style:
`quality.natural_text`) and `own-words` (passages of CPython's licence and standard-library docstrings asked to be
continued in the model's own words: `quality.own_words`). A batch of B holds B consecutive prompts of the kind (the
list repeats where it is shorter than B), left-padded to the longest.

After a hit every variant proposes the model's own chained guess (the speculated slot's argmax, computed on the true
context). After a miss (and on a request's first step, where every variant uses prompt lookup) they differ:

- `current`: the self speculator before issue 71: prompt lookup (transformers' `PromptLookupCandidateGenerator`,
  n-grams of 3 down to 1, the first match), falling back to the chained guess where nothing matches.
- `library`: the library's `SelfSpeculator` as it is configured by default (lookup after every miss through its
  incremental `NgramIndex`, transformers' first match: the same proposals as `current`).
- `per-row`: `SelfSpeculator(window=8)`: per row, whichever of lookup and the chained guess was right more often on
  the row's last 8 after-miss steps (ties: lookup); `library-latest`: the same with lookup's most recent match. (In
  `results/selection/speculator-recovery/`, measured when it was the default, it is the rows named `library`.)
- `chain`: the chained guess (computed on a wrong context after a miss, but the model's own words).
- `adaptive`: lookup only where lookup would have predicted the newest real token (the text is being copied from
  earlier in the sequence), else the chained guess.
- `scored`: issue 64's sketch of `library`: per row, lookup vs chained guess tallied over all its miss steps.

Reported per kind, budget, decoding, batch and variant: each prompt's hit rate (hits / speculated steps of its row),
their mean and the worst, and the rate over all rows.
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
from ..quality.own_words import own_words_prompt_ids
from ..quality.needle_sweep import load_tool_model, parse_seeds, threads_arg


KINDS = {"natural": natural_prompt_ids, "own-words": own_words_prompt_ids}


class CurrentSpeculator(Speculator):
    """The self speculator before issue 71: after a miss (and on the first step), prompt lookup first (transformers'
    first match), the chained guess where nothing matches."""

    def __init__(self, ngram_size: int = 3) -> None:
        self.lookup = PromptLookupSpeculator(ngram_size)

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None, rows=None) -> list[int]:
        if chained is None or last_hit is None:
            return self.lookup.propose(sequences, chained, None)
        proposals = list(chained)
        missed = [i for i, hit in enumerate(last_hit) if not hit]
        if missed:
            looked = self.lookup.propose([sequences[i] for i in missed], [chained[i] for i in missed], None)
            for i, token in zip(missed, looked):
                proposals[i] = token
        return proposals


class ChainSpeculator(Speculator):
    """After a miss, the chained guess; prompt lookup on the first step only."""

    def __init__(self, ngram_size: int = 3) -> None:
        self.lookup = PromptLookupSpeculator(ngram_size)

    def propose(self, sequences: Sequence[torch.Tensor], chained: list[int] | None,
                last_hit: list[bool] | None, rows=None) -> list[int]:
        return self.lookup.propose(sequences, None, None) if chained is None else list(chained)


class AdaptiveSpeculator(ChainSpeculator):
    """After a miss, lookup where it would have predicted the newest real token, else the chained guess."""

    def propose(self, sequences, chained, last_hit, rows=None):
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

    def propose(self, sequences, chained, last_hit, rows=None):
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


VARIANTS = {"current": CurrentSpeculator, "library": SelfSpeculator,
            "per-row": lambda ngram_size: SelfSpeculator(ngram_size, window=8),
            "library-latest": lambda ngram_size: SelfSpeculator(ngram_size, window=8, latest=True), "chain": ChainSpeculator,
            "adaptive": AdaptiveSpeculator, "scored": ScoredSpeculator}


def row_hits(model, tokenizer, prompts: list[list[int]], variant: str, budget: int, new_tokens: int,
             sample: bool) -> list[tuple[int, int]]:
    """Per row, `(hits, speculated steps)` of one `generate()` of the batch `prompts` (left-padded) with `variant`
    as the self speculator."""
    made = step_module.make_speculator
    step_module.make_speculator = lambda name, ngram_size: VARIANTS[variant](ngram_size)
    pad = tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    try:
        torch.manual_seed(0)
        options = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=0) if sample else dict(do_sample=False)
        with DualDecoderCache(model.config, budget=budget) as cache:
            options[cache_kwarg_name(model, "forward")] = cache  # the installed transformers' name for it
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           pad_token_id=pad, **options)
            counts = [tuple(c) for c in cache.accounting.rows_done + cache.accounting.row_counts]
    finally:
        step_module.make_speculator = made
    return counts


def measure(model, tokenizer, prompts: list[list[int]], variant: str, budget: int, new_tokens: int, sample: bool,
            batch: int) -> list[tuple[int, int]]:
    """Per prompt, `(hits, steps)` of its row, the prompts decoded `batch` at a time (the list repeated to fill a
    batch where it is shorter; each prompt counted once, in its first row)."""
    if batch > len(prompts):
        rows = [prompts[i % len(prompts)] for i in range(batch)]
        return row_hits(model, tokenizer, rows, variant, budget, new_tokens, sample)[:len(prompts)]
    out = []
    for start in range(0, len(prompts), batch):
        out += row_hits(model, tokenizer, prompts[start:start + batch], variant, budget, new_tokens, sample)
    return out


def summary(counts: list[tuple[int, int]]) -> dict:
    """Per-prompt rates, their mean and the worst, and the rate over all rows."""
    rates = [h / s for h, s in counts if s]
    return {"per_prompt": [f"{h}/{s}" for h, s in counts], "mean": sum(rates) / len(rates), "worst": min(rates),
            "rate": sum(h for h, _ in counts) / max(1, sum(s for _, s in counts))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="speculator_variants", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=["natural"], help="prompt kinds")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (tokens)")
    parser.add_argument("--seeds", default="0-7", help="prompts, e.g. 0-7")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 768])
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="batch sizes")
    parser.add_argument("--decodings", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--threads", type=threads_arg, default=None)
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--out", default=None, help="output path without extension (.json, .md)")
    args = parser.parse_args(argv)
    model, tokenizer = load_tool_model(args.threads, args.model)
    rows = []
    for kind in args.kinds:
        prompts = [KINDS[kind](tokenizer, args.tokens, seed) for seed in parse_seeds(args.seeds)]
        for budget in args.budgets:
            for decoding in args.decodings:
                for batch in args.batches:
                    for variant in args.variants:
                        counts = measure(model, tokenizer, prompts, variant, budget, args.new_tokens,
                                         decoding == "sampled", batch)
                        row = {"kind": kind, "budget": budget, "decoding": decoding, "batch": batch,
                               "variant": variant, **summary(counts)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    lines = [f"Speculation hit rate per prompt (batch row), by variant: prompts of {args.tokens} tokens, seeds "
             f"{args.seeds}, {args.new_tokens} new tokens; sampled: temperature 0.7, top-p 0.9, seed 0.", "",
             "| kind | budget | decoding | batch | variant | mean | worst | over all | hits per prompt |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['kind']} | {row['budget']} | {row['decoding']} | {row['batch']} | {row['variant']} | "
                     f"{row['mean']:.3f} | {row['worst']:.3f} | {row['rate']:.3f} | {' '.join(row['per_prompt'])} |")
    table = "\n".join(lines) + "\n"
    print(table)
    meta = {"kinds": args.kinds, "tokens": args.tokens, "seeds": args.seeds, "new_tokens": args.new_tokens,
            "batches": args.batches}
    write_rows_and_table(args.out or default_out("speculator-variants"), [{"meta": meta}] + rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
