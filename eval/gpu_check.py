"""One-command GPU check of the pipeline: `python -m dual_cache.eval.gpu_check [--out DIR]`.

1. Correctness on a small real-shaped model (random weights, Llama layout with head_dim 128, GQA 4:1, fp32, TF32
   off): on the device, the full-budget dual cache equals dense greedy decoding; the pipelined path (retriever
   thread, copy stream, lookahead) equals the synchronous reference path, tokens and selections; and the device's
   first-step selections agree with the CPU reference's.
2. Timing: decode steps of a random-weight Llama-3.1-8B-shaped model in bf16 at 32K context over a batch sweep:
   ms per step, tokens/s, overlap ratio, bytes copied per step, device bytes per request — printed as a markdown
   table and written as JSON (`--out`).

Made for one CUDA GPU of the H100/H200 class (≈ 6–9 minutes there; the host needs ~4 GiB per request of 32K
context for the host store). `--device cpu --tiny` runs both parts at toy sizes (used by the test suite).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time

import torch

from ..cache import DualDecoderCache
from .bench_cell import run_cell
from .bench_grid import BenchGrid
from .bench_models import PromptSource, llama31_8b_config, random_model


def small_real_shaped_config(tiny: bool):
    """Llama layout with realistic head shapes (4 layers, 8 query / 2 KV heads, head_dim 128), or toy sizes."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=None, pad_token_id=0,
        )
    return LlamaConfig(
        vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=16384, eos_token_id=None, pad_token_id=0,
    )


def _generate(model, ids, new_tokens: int, **cache_options):
    """Greedy tokens and, with cache options, the selections each layer's attention read, as host tensors."""
    if not cache_options:
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False).cpu(), []
    cache = DualDecoderCache(model.config, **cache_options)
    recorded = []
    ensure = cache._ensure_schedule

    def spying_ensure(device):
        fresh = cache.schedule is None
        ensure(device)
        if fresh:
            schedule = cache.schedule
            release = schedule.release

            def spy(layer_idx):  # at release: the entries attention read, after any miss repair
                view = schedule._in_use[layer_idx][2]
                recorded.append((layer_idx, view.indices.to("cpu", copy=True), view.valid.to("cpu", copy=True)))
                release(layer_idx)

            schedule.release = spy

    cache._ensure_schedule = spying_ensure
    tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache=cache).cpu()
    return tokens, recorded


def _same_selections(a, b) -> bool:
    return len(a) == len(b) and all(
        la == lb and torch.equal(ia[va], ib[vb]) for (la, ia, va), (lb, ib, vb) in zip(a, b)
    )


