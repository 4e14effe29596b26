"""How much of the exact top-k attention mass each selector keeps, on a real model's keys and queries.

    python -m dual_cache.eval.selection.selection_recall --tokens 8192 --seeds 4-7 --threads 2 \
        --configs exact lowbit 'lowbit:{"lowbit_factor": 2}' 'lowbit:{"lowbit_factor": 8}' \
        --out results/selection/smollm2-135m-8k-lowbit

For each word-needle prompt (`dual_cache.model.needle_prompt.make_needle_prompt`), or each RULER sample of
`--ruler-task` (the prompts of the RULER table: `ruler.generate_sample` with the model's prompt format, seed = sample
index), one dense prefill (in chunks, transformers' default cache) records every full-attention layer's keys (after
RoPE) and the queries of the last `--queries` prompt positions. Per layer (from `--skip-layers`), KV head and query
position `p`, the exact criterion is the softmax attention mass summed over the GQA group over every candidate
(positions past the sink and before the local window of `p`); `recall` is the mass of the `budget` entries a selector
picks divided by the mass of the exact top-`budget` (1.0 = the exact selection), and `top-k share` is the exact
top-`budget`'s mass divided by every candidate's (how much a budget of that size can hold at all: low on tasks whose
answer reads many positions). Each selector runs as in decoding (`dual_cache.selection.selectors`): its index is built
over the prompt (timed: build ms per 1K tokens per layer), then it selects for each query (timed: ms per layer).
Reported per configuration: mean, 10th percentile and minimum recall, the key bytes a selection reads relative to exact
scoring, the index's host bytes relative to the layer's K/V, and the two timings (this CPU; compare within one run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...host.store import HostKVStore
from ...model.chat import format_chat
from ...model.loading import model_display_name
from ...model.needle_prompt import make_needle_prompt
from ...selection.candidates import Candidates
from ...selection.selectors import SELECTORS
from ..outputs import default_out, write_rows_and_table
from ..quality.needle_sweep import load_tool_model, parse_seeds, threads_arg
from .torch_exact import group_attention_mass

RECORDER = "dual_recall_recorder"
_recording: dict | None = None  # layer -> (queries, keys, scaling) of the last chunk, while recording


def _recorder(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA attention that keeps, for full-attention layers, the last `queries` positions' queries and every key."""
    if _recording is not None and getattr(module, "sliding_window", None) is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        count = _recording["queries"]
        _recording[module.layer_idx] = (query[:, :, -count:].float().cpu(), key.float().cpu(), scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def record_prefill(model, ids: torch.Tensor, queries: int = 1, chunk: int = 2048) -> dict[int, tuple]:
    """A dense prefill of `ids` `(1, n)` in chunks of `chunk` tokens; per full-attention layer, `(queries (1, H_q,
    queries, D), keys (1, H_kv, n, D), scaling)` float32 on the host, for the last `queries` positions."""
    global _recording
    AttentionInterface.register(RECORDER, _recorder)
    AttentionMaskInterface.register(RECORDER, sdpa_mask)  # the real causal mask for chunks after the first
    previous = model.config._attn_implementation
    model.set_attn_implementation(RECORDER)
    n = ids.shape[1]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            for start in range(0, n, chunk):
                end = min(n, start + chunk)
                _recording = {"queries": min(queries, end - start)} if end == n else None
                model(ids[:, start:end], past_key_values=cache, use_cache=True, logits_to_keep=1,
                      position_ids=torch.arange(start, end)[None])
        return {layer: value for layer, value in _recording.items() if layer != "queries"}
    finally:
        model.set_attn_implementation(previous)
        _recording = None


def parse_config(text: str) -> tuple[str, dict]:
    """`"lowbit"` or `'lowbit:{"lowbit_factor": 4}'` → `(selector, options)`; raises `ValueError`."""
    name, _, options = text.partition(":")
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r} in --configs; choose from {sorted(SELECTORS)}.")
    try:
        values = json.loads(options) if options else {}
        DualDecoderConfig(selector=name, **values)
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise ValueError(f"--configs {text!r}: {error}") from None
    return name, values


