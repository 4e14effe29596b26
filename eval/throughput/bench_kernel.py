"""Benchmark the Triton sparse decode attention kernel against the torch reference and SDPA (CUDA only).

    python -m dual_cache.eval.throughput.bench_kernel       # Llama-3-8B-like heads, fp16, q=2
    python -m dual_cache.eval.throughput.bench_kernel --heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 \
        --budgets 256 1024 4096 --batches 1 8 64 --json results/kernel_bench.json

Per (batch, budget): segments as the dual cache lays them out (sink `--sink`, a per-head selection of `budget`
entries, a window ring of `--window + q` slots with `(1, 1, L)` positions and `(B, 1, L)` validity, one
left-padded sequence in the batch), and times, with `triton.testing.do_bench` (median, L2 flushed):

- kernel:  `sparse_decode_attention_triton` (reads the segments in place),
- ref:     `sparse_decode_attention_reference` (torch: cat + fp32 einsum/softmax),
- sdpa:    `torch.nn.functional.scaled_dot_product_attention` on tensors gathered *beforehand* (cat of the
           segments, boolean mask, `enable_gqa=True`): the attention alone, its best case,
- sdpa+g:  the same including the gather (cat of K/V and mask construction), what a caller would pay.

Prints a table with times in microseconds, the ratios ref/kernel and sdpa/kernel (> 1: the kernel is faster), the
kernel's effective K/V read bandwidth, and the max abs error of the kernel vs the reference. Refuses to run
without CUDA (the interpreter on CPU measures nothing useful).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ...config import DualDecoderConfig
from ..options import add_shape_options

_DEVICE = "cuda"  # tests of the script logic may point this elsewhere
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _segments(batch, kv_heads, dim, budget, sink, window, q_len, dtype, device, gen):
    from ...kernels.reference import KVSegment

    context = sink + budget * 4 + window  # positions the selection is drawn from
    pad = torch.zeros(batch, dtype=torch.long)
    pad[-1] = min(7, budget)  # one left-padded sequence
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(device)  # noqa: E731
    sink_seg = KVSegment(rand(batch, kv_heads, sink, dim), rand(batch, kv_heads, sink, dim),
                         (pad[:, None] + torch.arange(sink))[:, None].to(device),
                         torch.ones(batch, 1, sink, dtype=torch.bool, device=device))
    sel_pos = torch.randint(sink + 8, context - window, (batch, kv_heads, budget), generator=gen)
    sel_ok = torch.rand(batch, kv_heads, budget, generator=gen) > 0.02
    selection = KVSegment(rand(batch, kv_heads, budget, dim), rand(batch, kv_heads, budget, dim),
                          sel_pos.to(device), sel_ok.to(device))
    ring_len = window + q_len
    ring_pos = torch.roll(context - window + torch.arange(ring_len), 3)[None, None]
    ring = KVSegment(rand(batch, kv_heads, ring_len, dim), rand(batch, kv_heads, ring_len, dim),
                     ring_pos.to(device), (ring_pos >= pad[:, None, None]).expand(batch, 1, ring_len).to(device))
    qpos = (context + torch.arange(q_len)).to(device)
    return [sink_seg, selection, ring], qpos


def _gather(segments, qpos, batch, kv_heads):
    keys = torch.cat([s.keys for s in segments], dim=2)
    values = torch.cat([s.values for s in segments], dim=2)
    pos = torch.cat([s.positions.expand(batch, kv_heads, s.keys.shape[2]) for s in segments], dim=2)
    ok = torch.cat([s.valid.expand(batch, kv_heads, s.keys.shape[2]) for s in segments], dim=2)
    mask = ok[:, :, None, :] & (pos[:, :, None, :] <= qpos[None, None, :, None])  # (B, H_kv, q, S)
    return keys, values, mask


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_options(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--q-len", type=int, default=2)
    parser.add_argument("--sink", type=int, default=DualDecoderConfig.n_sink)
    parser.add_argument("--window", type=int, default=DualDecoderConfig.window)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring time per timing")
    parser.add_argument("--no-ref", action="store_true", help="skip the (slow, memory-hungry) torch reference")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernel needs a CUDA GPU: torch.cuda.is_available() is False (the Triton kernel only runs "
              "interpreted on CPU, which measures nothing). Run it on a CUDA machine.", file=sys.stderr)
        return 2
    try:
        import triton
        from triton.testing import do_bench
    except ImportError as error:
        print(f"bench_kernel needs triton ({error}); pip install triton.", file=sys.stderr)
        return 2
    from ...kernels.reference import sparse_decode_attention_reference
    from ...kernels.triton_decode import sparse_decode_attention_triton

    device = torch.device(_DEVICE)
    dtype = DTYPES[args.dtype]
    scale = args.head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    device_name = props.name if props is not None else str(device)
    print(f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; H_q={args.heads} "
          f"H_kv={args.kv_heads} D={args.head_dim} {args.dtype} q={args.q_len} sink={args.sink} "
          f"window={args.window}; times in us (median), ratios > 1 mean the kernel is faster")
    header = (f"{'B':>4} {'budget':>6} {'keys':>6} {'kernel':>9} {'ref':>9} {'sdpa':>9} {'sdpa+g':>9} "
              f"{'ref/k':>7} {'sdpa/k':>7} {'sdpa+g/k':>8} {'GB/s':>7} {'maxerr':>9}")
    print(header)
    rows = []
    for batch in args.batches:
        for budget in args.budgets:
            segments, qpos = _segments(batch, args.kv_heads, args.head_dim, budget, args.sink, args.window,
                                       args.q_len, dtype, device, gen)
            query = torch.randn(batch, args.heads, args.q_len, args.head_dim, generator=gen).to(dtype).to(device)
            total = sum(s.keys.shape[2] for s in segments)
            out = torch.empty_like(query)

            def kernel():
                return sparse_decode_attention_triton(query, segments, qpos, scale, out=out)

            def reference():
                return sparse_decode_attention_reference(query, segments, qpos, scale)

            keys, values, mask = _gather(segments, qpos, batch, args.kv_heads)
            sdpa_mask = mask.repeat_interleave(args.heads // args.kv_heads, dim=1)

            def sdpa():
                return torch.nn.functional.scaled_dot_product_attention(
                    query, keys, values, attn_mask=sdpa_mask, scale=scale, enable_gqa=True)

            def sdpa_gather():
                k, v, m = _gather(segments, qpos, batch, args.kv_heads)
                return torch.nn.functional.scaled_dot_product_attention(
                    query, k, v, attn_mask=m.repeat_interleave(args.heads // args.kv_heads, dim=1), scale=scale,
                    enable_gqa=True)

            expected = reference()
            err = (kernel().float() - expected.float()).abs().max().item()
            t_kernel = do_bench(kernel, rep=args.rep_ms) * 1e3
            t_ref = float("nan") if args.no_ref else do_bench(reference, rep=args.rep_ms) * 1e3
            t_sdpa = do_bench(sdpa, rep=args.rep_ms) * 1e3
            t_sdpa_g = do_bench(sdpa_gather, rep=args.rep_ms) * 1e3
            kv_bytes = 2 * batch * args.kv_heads * total * args.head_dim * query.element_size()
            row = dict(batch=batch, budget=budget, keys=total, kernel_us=t_kernel, ref_us=t_ref, sdpa_us=t_sdpa,
                       sdpa_gather_us=t_sdpa_g, ref_over_kernel=t_ref / t_kernel, sdpa_over_kernel=t_sdpa / t_kernel,
                       sdpa_gather_over_kernel=t_sdpa_g / t_kernel, kernel_gbps=kv_bytes / t_kernel / 1e3,
                       max_abs_err=err)
            rows.append(row)
            print(f"{batch:>4} {budget:>6} {total:>6} {t_kernel:>9.1f} {t_ref:>9.1f} {t_sdpa:>9.1f} "
                  f"{t_sdpa_g:>9.1f} {row['ref_over_kernel']:>7.2f} {row['sdpa_over_kernel']:>7.2f} "
                  f"{row['sdpa_gather_over_kernel']:>8.2f} {row['kernel_gbps']:>7.0f} {err:>9.2e}", flush=True)
            segments = keys = values = mask = sdpa_mask = expected = out = None  # free before the next size
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(device=device_name, torch=torch.__version__, triton=triton.__version__,
                           config=vars(args), rows=rows), handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
