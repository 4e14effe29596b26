"""Host retrieval cost per decode step, selector by selector, on random keys of a given model shape.

    python -m dual_cache.eval.selection.bench_retrieval --contexts 32768 131072 --batches 1 8 \
        --selectors exact lowbit --threads 1 2 --out results/bench/host-retrieval

On an H200 the dual cache decoded a Llama-3.1-8B-shaped model at 32K tokens at 2 tokens/s because the host scored
every key of every layer each step (results/gpu/h200-32k.md). This measures that host work alone on this machine's
CPU: per cell, `--distinct-layers` layers' host stores of `context` random keys (default shape: Llama-3.1-8B, 32
query / 8 KV heads of 128, bf16), each with its own selector (`dual_cache.selection.selectors`). A timed step appends
one token to every store, then runs every layer's retrieval job — the selector's choice for a random query among the
positions past the sink and before the local window, then the gather of the chosen K/V into a staging buffer — on a
pool of `--pools` threads (1: one thread at torch's intra-op thread count; N > 1: N threads of one intra-op thread each, as
`TransferSchedule` runs them); `--threads` lists the engine threads per call at pool 1 (a cell each: the thread
scaling). With `--shared-prefix`, the batch continues one stored sequence of `context` tokens
(`HostKVStore.share`): exact selection scores every query against the shared keys in one product; lowbit scans
each sequence's copy of the prefix's index. Distinct layers keep each selector's index out of the CPU caches as in
decoding (fewer than `--distinct-layers` where their K/V would pass `--memory-gib`, e.g. 128K tokens at batch 8);
the step time is scaled to `--layers` layers.

The selectors of a cell run side by side over the same stores, each step in a rotated order (a change in the host's
load reaches them alike). Per row: `ms_per_step` (median over `--repeats` steps, after one warm-up), `ms_per_layer`,
`core_ms_per_sequence_step` (host CPU milliseconds of a step's selection per sequence, every engine thread counted,
`engine.profiling.cpu_seconds`: with N cores the host serves at most N / this sequence-steps per second),
`key_mib_read_per_step` (key bytes a step reads: every key for `exact`; the scanned channels' codes, every group
parameter, then the shortlisted keys and the uncovered tail whole for `lowbit`), `index_host_bytes` (per layer,
beyond the K/V) and `index_fraction` (of the layer's K/V bytes), `build_ms_per_1k_tokens` (building the index over
the prompt, per layer, per sequence), `effective_gbps` (key bytes read per second of selection), `host_read_gbps`
(this host's read bandwidth at the same thread count, measured in the same run by a large reduction), `host_share`
(`effective_gbps / host_read_gbps`: how close the selection comes to the host's bandwidth), `engine` (the native
engine variant, or `torch` for `torch-exact`), and `exact / this` from the same run. Timings do not depend on
key values; quality is measured on real keys by `dual_cache.eval.selection.selection_recall`. Writes `<out>.json` and
`<out>.md`, rewritten after every cell.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...engine import native, profiling
from ...host.pages import advise_huge_pages
from ...host.store import HostKVStore
from ...selection.candidates import Candidates
from ...selection.selectors import SELECTORS
from ..options import add_shape_options
from ..outputs import default_out, write_rows_and_table
from ..spread import load_average, load_warning
from .torch_exact import select as torch_select

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PREFETCHED = [name for name, cls in SELECTORS.items() if cls.prefetched]
TORCH_EXACT = "torch-exact"  # exact selection in torch ops (bf16 products, torch.topk): the path before the engine


def host_read_gbps(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """This host's read bandwidth (GB/s): the best of `repeats` sums of a `mib` MiB float32 tensor on `threads`
    torch threads (a large reduction streams memory at close to the machine's read speed)."""
    data = torch.empty(mib * 2**20 // 4)
    advise_huge_pages(data)
    data.fill_(1.0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)
    return data.nbytes / best / 1e9


def _store(batch: int, kv_heads: int, dim: int, tokens: int, capacity: int, dtype: torch.dtype,
           seed: int) -> HostKVStore:
    store = HostKVStore(batch, kv_heads, dim, dtype, chunk_tokens=4096)
    store.reserve(capacity)
    gen = torch.Generator().manual_seed(seed)
    for lo in range(0, tokens, 4096):
        block = torch.randn(batch, kv_heads, min(4096, tokens - lo), dim, generator=gen).to(dtype)
        store.append(block, block)
    return store


def selector_config(spec: str, options: dict) -> DualDecoderConfig:
    """The config of a `--selectors` entry: a selector's name, `NAME:JSON` (its own options over `--options`), or
    `torch-exact`. Raises `ValueError` naming the entry."""
    name, _, own = spec.partition(":")
    if name not in [*PREFETCHED, TORCH_EXACT]:
        raise ValueError(f"--selectors {spec!r}: choose from {[*PREFETCHED, TORCH_EXACT]}, optionally as NAME:JSON")
    try:
        own = json.loads(own) if own else {}
        if not isinstance(own, dict) or "selector" in own:
            raise ValueError("its options must be a JSON object of DualDecoderConfig fields other than selector")
        return DualDecoderConfig.from_dict({**options, **own, "selector": "exact" if name == TORCH_EXACT else name})
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise ValueError(f"--selectors {spec!r}: {error}") from None


def distinct_layers(context: int, batch: int, args: argparse.Namespace) -> int:
    """`--distinct-layers`, fewer where their K/V would pass `--memory-gib` (at least 1)."""
    stored = 1 if args.shared_prefix else batch
    per_layer = 2 * stored * args.kv_heads * (context + args.repeats + 1) * args.head_dim * DTYPES[args.dtype].itemsize
    return max(1, min(args.distinct_layers, int(args.memory_gib * 2**30 // per_layer)))


def measure(context: int, batch: int, selector_names: list[str], pool: int, args: argparse.Namespace,
            threads: int | None = None) -> list[dict]:
    """One cell per selector, timed side by side: every step runs each selector's jobs over the same stores, in an
    order that rotates from step to step, so that a change in the host's load reaches every selector alike. A
    row's `ms_per_step` is the median over the steps of its wall seconds for its distinct layers, scaled to
    `args.layers`. `threads`: the engine (and torch) threads of each call at pool 1 (None: torch's count)."""
    dtype = DTYPES[args.dtype]
    steps = args.repeats + 1
    stored = 1 if args.shared_prefix else batch  # a shared prefix: one sequence's keys, continued by the batch
    stores = [_store(stored, args.kv_heads, args.head_dim, context, context + steps, dtype, seed=context + layer)
              for layer in range(distinct_layers(context, batch, args))]
    selectors, build = {}, {}
    for name in selector_names:
        config = selector_config(name, args.options)
        selectors[name] = [SELECTORS[config.selector](config, store, "cpu", phase=layer)
                           for layer, store in enumerate(stores)]
        start = time.perf_counter()
        for selector in selectors[name]:
            selector.extend(context, torch.zeros(stored, dtype=torch.long))
        build[name] = time.perf_counter() - start
    if args.shared_prefix:
        for store in stores:
            store.share(batch)
        for name in selector_names:
            for selector in selectors[name]:
                selector.share()
    first_real = torch.zeros(batch, dtype=torch.long)
    query = torch.randn(batch, args.heads, args.head_dim, generator=torch.Generator().manual_seed(batch))
    staging = [[torch.empty(batch, args.kv_heads, args.budget, args.head_dim, dtype=dtype) for _ in range(2)]
               for _ in stores]
    scaling = args.head_dim ** -0.5
    extra = torch.randn(batch, args.kv_heads, 1, args.head_dim).to(dtype)

    def select(name: str, layer: int, candidates: Candidates) -> None:
        if name.partition(":")[0] == TORCH_EXACT:
            keys = stores[layer].key_chunks(candidates.end)
            indices, _ = torch_select(query, keys, candidates.mask, args.budget, scaling)
            stores[layer].gather(indices, out=staging[layer])
        else:  # selection and the gather of the chosen K/V (one engine call for the engine's selectors)
            selectors[name][layer].select_into(query, candidates, scaling, args.budget, staging[layer])

    def job(name: str, layer: int, candidates: Candidates) -> float:
        """One layer's job; returns its host CPU seconds (`profiling.cpu_seconds`)."""
        return profiling.cpu_seconds(select, name, layer, candidates)[1]

    per_call = 1 if pool > 1 else threads or torch.get_num_threads()
    executor = ThreadPoolExecutor(max_workers=pool, initializer=torch.set_num_threads, initargs=(per_call,))
    times = {name: [] for name in selector_names}
    cpu = {name: [] for name in selector_names}
    try:
        for step in range(steps):
            for store in stores:
                store.append(extra, extra)
            hi = context + step + 1 - args.window
            candidates = Candidates(torch.arange(hi)[None, :].expand(batch, hi) >= args.sink, first_real)
            shift = step % len(selector_names)
            for name in selector_names[shift:] + selector_names[:shift]:
                start = time.perf_counter()
                seconds = sum(future.result() for future in
                              [executor.submit(job, name, layer, candidates) for layer in range(len(stores))])
                if step:  # the first step warms up
                    times[name].append(time.perf_counter() - start)
                    cpu[name].append(seconds)
    finally:
        executor.shutdown()
    rows = []
    for name in selector_names:
        scale = args.layers / len(stores)
        per_step = statistics.median(times[name]) * scale
        scanned, gathered = selectors[name][0].key_bytes_read(context - args.window, args.budget)
        read = stored * scanned + batch * gathered  # a shared prefix is scanned once for the whole batch
        index_bytes = selectors[name][0].host_bytes
        scans = [getattr(selector, "tasks_scanned", None) for selector in selectors[name]]
        pooled = sum(getattr(selector, "tasks_pooled", 0) for selector in selectors[name])
        scan_share = 1.0 if None in scans else sum(scans) / max(1, sum(scans) + pooled)
        effective = read / (per_step / args.layers) / 1e9
        host = args.bandwidth[pool if pool > 1 else per_call]
        rows.append({
            "context": context, "batch": batch, "selector": name, "pool": pool, "torch_threads": per_call,
            "distinct_layers": len(stores),
            "ms_per_step": per_step * 1e3, "ms_per_layer": per_step * 1e3 / args.layers,
            "core_ms_per_sequence_step": statistics.median(cpu[name]) * scale * 1e3 / batch,
            "ms_per_step_min": min(times[name]) * scale * 1e3, "ms_per_step_max": max(times[name]) * scale * 1e3,
            "repeats": len(times[name]),
            "key_mib_read_per_step": read * args.layers / 2**20,
            "index_host_bytes": index_bytes, "index_fraction": index_bytes / stores[0].nbytes,
            "build_ms_per_1k_tokens": build[name] * 1e3 / len(stores) / stored / (context / 1000),
            "effective_gbps": effective, "host_read_gbps": host, "host_share": effective / host,
            "scan_share": scan_share,
            "engine": "torch" if name.partition(":")[0] == TORCH_EXACT else native.active_variant(),
            "budget": args.budget, "dtype": args.dtype, "options": args.options, "shared_prefix": args.shared_prefix,
        })
    for name in selector_names:
        for selector in selectors[name]:
            selector.free()
    for store in stores:
        store.free()
    return rows


def _num(value: float) -> str:
    """Three significant digits below 100, whole numbers with thousands separators above."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    """The table, with exact/this step-time ratios per (context, batch, pool, threads), then the thread scaling."""
    layers = sorted({r["distinct_layers"] for r in rows})
    lines = [
        f"Host retrieval per decode step on this CPU: shape {args.heads} query / {args.kv_heads} KV heads × "
        f"{args.head_dim}, {args.layers} layers ({'/'.join(map(str, layers))} distinct, scaled), {args.dtype}, budget "
        f"{args.budget}; options {json.dumps(args.options)}"
        f"{'; the batch shares one stored prefix of `context` tokens' if args.shared_prefix else ''}. Selectors "
        "timed side by side, in a rotating order per step. pool = retrieval threads (1: one layer at a time, each "
        "call on `threads` engine threads; N > 1: N layers at once, one thread each). Host GB/s: this host's read "
        "bandwidth on as many threads, measured in the same run; share: the selection's read rate over it. Times: the "
        f"median (min–max) of {rows[0]['repeats']} steps per selector.", "",
        "| context | batch | selector | pool | threads | ms/layer | ms/step (min–max) | core-ms/seq-step | selections "
        "that scan | key MiB read/step | index / KV | build ms per 1K tokens·layer | GB/s read | host GB/s | share of "
        "host | exact / this |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cell = lambda r: (r["context"], r["batch"], r["pool"], r["torch_threads"])
    exact = {cell(r): r["ms_per_step"] for r in rows if r["selector"] == "exact"}
    for r in rows:
        base = exact.get(cell(r))
        ratio = f"{base / r['ms_per_step']:.1f}×" if base else "—"
        lines.append(
            f"| {r['context']} | {r['batch']} | {r['selector']} | {r['pool']} | {r['torch_threads']} | "
            f"{_num(r['ms_per_layer'])} | {_num(r['ms_per_step'])} ({_num(r['ms_per_step_min'])}–"
            f"{_num(r['ms_per_step_max'])}) | {_num(r['core_ms_per_sequence_step'])} | {r['scan_share']:.0%} | "
            f"{_num(r['key_mib_read_per_step'])} | {r['index_fraction']:.1%} | "
            f"{_num(r['build_ms_per_1k_tokens'])} | {r['effective_gbps']:.1f} | {r['host_read_gbps']:.1f} | "
            f"{r['host_share']:.0%} | {ratio} |"
        )
    by = {(r["context"], r["batch"], r["selector"], r["pool"], r["torch_threads"]): r["ms_per_step"] for r in rows}
    threads = sorted({r["torch_threads"] for r in rows if r["pool"] == 1})
    if len(threads) > 1:
        lines += ["", f"Thread scaling (ms/step at {threads[0]} engine thread(s) / at {threads[-1]}, pool 1):", ""]
        for (context, batch, selector, pool, count), value in by.items():
            other = (context, batch, selector, 1, threads[-1])
            if pool == 1 and count == threads[0] and other in by:
                lines.append(f"- {selector}, {context} tokens, batch {batch}: {value / by[other]:.2f}×")
    pools = sorted({r["pool"] for r in rows})
    if len(pools) > 1:
        lines += ["", f"Pool scaling (ms/step at pool {pools[0]} / at pool {pools[-1]}):", ""]
        for (context, batch, selector, pool, count), value in by.items():
            other = [v for k, v in by.items() if k[:3] == (context, batch, selector) and k[3] == pools[-1]]
            if pool == pools[0] and count == max(threads or [count]) and other:
                lines.append(f"- {selector}, {context} tokens, batch {batch}: {value / other[0]:.2f}×")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dual-decoder bench-retrieval", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072],
                        help="tokens stored per sequence, one cell each")
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="sequences per step, one cell each")
    parser.add_argument("--selectors", nargs="+", default=["exact", "lowbit", DualDecoderConfig().selector],
                        help=f"selectors to time, each a name of {[*PREFETCHED, TORCH_EXACT]} or NAME:JSON with its "
                             f"own options, e.g. 'carried:{{\"rescan_interval\": 8}}'; {TORCH_EXACT!r}: exact "
                             "selection in torch ops, as before the engine")
    parser.add_argument("--pools", type=int, nargs="+", default=[1],
                        help="retrieval threads running the layers' jobs (1: one at a time, each call on --threads "
                             "engine threads; N > 1: N layers at once, one engine thread each)")
    parser.add_argument("--budget", type=int, default=DualDecoderConfig.budget, help="tokens per KV head")
    parser.add_argument("--options", type=json.loads, default={},
                        help='other DualDecoderConfig fields as JSON, e.g. \'{"lowbit_factor": 4}\'')
    add_shape_options(parser)
    parser.add_argument("--layers", type=int, default=32, help="layers per step (scales the measured step)")
    parser.add_argument("--distinct-layers", type=int, default=4, help="layers with their own store and index")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="stored K/V dtype")
    parser.add_argument("--sink", type=int, default=DualDecoderConfig.n_sink, help="sink tokens (never selected)")
    parser.add_argument("--window", type=int, default=DualDecoderConfig.window, help="local window (never selected)")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed steps per cell (after one warm-up), the selectors in a rotating order each step; "
                             "rows report the median and the min-max")
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="torch intra-op and engine threads per call at pool 1, a cell each (default: torch's "
                             "count); the table gives the scaling from the first to the last")
    parser.add_argument("--memory-gib", type=float, default=8.0,
                        help="host memory for the distinct layers' K/V of a cell; fewer layers where it would pass")
    parser.add_argument("--shared-prefix", action="store_true",
                        help="the batch continues one stored sequence of `context` tokens (kept once; every query is "
                             "scored against it in one product)")
    parser.add_argument("--out", default=None,
                        help="output path without extension, writes .json and .md (default: a new "
                             "eval-results/bench-retrieval/<time>; results/ only when --out names it)")
    args = parser.parse_args(argv)
    problems = [f"--{name.replace('_', '-')} must be >= 1" for name in
                ("budget", "heads", "kv_heads", "head_dim", "layers", "repeats", "distinct_layers")
                if getattr(args, name) < 1]
    if not isinstance(args.options, dict) or "selector" in args.options:
        problems.append("--options must be a JSON object of DualDecoderConfig fields other than selector")
    else:
        try:  # each selector's own options are checked with that selector
            for name in args.selectors:
                selector_config(name, args.options)
        except (ValueError, TypeError) as error:
            problems.append(str(error))
    if args.sink < 0 or args.window < 1:
        problems.append("--sink must be >= 0 and --window >= 1")
    if args.kv_heads >= 1 and args.heads % args.kv_heads:
        problems.append("--heads must be a multiple of --kv-heads")
    if min(args.batches) < 1 or min(args.pools) < 1 or min(args.contexts) <= args.window + args.sink + args.budget:
        problems.append("--batches and --pools must be >= 1 and every --contexts value > window + sink + budget")
    if args.threads is not None and min(args.threads) < 1:
        problems.append("--threads must be >= 1")
    if args.memory_gib <= 0:
        problems.append("--memory-gib must be > 0")
    if problems:
        print("error: " + "; ".join(problems) + ".", file=sys.stderr)
        return 2
    thread_counts = list(dict.fromkeys(args.threads or [torch.get_num_threads()]))
    args.bandwidth = {threads: host_read_gbps(threads)
                      for threads in sorted({*(p for p in args.pools if p > 1), *thread_counts})}
    rows = []
    out = args.out or default_out("bench-retrieval")
    highest = load_average()
    for context in args.contexts:
        for batch in args.batches:
            for pool in args.pools:
                for threads in thread_counts if pool == 1 else [None]:
                    for row in measure(context, batch, list(dict.fromkeys(args.selectors)), pool, args, threads):
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                    highest = max(highest, load_average())
                    write_rows_and_table(out, rows, markdown(rows, args))  # a run cut short keeps its cells
    table = markdown(rows, args)
    warning = load_warning(highest)
    if warning:
        table = warning + "\n\n" + table
    print(table)
    paths = write_rows_and_table(out, rows, table)
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