def check_correctness(device: torch.device, tiny: bool) -> list[dict]:
    """The three correctness checks; each returns `{"check", "passed", "detail"}`."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = small_real_shaped_config(tiny)
    cpu_model = random_model(config, torch.float32, torch.device("cpu"), seed=0)
    model = copy.deepcopy(cpu_model).to(device)  # the same weights (CUDA and CPU generators differ)
    context, new_tokens, budget = (300, 12, 32) if tiny else (3000, 24, 256)
    ids = torch.randint(1, config.vocab_size, (2, context), generator=torch.Generator().manual_seed(1)).to(device)
    results = []

    dense, _ = _generate(model, ids, new_tokens)
    full, _ = _generate(model, ids, new_tokens, budget=context + new_tokens, n_sink=4, window=64)
    results.append({"check": "full budget == dense (greedy, on device)", "passed": torch.equal(dense, full),
                    "detail": f"{new_tokens} tokens × 2 sequences, context {context}"})

    partial = {"budget": budget, "n_sink": 4, "window": 64, "early_layers": 1, "early_layer_budget": 2 * budget}
    sync_tokens, sync_sel = _generate(model, ids, new_tokens, **partial, retrieval_threads=0, layers_in_flight=1,
                                      lookahead=0)
    pipe_tokens, pipe_sel = _generate(model, ids, new_tokens, **partial, retrieval_threads=1, layers_in_flight=2,
                                      lookahead=1)
    results.append({
        "check": "pipelined == synchronous reference (tokens and selections)",
        "passed": torch.equal(sync_tokens, pipe_tokens) and _same_selections(sync_sel, pipe_sel),
        "detail": f"{len(pipe_sel)} (step, layer) selections, budget {budget}",
    })

    _, cpu_sel = _generate(cpu_model, ids.cpu(), 2, **partial, retrieval_threads=0, layers_in_flight=1, lookahead=0)
    layers = len({layer for layer, _, _ in cpu_sel})
    overlaps = []
    for (_, ia, va), (_, ib, vb) in zip(cpu_sel[:layers], pipe_sel[:layers]):
        for row in range(ia.shape[0]):
            for head in range(ia.shape[1]):
                a, b = set(ia[row, head][va[row, head]].tolist()), set(ib[row, head][vb[row, head]].tolist())
                overlaps.append(len(a & b) / max(len(a), 1))
    agreement = sum(overlaps) / max(len(overlaps), 1)
    results.append({
        "check": "first-step selections agree with the CPU reference (>= 99% of entries)",
        "passed": agreement >= 0.99, "detail": f"mean overlap {agreement:.4f} over {len(overlaps)} (layer, row, head)",
    })
    return results


def time_decode(device: torch.device, tiny: bool, batches: list[int], context: int, new_tokens: int) -> list[dict]:
    """Decode rows (bench columns) for the dual cache over `batches` at `context` tokens."""
    if tiny:
        model, dtype_name = random_model(small_real_shaped_config(True), torch.float32, device), "tiny fp32"
    else:
        model, dtype_name = random_model(llama31_8b_config(), torch.bfloat16, device), "Llama-3.1-8B shape bf16"
    prompts = PromptSource(None, model.config.vocab_size, device)
    grid = BenchGrid(methods=("dual-self",), batches=tuple(batches), contexts=(context,), budgets=(256,),
                     new_tokens=new_tokens, warmup_steps=3, prefill_chunk_size=4096 if not tiny else 128,
                     # random weights: the speculated token (almost) never hits, so miss repair would make every
                     # step synchronous; this times the pipeline itself
                     dual_options={"miss_repair": False})
    rows = []
    for batch in batches:
        row = run_cell(model, prompts, "dual-self", context, batch, 256, grid, model_name=dtype_name)
        rows.append(row)
        print(_row_line(row), flush=True)
        if row.get("error"):
            break
    return rows


def _row_line(row: dict) -> str:
    def fmt(value, scale=1.0, digits=2):
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value / scale:.{digits}f}"

    return (
        f"| {row['batch']} | {fmt(row['ms_per_step'])} | {fmt(row['decode_tokens_per_s'], digits=1)} | "
        f"{fmt(row['overlap_ratio'], digits=3)} | {fmt(row['bytes_copied_per_step'], 2**20)} | "
        f"{fmt(row['device_bytes_per_request'], 2**20)} | {fmt(row['cuda_peak_bytes_per_request'], 2**20)} | "
        f"{fmt(row['dense_equivalent_bytes_per_request'], 2**30, 3)} | {row.get('error') or ''} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run, e.g. on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sweep (default 1 4 8 16)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 32768; tiny 512)")
    parser.add_argument("--new-tokens", type=int, default=None, help="decode steps per cell (default 24)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json (default $OUT)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: CUDA is not available; run on a CUDA GPU, or use --device cpu --tiny for a smoke run.",
              file=sys.stderr)
        return 2
    if device.type != "cuda" and not args.tiny:
        print("error: the full-size check needs CUDA; add --tiny for a toy run on this device.", file=sys.stderr)
        return 2
    batches = args.batches or ([1, 2] if args.tiny else [1, 4, 8, 16])
    context = args.context or (512 if args.tiny else 32768)
    new_tokens = args.new_tokens or (8 if args.tiny else 24)
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# dual-cache GPU check on {name}\n\n## correctness", flush=True)
    checks = check_correctness(device, args.tiny)
    for check in checks:
        print(f"- [{'PASS' if check['passed'] else 'FAIL'}] {check['check']}: {check['detail']}", flush=True)
    print(f"\n## decode, context {context}, budget 256, sink 4, window 64, miss_repair off\n\n"
          "| batch | ms/step | tokens/s | overlap | MiB copied/step | device MiB/request | CUDA peak MiB/request "
          "| dense GiB/request | error |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = time_decode(device, args.tiny, batches, context, new_tokens)
    elapsed = time.perf_counter() - started
    print(f"\ntotal {elapsed:.0f} s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as handle:
            json.dump({"device": name, "checks": checks, "rows": rows, "seconds": elapsed}, handle, indent=1,
                      default=str)
    return 0 if all(check["passed"] for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
