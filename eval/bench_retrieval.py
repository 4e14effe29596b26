"""Host retrieval cost per decode step: exact top-k over every host key vs the two-stage `"shortlist"` selector.

    python -m dual_cache.eval.bench_retrieval --contexts 32768 131072 --batches 1 4 --threads 2 \
        --out results/bench/host-retrieval

On an H200 the dual cache decoded a Llama-3.1-8B-shaped model at 32K tokens at 2 tokens/s because the host scored
every key of every layer each step (results/gpu/h200-32k.md). This measures that host work alone, on this machine's
CPU, for one layer of a given shape (default: Llama-3.1-8B, 32 query / 8 KV heads of 128, bf16, 32 layers), and
scales it to a step (× layers, as the retriever thread runs the layers one after the other):

- `exact`: `retrieval.select` over the layer's host keys, then the gather of the chosen K/V (what a job does);
- `shortlist`: `shortlist.select_shortlisted` (approximate scores over `--channels` key channels → `--factor` ×
  budget positions → exact top-k among them), then the same gather. Each repeat advances the context by one token,
  so the channel-major key copy is extended as in decoding (the one-time copy of the prompt is excluded: it
  happens once per request, not per step).

Keys are random (timings do not depend on their values). Prints a table (ms per layer, median over `--repeats`;
ms per step; key bytes read per step; ratio exact/shortlist) and writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..config import DualDecoderConfig
from ..host_store import HostKVStore
from ..retrieval import select
from ..shortlist import select_shortlisted
from .outputs import write_rows_and_table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _layer(batch: int, kv_heads: int, dim: int, tokens: int, dtype: torch.dtype, seed: int) -> HostKVStore:
    store = HostKVStore(batch, kv_heads, dim, dtype, chunk_tokens=4096, channel_major=True)
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, tokens, 4096):
        block = torch.randn(batch, kv_heads, min(4096, tokens - lo), dim, generator=gen).to(dtype)
        store.append(block, block)
    return store


def measure(context: int, batch: int, selector: str, args: argparse.Namespace) -> dict:
    """One cell: the median seconds of one layer's retrieval job at `context` tokens, and what it reads."""
    dtype = DTYPES[args.dtype]
    store = _layer(batch, args.kv_heads, args.head_dim, context + args.repeats + 1, dtype, seed=context + batch)
    channels = DualDecoderConfig(shortlist_channels=args.channels).shortlist_channels_for(args.head_dim)
    channels, keep = min(channels, args.head_dim), args.factor * args.budget
    two_stage = selector == "shortlist" and keep < context - args.window  # else the shortlist is the exact path
    query = torch.randn(batch, args.heads, args.head_dim, generator=torch.Generator().manual_seed(batch))
    staging = [torch.empty(batch, args.kv_heads, args.budget, args.head_dim, dtype=dtype) for _ in range(2)]
    scaling = args.head_dim ** -0.5
    element = torch.empty((), dtype=dtype).element_size()
    if selector == "shortlist":  # the prompt's channel-major copy: made once per request
        store.channel_products(torch.zeros(batch, args.kv_heads, 1, 1, dtype=dtype),
                               torch.zeros(batch, args.kv_heads, 1, dtype=torch.long), context - args.window)
    times = []
    for step in range(args.repeats + 1):
        hi = context + step - args.window
        candidates = torch.arange(hi)[None, :].expand(batch, hi) >= args.sink
        start = time.perf_counter()
        if selector == "exact":
            indices, _ = select(query, store.key_chunks(hi), candidates, args.budget, scaling)
        else:
            indices, _ = select_shortlisted(query, store, candidates, hi, args.budget, channels, keep, scaling)
        store.gather(indices, out=staging)
        if step:  # the first repeat warms up
            times.append(time.perf_counter() - start)
    per_layer = statistics.median(times)
    row_keys = args.kv_heads * args.head_dim * element  # bytes of one position's keys, all KV heads
    if two_stage:  # r of D channels of every key, then the shortlisted keys whole
        read = batch * (context * channels / args.head_dim + keep) * row_keys
    else:
        read = batch * context * row_keys
    return {
        "context": context, "batch": batch, "selector": selector, "two_stage": two_stage,
        "ms_per_layer": per_layer * 1e3,
        "ms_per_step": per_layer * 1e3 * args.layers, "key_mib_read_per_step": read * args.layers / 2**20,
        "host_gib_per_s": read / per_layer / 2**30, "budget": args.budget, "channels": channels,
        "factor": args.factor, "dtype": args.dtype, "threads": torch.get_num_threads(),
    }


def _num(value: float) -> str:
    """Three significant digits below 100, whole numbers with thousands separators above."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """The table, with exact/shortlist time ratios per (context, batch)."""
    lines = [
        f"Host retrieval per decode step, one retriever thread using {rows[0]['threads']} torch threads; shape "
        f"{args.heads} query / {args.kv_heads} KV heads × {args.head_dim}, {args.layers} layers, {args.dtype}, "
        f"budget {args.budget}; shortlist: {rows[-1]['channels']} channels, factor {args.factor}.", "",
        "| context | batch | selector | ms/layer | ms/step | key MiB read/step | GiB/s | exact / this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    exact = {(r["context"], r["batch"]): r["ms_per_step"] for r in rows if r["selector"] == "exact"}
    for r in rows:
        base = exact.get((r["context"], r["batch"]))
        ratio = f"{base / r['ms_per_step']:.1f}×" if base else "—"
        name = r["selector"] + ("" if r["two_stage"] or r["selector"] == "exact" else " †")
        lines.append(
            f"| {r['context']} | {r['batch']} | {name} | {_num(r['ms_per_layer'])} | {_num(r['ms_per_step'])} | "
            f"{_num(r['key_mib_read_per_step'])} | {_num(r['host_gib_per_s'])} | {ratio} |"
        )
    if not all(r["two_stage"] for r in rows if r["selector"] == "shortlist"):
        lines += ["", "† factor × budget covers every position: the shortlist selector runs the exact selection."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--selectors", nargs="+", default=["exact", "shortlist"], choices=["exact", "shortlist"])
    parser.add_argument("--budget", type=int, default=256, help="tokens per KV head")
    parser.add_argument("--channels", type=int, default=None, help="shortlist channels (default head_dim / 8)")
    parser.add_argument("--factor", type=int, default=8, help="shortlist factor")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32, help="layers per step (scales ms/layer to ms/step)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats per cell (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", default=None, help="output path without extension (writes .json and .md)")
    args = parser.parse_args(argv)
    problems = [f"--{name.replace('_', '-')} must be >= 1" for name in
                ("budget", "factor", "heads", "kv_heads", "head_dim", "layers", "repeats")
                if getattr(args, name) < 1]
    if args.channels is not None and args.channels < 1:
        problems.append("--channels must be >= 1")
    if args.sink < 0 or args.window < 1:
        problems.append("--sink must be >= 0 and --window >= 1")
    if args.kv_heads >= 1 and args.heads % args.kv_heads:
        problems.append("--heads must be a multiple of --kv-heads")
    if min(args.batches) < 1 or min(args.contexts) <= args.window + args.sink + args.budget:
        problems.append("--batches must be >= 1 and every --contexts value > window + sink + budget")
    if args.threads is not None and args.threads < 1:
        problems.append("--threads must be >= 1")
    if problems:
        print("error: " + "; ".join(problems) + ".", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            for selector in args.selectors:
                rows.append(measure(context, batch, selector, args))
                print(json.dumps(rows[-1]), flush=True)
    table = markdown(rows, args)
    print(table)
    if args.out:
        write_rows_and_table(args.out, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
