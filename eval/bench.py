"""Throughput and memory benchmark: dense vs offloaded vs dual (vs Quest) over method × batch × context × budget.

Run it as `dual-decoder bench ...` (see `bench_cli.py`) or `python -m dual_cache.eval.bench ...`.

Per cell (one `generate()` call of `batch` prompts of `context` tokens, `new_tokens` new tokens each) it records:

- `prefill_s`: seconds from `generate()` handing the prompt to the streamer to the first generated token;
- `decode_tokens_per_s`: generated tokens per second summed over the batch, over the decode steps after the
  warm-up steps (prefill excluded);
- `ms_per_step`: median milliseconds per decode step after warm-up. A step is one forward pass emitting one token
  per sequence — the dual loop feeds `[x_t, x̂_{t+1}]` but still emits one real token per forward;
- `device_bytes_per_request`: KV bytes resident on the compute device per sequence, from the cache's own
  accounting (dense: the `DynamicCache` tensors; offloaded: the two largest layers — the one in use and the one
  being prefetched; dual / quest: `DualDecoderCache.stats()["device_bytes"]`, i.e. sink + window ring + the
  layer-scoped selection pool);
- `cuda_peak_bytes_per_request`: on CUDA, `(torch.cuda.max_memory_allocated() - allocated before) / batch`
  over the whole call (KV plus activations, prefill included; weights excluded); `cuda_decode_peak_bytes_per_request`
  the same over the decode steps only (from the first generated token on); `cuda_peak_total_bytes` the whole
  call's peak including weights (what the max-concurrency sweep compares with the budget); NaN on CPU;
- `host_bytes_per_request`: KV bytes in host memory per sequence (dual host store; offloaded: the whole cache);
- `bytes_copied_per_step`: host→device bytes per decode step for the whole batch (dual: selections;
  offloaded: every layer is prefetched once per step, so the whole cache at its final size; dense: 0);
- `overlap_ratio`, `wait_seconds`: the dual pipeline's telemetry (`cache.stats()`), NaN where absent;
- `spec_hit_rate`: speculated tokens equal to the real next token / speculated tokens (dual only);
- `repaired_fraction`: decode steps in which miss repair redid any selection (a miss, or a drifted query on a hit:
  `repair_drift`) / decode steps (dual only; `miss_repair`).

Max concurrency for a device memory budget (`device_budget_gib`): on CPU computed as
`floor((budget - weight bytes) / device_bytes_per_request)` from the measured per-request bytes (activations are
not counted); on CUDA measured by sweeping the batch (doubling, then bisection) until the peak allocated memory
exceeds the budget or allocation fails, also stopping where the host stores would not fit in host memory.

Timings go only to the printed table and the JSON files; tests check columns and memory accounting, never speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import contextlib
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..cache import available_host_bytes
from ..cli import TimingStreamer
from ..config import SPECULATORS, DualDecoderConfig
from .cpu_linear import MAX_ROWS as CPU_GEMM_MAX_ROWS
from .cpu_linear import gemm_linears

NAN = float("nan")
DUAL_METHODS = tuple(f"dual-{s}" for s in SPECULATORS)  # dual-self, dual-ngram, dual-none
BASELINES = ("dense", "offloaded")
SHORTLIST = "dual-shortlist"  # dual-self with the two-stage host selector (`selector="shortlist"`)
ALL_METHODS = BASELINES + DUAL_METHODS + (SHORTLIST, "quest")
METHOD_ALIASES = {"dual": DUAL_METHODS, "all": ALL_METHODS}
BUDGETED = DUAL_METHODS + (SHORTLIST, "quest")  # methods whose cells vary with the retrieval budget
NAMED_MODELS = ("embedded", "tiny", "llama8b")
CPU_LINEARS = ("stock", "gemm")  # see eval/cpu_linear.py
GIB = 1024 ** 3

# every key a cell row carries (tests check all of them are present)
COLUMNS = (
    "method", "model", "device", "dtype", "context", "batch", "budget", "new_tokens", "decode_steps",
    "prefill_s", "decode_tokens_per_s", "ms_per_step",
    "device_bytes_per_request", "cuda_peak_bytes_per_request", "cuda_decode_peak_bytes_per_request",
    "cuda_peak_total_bytes", "host_bytes_per_request",
    "dense_equivalent_bytes_per_request", "bytes_copied_per_step", "overlap_ratio", "wait_seconds",
    "spec_hit_rate", "repaired_fraction", "threads", "error",
)


# ----------------------------------------------------------------------------------------------------------------
# grid
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class BenchGrid:
    """What to measure. Token counts are tokens; `budgets` are tokens per KV head per full-attention layer.

    Attributes:
        methods: names from `ALL_METHODS` (`dual-<speculator>`: exact selection; `dual-shortlist`: the self
            speculator with `selector="shortlist"`) or the aliases `"dual"` (every speculator) and `"all"`.
        batches: sequences per `generate()` call.
        contexts: prompt lengths (tokens; the embedded model's needle prompts meet them within a few tokens).
        budgets: dual / quest retrieval budgets; dense and offloaded cells ignore them.
        new_tokens: generated tokens per sequence (every one is generated: `min_new_tokens = new_tokens`).
        warmup_steps: decode steps excluded from tokens/s and ms/step.
        n_sink, window: dual resident tiers (tokens).
        prefill_chunk_size: prompt tokens per prefill forward, used by every method (fair activation memory).
        quest_block_size: page size of the Quest baseline (tokens).
        do_sample: sample at temperature 1 instead of greedy decoding (speculation hits drop).
        dual_options: further `DualDecoderConfig` fields for dual / quest cells (e.g. `{"early_layers": 0}`);
            `speculator` and `selector` are set by the method and may not appear here (`shortlist_channels` and
            `shortlist_factor` may).
    """

    methods: tuple[str, ...] = ("dense", "dual-self")
    batches: tuple[int, ...] = (1,)
    contexts: tuple[int, ...] = (2048,)
    budgets: tuple[int, ...] = (256,)
    new_tokens: int = 32
    warmup_steps: int = 2
    n_sink: int = 4
    window: int = 64
    prefill_chunk_size: int = 8192
    quest_block_size: int = 16
    do_sample: bool = False
    dual_options: dict[str, Any] = field(default_factory=dict)
    cpu_linear: str = "stock"

    def expanded_methods(self) -> tuple[str, ...]:
        """Methods with aliases expanded, in `ALL_METHODS` order, without duplicates."""
        names = set()
        for name in self.methods:
            names.update(METHOD_ALIASES.get(name, (name,)))
        return tuple(m for m in ALL_METHODS if m in names)

    def validate(self) -> None:
        """Check the grid before any model loads.

        Raises:
            ValueError: naming the offending option and what to change.
        """
        if not self.methods:
            raise ValueError("--methods is empty; name at least one of " + ", ".join(ALL_METHODS + ("dual", "all")))
        unknown = [m for m in self.methods if m not in ALL_METHODS and m not in METHOD_ALIASES]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {list(ALL_METHODS)} or the aliases dual, all.")
        for name, values, minimum in (
            ("batches", self.batches, 1), ("contexts", self.contexts, 1), ("budgets", self.budgets, 0),
        ):
            if not values:
                raise ValueError(f"--{name} is empty; give at least one value.")
            bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < minimum]
            if bad:
                raise ValueError(f"--{name} values must be integers >= {minimum}; got {bad}.")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}.")
        if self.cpu_linear not in CPU_LINEARS:
            raise ValueError(f"--cpu-linear must be one of {CPU_LINEARS}, got {self.cpu_linear!r}.")
        if self.cpu_linear == "gemm" and 2 * max(self.batches, default=0) > CPU_GEMM_MAX_ROWS:
            raise ValueError(
                f"--cpu-linear gemm covers decode forwards of up to {CPU_GEMM_MAX_ROWS} rows (batch × 2 tokens); "
                f"--batches goes to {max(self.batches)}. Use smaller batches or --cpu-linear stock."
            )
        if self.new_tokens < self.warmup_steps + 3:
            raise ValueError(
                f"--new-tokens={self.new_tokens} leaves fewer than 2 timed decode steps after "
                f"--warmup-steps={self.warmup_steps}; use --new-tokens >= {self.warmup_steps + 3}."
            )
        clash = sorted({"speculator", "selector", "budget"} & set(self.dual_options))
        if clash:
            raise ValueError(f"--dual-options may not set {clash}: choose them with --methods / --budgets.")
        for method in self.expanded_methods():
            if method in BUDGETED:
                for budget in self.budgets:
                    try:
                        DualDecoderConfig.from_dict(self.cache_config(method, budget))
                    except ValueError as error:
                        raise ValueError(f"method {method} with budget {budget}: {error}") from None

    def cache_config(self, method: str, budget: int) -> dict[str, Any]:
        """The `cache_config` dict of a dual / quest cell."""
        config: dict[str, Any] = {
            "n_sink": self.n_sink, "window": self.window, "prefill_chunk_size": self.prefill_chunk_size,
            **self.dual_options, "budget": budget,
        }
        if method == "quest":  # Quest decodes one token per step and selects with its own query
            config.update(selector="quest", block_size=self.quest_block_size, speculator="none")
        elif method == SHORTLIST:
            config.update(selector="shortlist", speculator="self")
        else:
            config["speculator"] = method.removeprefix("dual-")
        return config

    def cells(self, skip: set[str] = frozenset()) -> list[tuple[str, int, int, int | None]]:
        """`(method, context, batch, budget)` of every cell, contexts outermost; budget None for baselines."""
        out = []
        for context in self.contexts:
            for batch in self.batches:
                for method in self.expanded_methods():
                    if method in skip:
                        continue
                    for budget in (self.budgets if method in BUDGETED else (None,)):
                        out.append((method, context, batch, budget))
        return out


def skipped_methods(grid: BenchGrid, device: torch.device) -> dict[str, str]:
    """`{method: reason}` for methods of the grid that cannot run here (printed, never an error)."""
    skip = {}
    methods = grid.expanded_methods()
    if "offloaded" in methods and device.type != "cuda":
        skip["offloaded"] = (
            "transformers' offloaded cache needs CUDA (it prefetches layers on a CUDA stream); skipped on "
            f"{device.type}"
        )
    return skip


# ----------------------------------------------------------------------------------------------------------------
# models and prompts
# ----------------------------------------------------------------------------------------------------------------
def llama31_8b_config():
    """A `LlamaConfig` shaped like Llama-3.1-8B (32 layers, 32 query / 8 KV heads, head_dim 128, bf16)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=None, pad_token_id=0,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        dtype="bfloat16",
    )


