"""How much of the exact top-k attention mass the two-stage `"shortlist"` selection keeps, on the embedded model.

    python -m dual_cache.eval.selection_recall --tokens 8192 --seeds 0-3 --budget 256 \
        --channels 4 8 16 --factors 2 4 8 --out results/needle/selection-recall-8k

For each word-needle prompt (`needle.make_needle_prompt`), one dense prefill records every layer's keys (after RoPE)
and the last prompt position's queries — the query that selects the first decode step's entries. Per layer and KV
head, the exact criterion is the softmax attention mass summed over the GQA group over every candidate (positions
past the sink and before the local window); `recall` is the mass of the `budget` entries the shortlist selection
picks divided by the mass of the exact top-`budget` (1.0 = the exact selection). Reported per (channels, factor):
mean, 10th percentile and minimum over layers ≥ `--skip-layers` (the early layers use a larger budget) and heads,
and the share of key bytes the host reads (the channels of every key + the shortlisted keys) relative to exact
scoring.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..host_store import HostKVStore
from ..models import model_display_name
from ..retrieval import group_attention_mass
from ..shortlist import select_shortlisted
from .needle import format_chat, make_needle_prompt
from .needle_sweep import load_tool_model, parse_seeds, threads_arg
from .outputs import write_rows_and_table

RECORDER = "dual_recall_recorder"
_recording: dict[int, tuple[torch.Tensor, torch.Tensor, float]] | None = None  # layer -> what `_recorder` saw


def _recorder(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA attention that keeps the last position's query and every key of each layer in `_recording`."""
    if _recording is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        _recording[module.layer_idx] = (query[:, :, -1].float().cpu(), key.float().cpu(), scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def record_prefill(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """One dense forward over `ids` `(1, n)`; per layer `(query (1, H_q, D), keys (1, H_kv, n, D), scaling)` of the
    last position, float32 on the host."""
    global _recording
    AttentionInterface.register(RECORDER, _recorder)
    previous = model.config._attn_implementation
    _recording = {}
    model.set_attn_implementation(RECORDER)
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
        return [_recording[i] for i in sorted(_recording)]
    finally:
        model.set_attn_implementation(previous)
        _recording = None


def layer_recalls(query, keys, scaling, budget, configs, n_sink, window) -> dict[tuple[int, int], torch.Tensor]:
    """Recall of the shortlist selection against the exact top-`budget` for one layer.

    Args:
        query: `(1, H_q, D)` float32; keys: `(1, H_kv, n, D)` float32 (from `record_prefill`); scaling: softmax scale.
        budget: entries per KV head (tokens); configs: `(channels, factor)` pairs to evaluate.
        n_sink, window: positions `< n_sink` and `>= n - window` are not candidates (tokens).

    Returns:
        `{(channels, factor): (H_kv,) float32 recall}`, each in `(0, 1]` up to rounding.
    """
    n = keys.shape[2]
    hi = n - window
    store = HostKVStore(1, keys.shape[1], keys.shape[3], torch.float32, chunk_tokens=4096, channel_major=True)
    store.append(keys, keys)
    candidates = torch.arange(hi)[None, :] >= n_sink
    mass = group_attention_mass(query, store.key_chunks(hi), candidates, scaling)  # (1, H_kv, hi)
    best = torch.topk(mass, budget, dim=-1).values.sum(-1)
    out = {}
    for channels, factor in configs:
        indices, valid = select_shortlisted(query, store, candidates, hi, budget, channels, factor * budget, scaling)
        out[channels, factor] = ((torch.gather(mass, 2, indices) * valid).sum(-1) / best)[0]
    store.free()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length (tokens)")
    parser.add_argument("--seeds", default="0-3", help="needle prompts, e.g. 0-3 or 0,5")
    parser.add_argument("--budget", type=int, default=256, help="tokens per KV head")
    parser.add_argument("--channels", type=int, nargs="+", default=[4, 8, 16], help="query channels per KV head")
    parser.add_argument("--factors", type=int, nargs="+", default=[2, 4, 8], help="shortlist factors")
    parser.add_argument("--skip-layers", type=int, default=2, help="leave out the first layers (larger budget)")
    parser.add_argument("--threads", type=threads_arg, default=None, help="torch intra-op threads")
    parser.add_argument("--model", default=None, help="named model (gemma3-270m), folder or .gguf (default: embedded)")
    parser.add_argument("--out", default=None, help="output path without extension (writes .json and .md)")
    args = parser.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        if args.tokens < 4 * args.budget or min(args.channels + args.factors) < 1 or args.budget < 1:
            raise ValueError("--tokens must be >= 4 × --budget, and --budget, --channels, --factors >= 1.")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model, tokenizer = load_tool_model(args.threads, args.model)
    n_sink, window = 4, 64
    values: dict[tuple[int, int], list[torch.Tensor]] = {}
    for seed in seeds:
        prompt = make_needle_prompt(tokenizer, args.tokens, seed=seed)
        layers = record_prefill(model, torch.tensor([format_chat(tokenizer, prompt.text)]))
        configs = [(channels, factor) for channels in args.channels for factor in args.factors]
        for query, keys, scaling in layers[args.skip_layers:]:
            for config, value in layer_recalls(query, keys, scaling, args.budget, configs, n_sink, window).items():
                values.setdefault(config, []).append(value)
        print(f"seed {seed}: {len(layers)} layers recorded", flush=True)
    n = args.tokens
    rows = []
    dim = layers[0][1].shape[-1]
    for (channels, factor), parts in values.items():
        r = torch.cat(parts)
        keep = factor * args.budget
        read = min(channels, dim) / dim + keep / n if keep < n - window else 1.0  # else: the exact selection
        rows.append({"channels": channels, "head_dim": dim, "factor": factor, "mean": r.mean().item(),
                     "p10": r.quantile(0.1).item(), "min": r.min().item(), "keys_read": read, "samples": r.numel()})
    name = model_display_name(args.model)
    lines = [f"Recall of the exact top-{args.budget} attention mass by the shortlist selection; {name},"
             f" word-needle prompts of {args.tokens} tokens, seeds {args.seeds}, last prompt position's queries, "
             f"layers {args.skip_layers}+ × KV heads.", "",
             "| channels | factor | mean | p10 | min | key bytes read vs exact |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['channels']} of {r['head_dim']} | {r['factor']} | {r['mean']:.4f} | {r['p10']:.4f} | {r['min']:.4f} | "
              f"{r['keys_read']:.1%} |" for r in rows]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_rows_and_table(args.out, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