def layer_recalls(queries: torch.Tensor, keys: torch.Tensor, scaling: float, budget: int,
                  configs: list[tuple[str, dict]], n_sink: int, window: int) -> dict[int, dict]:
    """Recall of each configuration against the exact top-`budget` for one layer.

    Args:
        queries: `(1, H_q, Q, D)` float32, the last `Q` positions' queries; keys: `(1, H_kv, n, D)` float32.
        scaling: softmax scale; budget: entries per KV head (tokens); configs: `(selector, options)` pairs.
        n_sink, window: positions `< n_sink` and the `window` positions before each query are not candidates.

    Returns:
        `{index in configs: {"recall": (Q·H_kv,) float32, "share": (Q·H_kv,) float32 (exact top-`budget` mass /
        candidate mass), "build_s": seconds, "select_s": seconds per select,
        "index_bytes": int, "kv_bytes": int, "read": key bytes per select, "scanned": (query, KV head) selections
        that scanned every key's code (the `carried` selector scans some; the others all), "tasks": Q·H_kv}}`.
    """
    n, count = keys.shape[2], queries.shape[2]
    store = HostKVStore(1, keys.shape[1], keys.shape[3], torch.float32, chunk_tokens=4096)
    store.reserve(n)
    store.append(keys, keys)
    first_real = torch.zeros(1, dtype=torch.long)
    out = {}
    for index, (name, options) in enumerate(configs):
        config = DualDecoderConfig(selector=name, **options)
        selector = SELECTORS[name](config, store, "cpu")
        start = time.thread_time()
        selector.extend(n, first_real)
        build = time.thread_time() - start
        recalls, shares, select_time, read = [], [], 0.0, 0.0
        for j in range(count):
            hi = n - count + j - window  # the query at position p = n - count + j: window [p - window, p)
            candidates = Candidates(torch.arange(hi)[None, :] >= n_sink, first_real)
            query = queries[:, :, j]
            mass = group_attention_mass(query, store.key_chunks(hi), candidates.mask, scaling)  # (1, H_kv, hi)
            best = torch.topk(mass, min(budget, hi), dim=-1).values.sum(-1)
            start = time.thread_time()
            indices, valid = selector.select(query, candidates, scaling, budget)
            select_time += time.thread_time() - start
            recalls.append(((torch.gather(mass, 2, indices) * valid).sum(-1) / best)[0])
            shares.append((best / mass.sum(-1))[0])
            read += sum(selector.key_bytes_read(hi, budget))
        out[index] = {"recall": torch.cat(recalls), "share": torch.cat(shares), "build_s": build,
                      "select_s": select_time / count,
                      "index_bytes": selector.host_bytes, "kv_bytes": store.nbytes, "read": read / count,
                      "exact_read": float(keys.shape[1] * keys.shape[3] * 4 * (n - window)),
                      "scanned": getattr(selector, "tasks_scanned", count * keys.shape[1]),
                      "tasks": count * keys.shape[1]}
        selector.free()
    store.free()
    return out


def add_recording_arguments(parser: argparse.ArgumentParser, seeds: str = "0-3") -> None:
    """The arguments of a tool that scores selections on recorded needle prefills: --tokens, --seeds, --budget,
    --queries, --skip-layers, --threads, --model, --ruler-task, --out."""
    from ..quality.ruler import TASKS

    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (tokens)")
    parser.add_argument("--seeds", default=seeds, help="needle prompts (or RULER samples), e.g. 0-3 or 0,5")
    parser.add_argument("--ruler-task", choices=[t for t in TASKS if not t.startswith("qa")], default=None,
                        help="score RULER samples of this task (the RULER table's prompts) instead of word needles")
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget, help="tokens per KV head")
    parser.add_argument("--queries", type=int, default=16, help="last prompt positions whose queries are scored")
    parser.add_argument("--skip-layers", type=int, default=DualDecoderConfig.early_layers,
                        help="leave out the first layers (larger budget)")
    parser.add_argument("--threads", type=threads_arg, default=None, help="torch intra-op threads")
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--out", default=None,
                        help="output path without extension, writes .json and .md (default: a new "
                             "eval-results/recall/<time>; results/ only when --out names it)")


def check_recording_arguments(args: argparse.Namespace) -> list[int]:
    """The seeds of `args` (from `add_recording_arguments`); raises `ValueError` naming the argument to change."""
    seeds = parse_seeds(args.seeds)
    if args.tokens < 4 * args.budget or args.budget < 1 or args.queries < 1:
        raise ValueError("--tokens must be >= 4 × --budget, and --budget, --queries >= 1.")
    return seeds


def recorded_layers(args: argparse.Namespace, seeds: list[int]):
    """Yield `(layer, queries, keys, scaling)` (as `record_prefill`) for every full-attention layer from
    `--skip-layers` of each seed's needle prefill, loading `--model` once."""
    model, tokenizer = load_tool_model(args.threads, args.model)
    for seed in seeds:
        layers = record_prefill(model, torch.tensor([prompt_ids(args, tokenizer, seed)]), args.queries)
        for layer, (queries, keys, scaling) in sorted(layers.items()):
            if layer >= args.skip_layers:
                yield layer, queries, keys, scaling
        print(f"seed {seed}: {len(layers)} full-attention layers recorded", flush=True)


