"""Where one layer's host selection spends its time, part by part, against the bytes each part reads.

    python -m dual_cache.eval.selection.profile_selection --contexts 32768 131072 --batches 1 8 \
        --threads 1 2 --out results/bench/selection-profile

Per cell (context, batch, engine threads): `--layers` layers' host stores of random keys (default shape:
Llama-3.1-8B, 32 query / 8 KV heads × 128, bf16), each with its `lowbit` selector (the index built over the
prompt). A timed call is one layer's `select_into` (the selection and the gather of the chosen K/V into a staging
buffer, as a retrieval job runs it), with `--flush-mib` MiB written between calls so that the layer's index and keys
come from memory, as in a decode step that runs every other layer in between. The engine times its phases per
(sequence, KV head) (`dual_cache.engine.profiling`): the scan's setup (channel choice), the sampled groups that set
each head's normalizer, the main scan, the shortlist (top-m of the scan's scores), the exact stage's reads of the
shortlisted keys (with their logits), its softmax and top-k, and the gather (CPU time of the thread that ran each
part, summed over the call's tasks); the Python side is the call's wall time minus the engine's (the profile adds a
ctypes buffer to it, about a microsecond). Each part's bytes: the chosen quads' codes and every group's parameters (scan), the
shortlisted and uncovered keys whole (exact reads), the chosen keys and values (gather). The `exact` selector's one
call is profiled beside it (`--selectors`). Writes `<out>.json` (every cell's medians) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...engine import native, profiling
from ...engine.codes import GROUP
from ...selection.candidates import Candidates
from ...selection.selectors import SELECTORS
from ..options import add_shape_options
from ..outputs import default_out, write_rows_and_table
from ..spread import load_average, load_warning
from .bench_retrieval import _store, host_read_gbps

PARTS = ("scan", "shortlist", "exact_reads", "exact_topk", "gather")
PART_PHASES = {"scan": ("scan_setup", "scan_sample", "scan_main"), "shortlist": ("shortlist",),
               "exact_reads": ("exact_reads",), "exact_topk": ("exact_topk",), "gather": ("gather",)}


def part_bytes(selector, context: int, batch: int, window: int, budget: int) -> dict[str, int]:
    """Bytes each part of one call choosing `budget` entries reads for `batch` sequences: the chosen quads' codes and
    every parameter of each complete group (scan), the shortlisted and uncovered keys whole (exact reads; every key for
    `exact`), the chosen keys and values (gather). The scan's and exact reads' sum is `key_bytes_read`."""
    store = selector.store
    kv_heads, dim, element = store.shape_prefix[1], store.head_dim, store.element_size
    end = context - window
    row = kv_heads * dim * element
    scan, exact_rows = 0, end
    groups = end // GROUP
    if selector.name == "lowbit" and selector.shortlist_for(budget) < groups * GROUP:
        scan = kv_heads * groups * (selector.quads * 64 + selector.dim_q * 4)
        exact_rows = selector.shortlist_for(budget) + end - groups * GROUP
    assert scan + exact_rows * row == sum(selector.key_bytes_read(end, budget))
    return {"scan": batch * scan, "shortlist": 0, "exact_reads": batch * exact_rows * row, "exact_topk": 0,
            "gather": batch * 2 * budget * row}


def measure(context: int, batch: int, threads: int, args: argparse.Namespace) -> list[dict]:
    """One row per selector: medians over `args.repeats` calls per layer after one warm-up round."""
    dtype = torch.bfloat16
    per_layer = 2 * batch * args.kv_heads * context * args.head_dim * 2
    layers = max(1, min(args.layers, args.memory_mib * 2**20 // per_layer))
    stores = [_store(batch, args.kv_heads, args.head_dim, context, context + 1, dtype, seed=context + layer)
              for layer in range(layers)]
    first_real = torch.zeros(batch, dtype=torch.long)
    end = context - args.window
    candidates = Candidates(torch.arange(end)[None, :].expand(batch, end) >= args.sink, first_real)
    query = torch.randn(batch, args.heads, args.head_dim, generator=torch.Generator().manual_seed(batch))
    scaling = args.head_dim ** -0.5
    flush = torch.zeros(args.flush_mib * 2**20 // 4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for name in args.selectors:
            selectors = [SELECTORS[name](DualDecoderConfig(selector=name), store, "cpu")
                         for store in stores]
            for selector in selectors:
                selector.extend(context, first_real)
            staging = [torch.empty(batch, args.kv_heads, args.budget, args.head_dim, dtype=dtype) for _ in range(2)]
            calls, walls = [], []
            for round_ in range(args.repeats + 1):
                for selector in selectors:
                    flush.add_(1.0)
                    with profiling.recording() as recorded:
                        start = time.perf_counter_ns()
                        selector.select_into(query, candidates, scaling, args.budget, staging)
                        wall = time.perf_counter_ns() - start
                    if round_:
                        calls.append(recorded[0])
                        walls.append(wall)
            rows.append(_row(name, selectors[0], context, batch, threads, layers, calls, walls, args))
            for selector in selectors:
                selector.free()
    finally:
        torch.set_num_threads(previous)
        for store in stores:
            store.free()
    return rows


def _row(name, selector, context, batch, threads, layers, calls, walls, args) -> dict:
    phase_ms = {phase: statistics.median(float(call.phase_ns[:, i].sum()) for call in calls) / 1e6
                for i, phase in enumerate(profiling.PHASES)}
    wall_ms = statistics.median(walls) / 1e6
    engine_ms = statistics.median(call.wall_ns for call in calls) / 1e6
    python_ms = statistics.median(w - call.wall_ns for w, call in zip(walls, calls)) / 1e6
    workers = calls[0].workers
    nbytes = part_bytes(selector, context, batch, args.window, args.budget)
    parts = {}
    for part, phases in PART_PHASES.items():
        thread_ms = sum(phase_ms[p] for p in phases)
        parts[part] = {"thread_ms": thread_ms, "bytes": nbytes[part],
                       "gbps_per_thread": nbytes[part] / (thread_ms * 1e6) if thread_ms > 0 and nbytes[part] else None}
    parts["scan"]["phases_ms"] = {p: phase_ms[p] for p in PART_PHASES["scan"]}
    read = sum(v["bytes"] for k, v in parts.items() if k != "gather")
    return {
        "context": context, "batch": batch, "selector": name, "threads": threads, "workers": workers,
        "distinct_layers": layers, "calls": len(calls), "wall_ms": wall_ms, "engine_ms": engine_ms,
        "python_ms": python_ms, "parts": parts, "key_bytes_read": read, "effective_gbps": read / (wall_ms * 1e6),
        "host_read_gbps": args.bandwidth[threads], "engine": native.active_variant(),
    }


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"One layer's host selection, part by part (shape {args.heads} query / {args.kv_heads} KV heads × "
        f"{args.head_dim}, bf16, budget {args.budget}, selector defaults; {args.flush_mib} MiB written between calls "
        f"so each call reads from memory). Medians over {rows[0]['calls']} calls. A part's ms: thread time summed "
        "over the call's (sequence, KV head) tasks (divide by `workers` for its share of the wall); its GB/s: its "
        "bytes per thread-second, beside the host's read bandwidth on that many threads.", "",
        "| context | batch | selector | threads (workers) | call ms | engine ms | Python ms | scan ms (setup / sample / "
        "main) | shortlist ms | exact reads ms | exact top-k ms | gather ms | scan GB/s·thread | exact reads "
        "GB/s·thread | key MiB read | GB/s (host GB/s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["parts"]
        ph = p["scan"]["phases_ms"]
        rate = lambda part: "—" if p[part]["gbps_per_thread"] is None else f"{p[part]['gbps_per_thread']:.1f}"
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['selector']} | {r['threads']} ({r['workers']}) | {r['wall_ms']:.3g} | "
            f"{r['engine_ms']:.3g} | {r['python_ms']:.3g} | {p['scan']['thread_ms']:.3g} ({ph['scan_setup']:.2g} / "
            f"{ph['scan_sample']:.2g} / {ph['scan_main']:.3g}) | {p['shortlist']['thread_ms']:.3g} | "
            f"{p['exact_reads']['thread_ms']:.3g} | {p['exact_topk']['thread_ms']:.3g} | {p['gather']['thread_ms']:.3g} | "
            f"{rate('scan')} | {rate('exact_reads')} | {r['key_bytes_read'] / 2**20:.3g} | "
            f"{r['effective_gbps']:.1f} ({r['host_read_gbps']:.1f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.selection.profile_selection",
                                     description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072], help="tokens per sequence")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="sequences per call")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="engine threads per call")
    parser.add_argument("--selectors", nargs="+", default=["lowbit", "exact"], choices=["lowbit", "exact"])
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget, help="tokens per KV head")
    add_shape_options(parser)
    parser.add_argument("--layers", type=int, default=4, help="distinct layers called in turn (fewer when their K/V "
                                                                 "would pass --memory-mib)")
    parser.add_argument("--memory-mib", type=int, default=4096, help="host memory for the layers' K/V")
    parser.add_argument("--flush-mib", type=int, default=64, help="MiB written between calls (0: none)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds over the layers (after one warm-up)")
    parser.add_argument("--sink", type=int, default=DualDecoderConfig.n_sink, help="sink tokens")
    parser.add_argument("--window", type=int, default=DualDecoderConfig.window, help="local window")
    parser.add_argument("--out", default=None, help="output path without extension (.json and .md)")
    args = parser.parse_args(argv)
    if min(args.contexts) <= args.window + args.sink + args.budget or min(args.batches) < 1 or \
            min(args.threads) < 1 or args.heads % args.kv_heads or args.repeats < 1 or args.flush_mib < 0:
        print("error: every --contexts value must exceed window + sink + budget; --batches, --threads and --repeats "
              "must be >= 1; --heads a multiple of --kv-heads; --flush-mib >= 0.", file=sys.stderr)
        return 2
    args.bandwidth = {threads: host_read_gbps(threads) for threads in args.threads}
    rows, highest = [], load_average()
    for context in args.contexts:
        for batch in args.batches:
            for threads in args.threads:
                for row in measure(context, batch, threads, args):
                    rows.append(row)
                    print(row, flush=True)
                highest = max(highest, load_average())
    table = markdown(rows, args)
    warning = load_warning(highest)
    table = (warning + "\n\n" if warning else "") + table
    print(table)
    print("wrote " + ", ".join(write_rows_and_table(args.out or default_out("profile-selection"), rows, table)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