def tiny_llama_config():
    """A tiny `LlamaConfig` (3 layers, 4 query / 2 KV heads, head_dim 16) for smoke runs and tests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=None, pad_token_id=0,
    )


def random_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random-weight causal LM from `config`, built directly in `dtype` on `device` (no weights download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_bench_model(name: str, device: torch.device):
    """`(model, tokenizer or None)` for a model name of `--model` (see `NAMED_MODELS`) or a path / Hub id.

    Raises:
        ValueError: for `llama8b` without CUDA (16 GB of bf16 weights; a CPU run would measure nothing useful).
    """
    if name == "tiny":
        return random_model(tiny_llama_config(), torch.float32, device), None
    if name == "llama8b":
        if device.type != "cuda":
            raise ValueError("--model llama8b needs --device cuda (a random 8B model in bf16).")
        return random_model(llama31_8b_config(), torch.bfloat16, device), None
    from ..models import load_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_model(None if name == "embedded" else name, dtype=dtype, device=str(device))


class PromptSource:
    """Batches of prompts: needle questions over the Python reference (models with a tokenizer) or random ids.

    Row `b` of a batch uses seed `b`; rows of needle prompts are left-padded to the longest one.
    """

    def __init__(self, tokenizer, vocab_size: int, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self._cache: dict[tuple[int, int], list[int]] = {}

    def _needle_ids(self, context: int, seed: int) -> list[int]:
        from .needle import format_chat, make_needle_prompt

        key = (context, seed)
        if key not in self._cache:
            prompt = make_needle_prompt(self.tokenizer, context, seed=seed)
            self._cache[key] = format_chat(self.tokenizer, prompt.text)
        return self._cache[key]

    def batch(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)`, both `(batch, P)` int64 on the model's device."""
        if self.tokenizer is None:
            rows = []
            for seed in range(batch):
                generator = torch.Generator().manual_seed(seed)
                rows.append(torch.randint(1, self.vocab_size, (context,), generator=generator))
            ids = torch.stack(rows)
            return ids.to(self.device), torch.ones_like(ids).to(self.device)
        rows = [self._needle_ids(context, seed) for seed in range(batch)]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, width - len(row):] = torch.tensor(row)
            mask[b, width - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied weights counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes_estimate(model_config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Full KV bytes of `batch` sequences of `tokens` tokens: `2 × L × H_kv × tokens × D × dtype bytes × batch`."""
    text = model_config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * kv_heads * tokens * head_dim * item * batch


# ----------------------------------------------------------------------------------------------------------------
# cache accounting
# ----------------------------------------------------------------------------------------------------------------
def _layer_bytes(cache) -> list[int]:
    out = []
    for layer in getattr(cache, "layers", []):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if getattr(layer, "is_initialized", False) and keys is not None and values is not None:
            out.append(keys.nbytes + values.nbytes)
    return out


def cache_accounting(method: str, cache) -> dict[str, float]:
    """Bytes of a finished `generate()`'s cache, for the whole batch.

    Returns `device_bytes`, `host_bytes`, `dense_equivalent_bytes` (what a DynamicCache would hold),
    `bytes_copied` (host→device in total, dual only; NaN where it is derived per step instead),
    `bytes_copied_per_step_estimate` (offloaded only), and the dual telemetry (`overlap_ratio`, `wait_seconds`,
    `steps`, `spec_hits`, `spec_steps`, `repaired_fraction`; NaN when the cache does not report them).
    """
    empty = {"overlap_ratio": NAN, "wait_seconds": NAN, "steps": NAN, "spec_hits": NAN, "spec_steps": NAN,
             "repaired_fraction": NAN}
    if method == "dense":
        total = sum(_layer_bytes(cache))
        return {"device_bytes": total, "host_bytes": 0, "dense_equivalent_bytes": total, "bytes_copied": 0, **empty}
    if method == "offloaded":
        layers = sorted(_layer_bytes(cache), reverse=True)
        total = sum(layers)
        return {
            "device_bytes": sum(layers[:2]),  # the layer being used + the one being prefetched
            "host_bytes": total, "dense_equivalent_bytes": total, "bytes_copied": NAN,
            "bytes_copied_per_step_estimate": total, **empty,
        }
    stats = cache.stats()
    return {
        "device_bytes": stats["device_bytes"], "host_bytes": stats["host_bytes"],
        "dense_equivalent_bytes": stats["dense_equivalent_bytes"], "bytes_copied": stats.get("bytes_copied", NAN),
        "overlap_ratio": stats.get("overlap_ratio", NAN), "wait_seconds": stats.get("wait_seconds", NAN),
        "steps": stats.get("steps", NAN), "spec_hits": stats.get("spec_hits", NAN),
        "spec_steps": stats.get("spec_steps", NAN),
        "repaired_fraction": stats["repaired_steps"] / stats["steps"] if stats.get("steps") else NAN,
    }


# ----------------------------------------------------------------------------------------------------------------
# one cell
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class StepTimer(TimingStreamer):
    """`TimingStreamer` that also records when `generate()` hands over the prompt (`prompt_time`, seconds).

    With `cuda_device` set, it records the peak allocated bytes up to the first generated token (`prefill_peak`)
    and resets the peak counter there, so `torch.cuda.max_memory_allocated()` afterwards is the decode-phase peak.
    """

    prompt_time: float = NAN
    cuda_device: torch.device | None = None
    prefill_peak: int = 0

    def put(self, value):
        if not self._prompt_seen:
            self.prompt_time = time.perf_counter()
        elif not self.times and self.cuda_device is not None:
            self.prefill_peak = torch.cuda.max_memory_allocated(self.cuda_device)
            torch.cuda.reset_peak_memory_stats(self.cuda_device)
        super().put(value)


def _is_oom(error: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom_type is not None and isinstance(error, oom_type)) or "out of memory" in str(error).lower()


def _free_device(device: torch.device, collect: bool = True) -> None:
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def empty_row(method: str, context: int, batch: int, budget: int | None, grid: BenchGrid, **extra) -> dict:
    """A row with every column, values NaN (filled by `run_cell`)."""
    row = {c: NAN for c in COLUMNS}
    row.update(
        method=method, context=context, batch=batch, budget=budget, new_tokens=grid.new_tokens, error=None,
        threads=torch.get_num_threads(),
    )
    row.update(extra)
    return row


def run_cell(model, prompts: PromptSource, method: str, context: int, batch: int, budget: int | None,
             grid: BenchGrid, new_tokens: int | None = None, model_name: str = "") -> dict:
    """Run one `generate()` and return its row (keys `COLUMNS`); an out-of-memory sets `error` instead of raising.

    Args:
        new_tokens: overrides `grid.new_tokens` (the CUDA batch sweep uses short runs).
    """
    import dual_cache  # noqa: F401  (registers cache_implementation="dual")

    device = model.device
    new_tokens = grid.new_tokens if new_tokens is None else new_tokens
    row = empty_row(method, context, batch, budget, grid, model=model_name, device=device.type,
                    dtype=str(model.dtype).removeprefix("torch."), new_tokens=new_tokens)
    ids, mask = prompts.batch(batch, context)
    row["context"] = ids.shape[1]
    kwargs: dict[str, Any] = {}
    if method in BUDGETED:
        kwargs = {"cache_implementation": "dual", "cache_config": grid.cache_config(method, budget)}
    else:
        if method == "offloaded":
            kwargs["cache_implementation"] = "offloaded"
        if ids.shape[1] > grid.prefill_chunk_size:
            kwargs["prefill_chunk_size"] = grid.prefill_chunk_size
    if grid.do_sample:
        kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=None)
        torch.manual_seed(0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)

    needs_host = method != "dense" or device.type == "cpu"
    estimate = kv_bytes_estimate(model.config, batch, ids.shape[1] + new_tokens, model.dtype)
    if needs_host and estimate > 0.85 * available_host_bytes():
        row["error"] = f"host memory: the KV cache needs ~{estimate / GIB:.1f} GiB, more than 85% of what is free"
        return row

    cuda = device.type == "cuda"
    _free_device(device, collect=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    timer = StepTimer(cuda_device=device if cuda else None)
    out = cache = None
    oom = None
    try:
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            streamer=timer, return_dict_in_generate=True, **kwargs,
        )
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        if cuda:
            torch.cuda.synchronize(device)
            decode_peak = torch.cuda.max_memory_allocated(device)
            peak = max(decode_peak, timer.prefill_peak)
            row["cuda_peak_total_bytes"] = peak
            row["cuda_peak_bytes_per_request"] = (peak - base) / batch
            row["cuda_decode_peak_bytes_per_request"] = (decode_peak - base) / batch
        acct = cache_accounting(method, cache)
    except Exception as error:  # noqa: BLE001  (only out-of-memory is recorded; anything else is a bug)
        if not _is_oom(error):
            raise
        oom = f"out of memory: {str(error).splitlines()[0][:200]}"
    del out, cache
    _free_device(device)
    if oom is not None:
        row["error"] = oom
        return row

    times = timer.times
    diffs = [b - a for a, b in zip(times, times[1:])]
    timed = diffs[grid.warmup_steps:]
    row["decode_steps"] = len(diffs)
    row["prefill_s"] = times[0] - timer.prompt_time if times else NAN
    if timed:
        row["decode_tokens_per_s"] = batch * len(timed) / sum(timed)
        row["ms_per_step"] = 1000 * statistics.median(timed)
    steps = acct["steps"] if not math.isnan(acct["steps"]) else len(diffs)
    if method == "offloaded":
        copied = acct["bytes_copied_per_step_estimate"]
    else:
        copied = acct["bytes_copied"] / steps if steps else NAN
    row.update(
        device_bytes_per_request=acct["device_bytes"] / batch,
        host_bytes_per_request=acct["host_bytes"] / batch,
        dense_equivalent_bytes_per_request=acct["dense_equivalent_bytes"] / batch,
        bytes_copied_per_step=copied,
        overlap_ratio=acct["overlap_ratio"], wait_seconds=acct["wait_seconds"],
        spec_hit_rate=(acct["spec_hits"] / acct["spec_steps"]) if acct["spec_steps"] else NAN,
        repaired_fraction=acct["repaired_fraction"],
    )
    return row


# ----------------------------------------------------------------------------------------------------------------
# max concurrency
# ----------------------------------------------------------------------------------------------------------------
def max_concurrency_computed(cells: list[dict], weights: int, budget_bytes: int) -> list[dict]:
    """CPU: largest batch per (method, context, budget) from measured per-request bytes plus the weights.

    `max_batch = floor((budget_bytes - weights) / device_bytes_per_request)` (activations not counted), using the
    row with the largest batch of that group. The throughput reported is the one measured at the largest batch of
    the grid not above `max_batch` (`measured_at_batch`; NaN when none is).
    """
    groups: dict[tuple, list[dict]] = {}
    for row in cells:
        if row["error"] is None:
            groups.setdefault((row["method"], row["context"], row["budget"]), []).append(row)
    out = []
    for (method, context, budget), rows in groups.items():
        per_request = max(rows, key=lambda r: r["batch"])["device_bytes_per_request"]
        room = budget_bytes - weights
        max_batch = int(room // per_request) if per_request > 0 and room > 0 else 0
        fitting = [r for r in rows if r["batch"] <= max_batch]
        best = max(fitting, key=lambda r: r["batch"]) if fitting else None
        out.append({
            "method": method, "context": context, "budget": budget, "max_batch": max_batch, "source": "computed",
            "limited_by": "device budget (computed)",
            "device_bytes_per_request": per_request, "weight_bytes": weights, "budget_bytes": budget_bytes,
            "measured_at_batch": best["batch"] if best else None,
            "decode_tokens_per_s": best["decode_tokens_per_s"] if best else NAN,
        })
    return out


def sweep_max_batch(probe: Callable[[int], dict], budget_bytes: int, cap: int) -> tuple[int, dict | None, list, str]:
    """CUDA: largest batch whose run fits `budget_bytes` of peak allocated memory, by doubling then bisection.

    Args:
        probe: runs one cell at a batch size and returns its row (with `cuda_peak_total_bytes` and `error`).
        budget_bytes: device memory budget (bytes, weights included). cap: largest batch tried.

    Returns:
        `(max_batch, row at max_batch or None, every probe row, limited_by)`; max_batch 0 when batch 1 does not
        fit; `limited_by` is what stopped the batch from growing: "device budget", "device out of memory",
        "host memory" or "cap".
    """
    probes: list[dict] = []
    first_fail: list[dict] = []

    def fits(batch: int) -> dict | None:
        row = probe(batch)
        probes.append(row)
        ok = row["error"] is None and row["cuda_peak_total_bytes"] <= budget_bytes
        if not ok and not first_fail:
            first_fail.append(row)
        return row if ok else None

    def limited_by() -> str:
        if not first_fail:
            return "cap"
        error = first_fail[0]["error"] or ""
        if error.startswith("host memory"):
            return "host memory"
        return "device out of memory" if error else "device budget"

    good, good_row, bad = 0, None, None
    batch = 1
    while batch <= cap:
        row = fits(batch)
        if row is None:
            bad = batch
            break
        good, good_row = batch, row
        batch *= 2
    if bad is None:
        return good, good_row, probes, "cap"
    while bad - good > 1:
        mid = (good + bad) // 2
        row = fits(mid)
        if row is None:
            bad = mid
        else:
            good, good_row = mid, row
    return good, good_row, probes, limited_by()


# ----------------------------------------------------------------------------------------------------------------
# the whole run
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class BenchResult:
    """Rows of a run: `cells` (one per grid cell), `max_concurrency` (one per method/context/budget), `meta`."""

    cells: list[dict] = field(default_factory=list)
    max_concurrency: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)


def run_bench(model, tokenizer, grid: BenchGrid, device_budget_gib: float | None = None, model_name: str = "",
              max_batch_cap: int = 256, sweep_new_tokens: int = 8, log: Callable[[str], None] = print) -> BenchResult:
    """Measure every cell of `grid` on `model` (already loaded), then the max concurrency when a budget is given.

    Args:
        tokenizer: None for random-weight models (random prompt ids).
        device_budget_gib: device memory budget (GiB) for the max-concurrency columns; None skips them.
        max_batch_cap: largest batch the CUDA sweep tries. sweep_new_tokens: new tokens per sweep probe.
        log: where progress lines go (each finished cell's JSON too).
    """
    grid.validate()
    device = model.device
    if grid.cpu_linear == "gemm" and device.type != "cpu":
        raise ValueError("--cpu-linear gemm is a CPU benchmark condition; use --cpu-linear stock on " + device.type)
    linears = gemm_linears(model) if grid.cpu_linear == "gemm" else contextlib.nullcontext()
    with linears:
        return _run_bench(model, tokenizer, grid, device_budget_gib, model_name, max_batch_cap, sweep_new_tokens, log)


def _run_bench(model, tokenizer, grid, device_budget_gib, model_name, max_batch_cap, sweep_new_tokens, log):
    device = model.device
    skip = skipped_methods(grid, device)
    for method, reason in skip.items():
        log(f"skip {method}: {reason}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompts = PromptSource(tokenizer, vocab, device)
    result = BenchResult(meta={
        "model": model_name, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "weight_bytes": weight_bytes(model), "grid": asdict(grid),
        "skipped": skip, "torch": torch.__version__, "python": platform.python_version(),
        "device_budget_gib": device_budget_gib, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    })
    try:
        import transformers

        result.meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        result.meta["cuda_device"] = torch.cuda.get_device_name(device)

    # untimed warm-up of each method on a short prompt (kernel selection, thread pools, lazy imports)
    short = min(min(grid.contexts), 256)
    warm = BenchGrid(**{**asdict(grid), "new_tokens": grid.warmup_steps + 3})
    for method in {m for m, *_ in grid.cells(set(skip))}:
        run_cell(model, prompts, method, short, 1, grid.budgets[0] if method in BUDGETED else None, warm,
                 model_name=model_name)

    for method, context, batch, budget in grid.cells(set(skip)):
        row = run_cell(model, prompts, method, context, batch, budget, grid, model_name=model_name)
        result.cells.append(row)
        log(json.dumps(_jsonable(row)))

    if device_budget_gib is not None:
        budget_bytes = int(device_budget_gib * GIB)
        if device.type == "cuda":
            result.max_concurrency = _sweep_all(model, prompts, grid, skip, budget_bytes, max_batch_cap,
                                                sweep_new_tokens, model_name, log)
        else:
            log("max concurrency: computed from measured per-request device bytes + weights (no CUDA to sweep on)")
            result.max_concurrency = max_concurrency_computed(result.cells, result.meta["weight_bytes"], budget_bytes)
        for row in result.max_concurrency:
            log(json.dumps(_jsonable(row)))
    return result


def _sweep_all(model, prompts, grid, skip, budget_bytes, cap, new_tokens, model_name, log) -> list[dict]:
    out = []
    for context in grid.contexts:
        for method in grid.expanded_methods():
            if method in skip:
                continue
            for budget in (grid.budgets if method in BUDGETED else (None,)):
                def probe(batch: int, method=method, budget=budget) -> dict:
                    row = run_cell(model, prompts, method, context, batch, budget, grid, new_tokens=new_tokens,
                                   model_name=model_name)
                    log(f"sweep {method} context={context} budget={budget} batch={batch}: "
                        f"peak {row['cuda_peak_total_bytes'] / GIB:.2f} GiB error={row['error']}")
                    return row

                max_batch, row, probes, limit = sweep_max_batch(probe, budget_bytes, cap)
                out.append({
                    "method": method, "context": context, "budget": budget, "max_batch": max_batch,
                    "source": "cuda sweep", "capped": limit == "cap", "limited_by": limit,
                    "device_bytes_per_request": row["device_bytes_per_request"] if row else NAN,
                    "cuda_peak_total_bytes": row["cuda_peak_total_bytes"] if row else NAN,
                    "weight_bytes": weight_bytes(model), "budget_bytes": budget_bytes,
                    "measured_at_batch": max_batch if row else None,
                    "decode_tokens_per_s": row["decode_tokens_per_s"] if row else NAN,
                    "probes": [{k: p[k] for k in ("batch", "cuda_peak_total_bytes", "decode_tokens_per_s", "error")}
                               for p in probes],
                })
    return out


def _jsonable(value):
    """NaN/inf → None so the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_result(result: BenchResult, out_dir: str, plots: bool = True, log: Callable[[str], None] = print) -> dict:
    """Write `cells.jsonl` (one JSON object per cell), `summary.json`, `table.md` and the plots under `out_dir`.

    Returns `{kind: path}` of the files written.
    """
    from . import bench_report

    os.makedirs(out_dir, exist_ok=True)
    paths = {"cells": os.path.join(out_dir, "cells.jsonl"), "summary": os.path.join(out_dir, "summary.json"),
             "table": os.path.join(out_dir, "table.md")}
    with open(paths["cells"], "w", encoding="utf-8") as handle:
        for row in result.cells:
            handle.write(json.dumps(_jsonable(row)) + "\n")
    with open(paths["summary"], "w", encoding="utf-8") as handle:
        json.dump(_jsonable(asdict(result)), handle, indent=1)
    with open(paths["table"], "w", encoding="utf-8") as handle:
        handle.write(bench_report.render_markdown(result))
    if plots:
        paths.update(bench_report.plot_all(result, out_dir, log=log))
    return paths


# ----------------------------------------------------------------------------------------------------------------
# command line (shared by `dual-decoder bench` and `python -m dual_cache.eval.bench`)
# ----------------------------------------------------------------------------------------------------------------
def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object like '{{\"early_layers\": 0}}', got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options on `parser`."""
    parser.add_argument("--model", default=None,
                        help="embedded (CPU default), llama8b (random-weight Llama-3.1-8B shape, bf16; CUDA default), "
                             "tiny (random 3-layer model), or a path / Hub id")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--methods", nargs="+", default=["all"],
                        help=f"from {', '.join(ALL_METHODS)}; aliases: dual (every speculator), all (default)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="sequences per generate() call")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="prompt tokens (default: 2048 4096 8192 on CPU, 32768 131072 on CUDA)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256],
                        help="dual / quest tokens retrieved per KV head per layer")
    parser.add_argument("--new-tokens", type=int, default=32, help="generated tokens per sequence")
    parser.add_argument("--warmup-steps", type=int, default=2, help="decode steps excluded from timings")
    parser.add_argument("--n-sink", type=int, default=4, help="dual sink tokens")
    parser.add_argument("--window", type=int, default=64, help="dual local window (tokens)")
    parser.add_argument("--prefill-chunk-size", type=int, default=8192, help="prompt tokens per prefill forward")
    parser.add_argument("--sample", action="store_true", help="sample at temperature 1 instead of greedy")
    parser.add_argument("--dual-options", type=_json_object, default={},
                        help='further DualDecoderConfig fields as JSON, e.g. \'{"early_layers": 0}\'')
    parser.add_argument("--cpu-linear", default="stock", choices=CPU_LINEARS,
                        help="CPU only: 'gemm' computes every method's few-row linears as W·xᵀ (1 row padded to 2), "
                             "the fast BLAS path on CPUs where F.linear's 2-row GEMM costs ~2x one row; "
                             "see eval/cpu_linear.py")
    parser.add_argument("--device-budget-gib", type=float, default=None,
                        help="device memory budget (GiB) for the max-concurrency table")
    parser.add_argument("--max-batch-cap", type=int, default=256, help="largest batch the CUDA sweep tries")
    parser.add_argument("--sweep-new-tokens", type=int, default=8, help="new tokens per CUDA sweep probe")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", default=None, help="output folder (default: results/bench/<device>-<model>)")
    parser.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")


def grid_from_args(args) -> BenchGrid:
    """`BenchGrid` from parsed options (contexts default by device)."""
    return BenchGrid(
        methods=tuple(args.methods), batches=tuple(args.batches), contexts=tuple(args.contexts),
        budgets=tuple(args.budgets), new_tokens=args.new_tokens, warmup_steps=args.warmup_steps,
        n_sink=args.n_sink, window=args.window, prefill_chunk_size=args.prefill_chunk_size, do_sample=args.sample,
        dual_options=dict(args.dual_options), cpu_linear=args.cpu_linear,
    )


def run_from_args(args) -> int:
    """Validate everything, then load the model, run, print the tables and write the outputs. Exit status."""
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda, but torch sees no CUDA device.")
        device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                              ("cpu" if args.device == "auto" else args.device))
        model_name = args.model or ("llama8b" if device.type == "cuda" else "embedded")
        if model_name == "llama8b" and device.type != "cuda":
            raise ValueError("--model llama8b needs --device cuda (a random 8B model in bf16).")
        if args.contexts is None:
            args.contexts = [32768, 131072] if device.type == "cuda" else [2048, 4096, 8192]
        if model_name == "embedded" or (model_name not in NAMED_MODELS):
            small = [c for c in args.contexts if c < 128]
            if small:
                raise ValueError(f"--contexts {small}: needle prompts need at least 128 tokens.")
        grid = grid_from_args(args)
        grid.validate()
        if args.device_budget_gib is not None and args.device_budget_gib <= 0:
            raise ValueError(f"--device-budget-gib must be > 0, got {args.device_budget_gib}.")
        if args.max_batch_cap < 1 or args.sweep_new_tokens < grid.warmup_steps + 3:
            raise ValueError(
                f"--max-batch-cap must be >= 1 and --sweep-new-tokens >= --warmup-steps + 3 = {grid.warmup_steps + 3}."
            )
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}.")
        skip = skipped_methods(grid, device)
        if not set(grid.expanded_methods()) - set(skip):
            raise ValueError("no method of --methods can run here: " + "; ".join(skip.values()))
        if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ValueError(f"--out {args.out} exists and is not a folder.")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = args.out or os.path.join("results", "bench", f"{device.type}-{os.path.basename(model_name)}")
    print(f"loading {model_name} on {device} ...", flush=True)
    model, tokenizer = load_bench_model(model_name, device)
    result = run_bench(model, tokenizer, grid, device_budget_gib=args.device_budget_gib, model_name=model_name,
                       max_batch_cap=args.max_batch_cap, sweep_new_tokens=args.sweep_new_tokens)
    from . import bench_report

    print()
    print(bench_report.render_markdown(result))
    paths = write_result(result, out_dir, plots=not args.no_plots)
    print("wrote " + ", ".join(paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dual_cache.eval.bench [options]` (same options as `dual-decoder bench`)."""
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
