"""Per-layer pipeline timeline of the dual cache: `python -m dual_cache.eval.throughput.pipeline_timeline`.

Decodes a needle prompt with `record_timeline=True` at each context length, for the synchronous path
(`retrieval_threads=0`) and the threaded one (`retrieval_threads=1`), and prints per layer the mean retrieval time
(scoring + top-k + gather, ms), copy time (ms), the compute side's wait (ms) and bytes per step, plus each run's
overlap ratio `1 − wait / (retrieval + copy)` and decode tokens/s. `--out` writes the summaries and the raw
timelines as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ...cache.cache import DualDecoderCache
from ...config import DualDecoderConfig
from ...generate.timing import TimingStreamer
from ...model.chat import format_chat
from ...model.loading import load_model
from ...model.needle_prompt import make_needle_prompt


def summarize(timeline: list[dict], skip_steps: int = 1) -> list[dict]:
    """Per-layer means over the records of steps after `skip_steps` (ms and bytes per step)."""
    layers: dict[int, list[dict]] = {}
    for record in timeline:
        if record["step"] > skip_steps:
            layers.setdefault(record["layer"], []).append(record)
    rows = []
    for layer, records in sorted(layers.items()):
        rows.append({
            "layer": layer,
            "retrieval_ms": 1e3 * statistics.mean(r["retrieval_end"] - r["retrieval_start"] for r in records),
            "copy_ms": 1e3 * statistics.mean(r["copy_end"] - r["copy_start"] for r in records),
            "waited_ms": 1e3 * statistics.mean(r["waited"] for r in records),
            "bytes": statistics.mean(r["bytes"] for r in records),
        })
    return rows


def run(model, ids: torch.Tensor, new_tokens: int, threads: int, budget: int) -> dict:
    """One greedy generation with the timeline recorded; returns stats, per-layer summary and raw timeline."""
    cache = DualDecoderCache(model.config, budget=budget, retrieval_threads=threads, record_timeline=True)
    timer = TimingStreamer()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, cache=cache, streamer=timer)
    return {"threads": threads, "tokens_per_s": timer.decode_tokens_per_second(), "stats": cache.stats(),
            "layers": summarize(cache.timeline()), "timeline": cache.timeline()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.throughput.pipeline_timeline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192], help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--out", default=None, help="JSON file for summaries and raw timelines")
    args = parser.parse_args(argv)
    if args.new_tokens < 3:
        parser.error("--new-tokens must be >= 3 (the first step is excluded from the summary)")
    model, tokenizer = load_model(args.model)
    results = []
    for context in args.contexts:
        ids = torch.tensor([format_chat(tokenizer, make_needle_prompt(tokenizer, context, seed=0).text)])
        for threads in (0, 1):
            result = run(model, ids, args.new_tokens, threads, args.budget)
            result["context"] = ids.shape[1]
            results.append(result)
            layers, stats = result["layers"], result["stats"]
            print(f"\n## context {ids.shape[1]}, retrieval_threads={threads}: {result['tokens_per_s']:.2f} tokens/s, "
                  f"overlap ratio {stats['overlap_ratio']:.3f}, wait {stats['wait_seconds']:.2f} s over "
                  f"{stats['steps']} steps\n\n| layer | retrieval ms | copy ms | waited ms | KiB/step |\n|---|---|---|---|---|")
            for row in layers:
                print(f"| {row['layer']} | {row['retrieval_ms']:.2f} | {row['copy_ms']:.3f} | {row['waited_ms']:.2f} | "
                      f"{row['bytes'] / 1024:.0f} |")
            mean = statistics.mean(r["retrieval_ms"] for r in layers)
            print(f"| mean | {mean:.2f} | {statistics.mean(r['copy_ms'] for r in layers):.3f} | "
                  f"{statistics.mean(r['waited_ms'] for r in layers):.2f} | |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
