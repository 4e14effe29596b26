"""Host query·key products in both operand orders, dtype by dtype: the measurement behind `retrieval.products`.

    python -m dual_cache.eval.bench_matmul_order --out results/bench/matmul-order

Scoring a step on the host multiplies a few query rows per KV head (the GQA group, or a batch's groups against a
shared prefix) by many keys. On CPU the speed of that product depends on which operand is on the left, differently
per dtype. Per cell (batch, positions, dtype): `(B, H_kv, G, D) @ (B, H_kv, n, D)ᵀ` ("rows @ keysᵀ") and
`(B, H_kv, n, D) @ (B, H_kv, G, D)ᵀ` ("keys @ rowsᵀ"), each over `--buffers` distinct key tensors in turn (so that
large cells stream from memory as a step does), median of `--repeats` calls after two warm-ups, at the torch
intra-op thread count given. `products` picks, per dtype, the order that is faster in every cell of the committed
table. Writes `<out>.json` and `<out>.md`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .outputs import write_rows_and_table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def time_call(call, repeats: int) -> float:
    """Median seconds of `call()` over `repeats` calls, after two warm-up calls."""
    call()
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(batch: int, positions: int, dtype: str, args: argparse.Namespace) -> dict:
    """One cell: milliseconds of one product in each order."""
    gen = torch.Generator().manual_seed(positions + batch)
    keys = [torch.randn(batch, args.kv_heads, positions, args.head_dim, generator=gen).to(DTYPES[dtype])
            for _ in range(args.buffers)]
    rows = torch.randn(batch, args.kv_heads, args.group, args.head_dim, generator=gen).to(DTYPES[dtype])
    turn = iter(range(1 << 62))

    def next_keys() -> torch.Tensor:
        return keys[next(turn) % len(keys)]

    left = time_call(lambda: torch.matmul(rows, next_keys().transpose(-1, -2)), args.repeats)
    right = time_call(lambda: torch.matmul(next_keys(), rows.transpose(-1, -2)), args.repeats)
    return {"batch": batch, "positions": positions, "dtype": dtype, "kv_heads": args.kv_heads, "group": args.group,
            "head_dim": args.head_dim, "threads": torch.get_num_threads(),
            "rows_at_keys_ms": left * 1e3, "keys_at_rows_ms": right * 1e3,
            "key_mib": keys[0].nbytes / 2**20}


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"Query·key products on this CPU, both operand orders: {rows[0]['kv_heads']} KV heads × group "
        f"{rows[0]['group']} query rows × {rows[0]['head_dim']} channels, at {rows[0]['threads']} torch thread(s). "
        "Median ms per product; ratio > 1: keys @ rowsᵀ is faster.", "",
        "| batch | positions | dtype | key MiB | rows @ keysᵀ ms | keys @ rowsᵀ ms | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['positions']} | {r['dtype']} | {r['key_mib']:.0f} | "
                     f"{r['rows_at_keys_ms']:.3g} | {r['keys_at_rows_ms']:.3g} | "
                     f"{r['rows_at_keys_ms'] / r['keys_at_rows_ms']:.2f}× |")
    return "\n".join(lines) + f"\n\nCommand: `{command}`\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--positions", type=int, nargs="+", default=[2048, 4096, 32768])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query rows per KV head")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--buffers", type=int, default=4, help="distinct key tensors used in turn")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", default=None, help="output path without extension (writes .json and .md)")
    args = parser.parse_args(argv)
    sizes = [*args.batches, *args.positions, args.kv_heads, args.group, args.head_dim, args.buffers, args.repeats,
             args.threads]
    if min(sizes) < 1:
        parser.error("every size, count and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    rows = [measure(batch, positions, dtype, args) for batch in args.batches for positions in args.positions
            for dtype in args.dtypes]
    command = "python -m dual_cache.eval.bench_matmul_order " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(rows, command.strip())
    print(table)
    if args.out:
        write_rows_and_table(args.out, rows, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