def prompt_ids(args: argparse.Namespace, tokenizer, seed: int) -> list[int]:
    """The token ids of prompt `seed`: a word needle of `--tokens` tokens in the model's chat format, or with
    `--ruler-task` that task's RULER sample `seed` at length `--tokens` (as `dual-decoder eval run --suites ruler`
    builds it with the default `--chat-template auto` and `--seed 0`)."""
    if args.ruler_task is None:
        return format_chat(tokenizer, make_needle_prompt(tokenizer, args.tokens, seed=seed).text)
    from ..quality.chat_format import prompt_format
    from ..quality.ruler import generate_sample

    return list(generate_sample(tokenizer, args.ruler_task, args.tokens, seed, prompt_format(tokenizer))["input_ids"])


def recall_summary(recall: torch.Tensor) -> dict:
    """`{"mean", "p10", "min", "samples"}` of a float tensor of recalls (fractions of the exact top-k mass)."""
    return {"mean": recall.mean().item(), "p10": recall.quantile(0.1).item(), "min": recall.min().item(),
            "samples": recall.numel()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dual-decoder recall", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    add_recording_arguments(parser)
    parser.add_argument("--configs", nargs="+", default=["lowbit", "quest:{\"block_size\": 16}"],
                        help="selector[:JSON options] per configuration")
    args = parser.parse_args(argv)
    try:
        seeds = check_recording_arguments(args)
        configs = [parse_config(text) for text in args.configs]
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    n_sink, window = 4, 64
    results: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    by_layer: dict[int, dict[int, list[torch.Tensor]]] = {i: {} for i in range(len(configs))}
    for layer, queries, keys, scaling in recorded_layers(args, seeds):
        for index, value in layer_recalls(queries, keys, scaling, args.budget, configs, n_sink, window).items():
            results[index].append(value)
            by_layer[index].setdefault(layer, []).append(value["recall"])
    rows = []
    for index, (name, options) in enumerate(configs):
        parts = results[index]
        recall = torch.cat([p["recall"] for p in parts])
        rows.append({
            "selector": name, "options": options, **recall_summary(recall),
            "topk_share": torch.cat([p["share"] for p in parts]).mean().item(),
            "keys_read": sum(p["read"] for p in parts) / sum(p["exact_read"] for p in parts),
            "index_fraction": sum(p["index_bytes"] for p in parts) / sum(p["kv_bytes"] for p in parts),
            "build_ms_per_1k_tokens": 1e3 * sum(p["build_s"] for p in parts) / len(parts) / (args.tokens / 1000),
            "select_ms": 1e3 * sum(p["select_s"] for p in parts) / len(parts),
            "scan_share": sum(p["scanned"] for p in parts) / sum(p["tasks"] for p in parts),
            "per_layer": {layer: recall_summary(torch.cat(values)) for layer, values in
            sorted(by_layer[index].items())},
        })
    label = model_display_name(args.model)
    prompts = f"RULER {args.ruler_task} samples" if args.ruler_task else "word-needle prompts"
    share = (f" The exact top-{args.budget} holds {rows[0]['topk_share']:.1%} of the candidates' attention mass."
             if rows else "")
    lines = [f"Recall of the exact top-{args.budget} attention mass per selector; {label}, {prompts} of "
             f"{args.tokens} tokens, seeds {args.seeds}, the last {args.queries} prompt positions' queries, "
             f"full-attention layers {args.skip_layers}+ × KV heads.{share} Timings: this CPU, thread time, one run.",
             "",
             "| selector | options | mean | p10 | min | selections that scan | key bytes read vs exact (a scan's) | "
             "index / KV | build ms per 1K tokens·layer | select ms per layer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['selector']} | {json.dumps(r['options']) if r['options'] else 'default'} | {r['mean']:.4f} | "
              f"{r['p10']:.4f} | {r['min']:.4f} | {r['scan_share']:.0%} | {r['keys_read']:.1%} | "
              f"{r['index_fraction']:.1%} | {r['build_ms_per_1k_tokens']:.3g} | {r['select_ms']:.3g} |"
              for r in rows]
    layers = sorted(rows[0]["per_layer"]) if rows else []
    lines += ["", "Per layer (mean / p10):", "",
              "| selector | options | " + " | ".join(f"layer {layer}" for layer in layers) + " |",
              "|---|---|" + "---|" * len(layers)]
    lines += [f"| {r['selector']} | {json.dumps(r['options']) if r['options'] else 'default'} | " + " | ".join(
              f"{r['per_layer'][layer]['mean']:.3f} / {r['per_layer'][layer]['p10']:.3f}" for layer in layers) + " |"
              for r in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    paths = write_rows_and_table(args.out or default_out("recall"), rows, table)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
