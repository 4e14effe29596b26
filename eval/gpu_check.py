"""GPU correctness check of the pipeline: `python -m dual_cache.eval.gpu_check [--out DIR]`.

On a small real-shaped model (random weights, Llama layout with head_dim 128, GQA 4:1, fp32, TF32 off), with the
default selector (`DualDecoderConfig().selector`): on the device, the full-budget dual cache equals dense greedy
decoding; the pipelined path (retriever thread, copy stream, lookahead) equals the synchronous reference path,
tokens and selections; the device's first-step selections agree with the CPU reference's; and steady-state decode
steps run under `torch.cuda.set_sync_debug_mode("error")` without raising (no host synchronization but the loop's
one read per step). Prints a PASS / FAIL line as each check finishes and rewrites `gpu_check.json` in `--out` after
each; the exit status is 1 when a check fails. Seconds on one CUDA GPU. Timing lives in the benchmark
(`dual-decoder bench --device cuda`); `eval/device_run.sh` runs both on the CUDA test machine. `--device cpu --tiny`
runs the checks at toy sizes (used by the test suite).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch

from ..cache.cache import DualDecoderCache
from ..cli.help_format import DefaultsHelpFormatter
from ..config import DualDecoderConfig
from .throughput.bench_models import random_model


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


def record_attended(cache) -> list:
    """Record, for every decode step of every full-attention layer with a budget, what the real token attends to of
    its resident set (after the step's delta and any miss repair): `(layer, positions, valid, keys)` host copies in a
    slot-order-free form (`resident_set.attended_entries`), through `attention_observer.observe_attention`; the
    tests use it too."""
    from ..transfer.resident_set import attended_entries
    from .attention_observer import observe_attention

    recorded = []

    def record(layer, query, scaling, step):
        recorded.append((layer.layer_idx, *attended_entries(step.segments[1])))

    observe_attention(cache, record)
    return recorded


def _generate(model, ids, new_tokens: int, **cache_options):
    """Greedy tokens and, with cache options, the entries each layer's attention read (`record_attended`: layer,
    positions, valid), as host tensors."""
    if not cache_options:
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False).cpu(), []
    cache = DualDecoderCache(model.config, **cache_options)
    recorded = record_attended(cache)
    tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache=cache).cpu()
    return tokens, [(layer, positions, valid) for layer, positions, valid, _ in recorded]


def _same_selections(a, b) -> bool:
    return len(a) == len(b) and all(
        la == lb and torch.equal(ia[va], ib[vb]) for (la, ia, va), (lb, ib, vb) in zip(a, b)
    )


def check_correctness(device: torch.device, tiny: bool, on_check=None) -> list[dict]:
    """The four checks (three of correctness, one of synchronization), each `{"check", "passed", "detail"}`;
    `on_check(check)` is called as each one finishes (a run cut short keeps the verdicts it reached)."""
    on_check = on_check or (lambda check: None)
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
    on_check(results[-1])

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
    on_check(results[-1])

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
    on_check(results[-1])
    results.append(check_no_sync_in_steady_state(model, ids, partial))
    on_check(results[-1])
    return results


def check_no_sync_in_steady_state(model, ids, options: dict, steps: int = 8, strict: bool | None = None) -> dict:
    """Decode steps after the first two, with no miss repair (the pipeline alone) and with miss repair on a forced
    all-hit pattern (`ForcedMissCache(miss_rate=0)`), must not synchronize the host with the device except the
    loop's one deliberate read per step.

    `strict` (default: on CUDA) runs those steps under `torch.cuda.set_sync_debug_mode("error")`, where any other
    synchronizing call raises; else they are counted by `SyncCounter` (at most 2 per step). Either way the region
    ends where decoding does, before `end_request`: ending a request reads the sequences back and drains the copy
    stream, synchronizations by design that are no part of a step."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from ..runtime.sync_points import SyncCounter
    from .throughput.forced_miss import ForcedMissCache

    strict = ids.device.type == "cuda" if strict is None else strict
    details, passed = [], True
    for name, make in (("no repair", lambda: DualDecoderCache(model.config, **options, miss_repair=False,
                                                              retrieval_threads=2)),
                       ("repair, all hits", lambda: ForcedMissCache(model.config, miss_rate=0.0, **options,
                                                                    retrieval_threads=2))):
        region = _SteadyRegion(strict, SyncCounter())

        class SteadyState(StoppingCriteria):  # called once per step, before the step's read and next forward
            def __call__(self, input_ids, scores, **kwargs):
                region.step()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        cache = make()
        end_request = cache.end_request

        def leave_then_end(*args, **kwargs):
            region.leave()
            return end_request(*args, **kwargs)

        cache.end_request = leave_then_end
        try:
            model.generate(ids, max_new_tokens=steps + 2, do_sample=False, cache=cache,
                           stopping_criteria=StoppingCriteriaList([SteadyState()]))
            if strict:
                details.append(f"{name}: {region.steps} steps, no synchronization raised")
            else:
                per_step = region.counter.total / region.steps
                passed &= per_step <= 2
                details.append(f"{name}: {per_step:.1f} per step ({dict(region.counter.by_op)})")
        except RuntimeError as error:
            passed = False
            details.append(f"{name}: {error}")
        finally:
            region.leave()
            cache.close()
    return {"check": "no host synchronization inside a steady-state decode step", "passed": passed,
            "detail": "; ".join(details)}


class _SteadyRegion:
    """The steady-state steps of one request: entered at the third step (the first two set up the pipeline and
    repair every row), left when decoding ends. Strict: under CUDA's sync debug mode "error"; else counted."""

    def __init__(self, strict: bool, counter) -> None:
        self.strict, self.counter = strict, counter
        self.calls = self.steps = 0
        self.inside = False

    def step(self) -> None:
        self.calls += 1
        if self.calls == 3:
            self.inside = True
            if self.strict:
                torch.cuda.set_sync_debug_mode("error")
            else:
                self.counter.__enter__()
        if self.inside:
            self.steps += 1

    def leave(self) -> None:
        if not self.inside:
            return
        self.inside = False
        if self.strict:
            torch.cuda.set_sync_debug_mode(0)
        else:
            self.counter.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dual-decoder gpu-check", formatter_class=DefaultsHelpFormatter,
        description="GPU correctness checks of the pipeline on a small real-shaped model: the full-budget dual cache "
                    "equals dense greedy decoding on the device, the pipelined path equals the synchronous one "
                    "(tokens and selections), and the device's first-step selections agree with the CPU "
                    "reference's. PASS / FAIL lines, gpu_check.json in --out; exit status 1 when a check fails.")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="toy sizes: a smoke run, e.g. on CPU")
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
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    selector = DualDecoderConfig().selector
    print(f"# dual-cache GPU check on {name}, default selector {selector!r}", flush=True)
    checks: list[dict] = []

    def finished(check: dict) -> None:  # each verdict printed and written as it comes
        checks.append(check)
        print(f"- [{'PASS' if check['passed'] else 'FAIL'}] {check['check']}: {check['detail']}", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as handle:
                json.dump({"device": name, "selector": selector, "checks": checks,
                           "seconds": time.perf_counter() - started}, handle, indent=1)

    check_correctness(device, args.tiny, on_check=finished)
    print(f"total {time.perf_counter() - started:.0f} s")
    return 0 if all(check["passed"] for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
