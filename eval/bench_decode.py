"""Decode throughput of dense vs dual on the embedded model: `python -m dual_cache.eval.bench_decode`.

Per context length: decode tokens/s (prefill excluded) of the default `DynamicCache` and of the dual cache in the
same run, their ratio, speculation hit rate under greedy decoding and under sampling (temperature 1), and device
bytes vs the dense cache's. Prints a markdown table and writes JSON rows with `--out`.
"""

from __future__ import annotations

import argparse
import json

import torch

from ..cli import TimingStreamer
from ..config import DualDecoderConfig
from ..models import load_model
from .needle import format_chat, make_needle_prompt


def measure(model, ids, new_tokens: int, cache_kwargs: dict, sample: bool = False) -> dict:
    """Decode `new_tokens` (exactly) after `ids`; returns tokens/s after the first token and the cache stats."""
    timer = TimingStreamer()
    if sample:
        torch.manual_seed(0)
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=sample, temperature=1.0 if sample else None, top_k=0 if sample else None, top_p=None,
        streamer=timer, return_dict_in_generate=True, **cache_kwargs,
    )
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    row = {"tokens_per_s": timer.decode_tokens_per_second()}
    if hasattr(cache, "stats"):
        row.update(cache.stats())
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", default=None, help="write JSON rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    config = DualDecoderConfig(budget=args.budget)
    dual_kwargs = {"cache_implementation": "dual", "cache_config": config.__dict__}
    rows = []
    for context in args.contexts:
        prompt = make_needle_prompt(tokenizer, context, seed=0)
        ids = torch.tensor([format_chat(tokenizer, prompt.text)])
        dense = measure(model, ids, args.new_tokens, {})
        dual = measure(model, ids, args.new_tokens, dual_kwargs)
        sampled = measure(model, ids, args.new_tokens, dual_kwargs, sample=True)
        row = {
            "context": ids.shape[1], "budget": args.budget, "threads": torch.get_num_threads(),
            "dense_tokens_per_s": dense["tokens_per_s"], "dual_tokens_per_s": dual["tokens_per_s"],
            "ratio": dual["tokens_per_s"] / dense["tokens_per_s"],
            "hit_rate_greedy": dual["spec_hits"] / max(dual["spec_steps"], 1),
            "hit_rate_sampling": sampled["spec_hits"] / max(sampled["spec_steps"], 1),
            "device_bytes": dual["device_bytes"], "dense_bytes": dual["dense_equivalent_bytes"],
            "device_ratio": dual["device_bytes"] / dual["dense_equivalent_bytes"],
            "host_bytes": dual["host_bytes"], "bytes_copied_per_step": dual["bytes_copied"] / max(args.new_tokens, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| context | dense tok/s | dual tok/s | dual/dense | hit greedy | hit sampling | device / dense bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['dense_tokens_per_s']:.2f} | {r['dual_tokens_per_s']:.2f} | {r['ratio']:.2f} | "
            f"{r['hit_rate_greedy']:.0%} | {r['hit_rate_sampling']:.0%} | {r['device_ratio']:.1%} |"
        )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
