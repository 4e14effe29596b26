"""One benchmark cell: one `generate()` of `batch` prompts of `context` tokens, timed per step, its memory, the
cache's telemetry and the launch thread's synchronization points and blocked time per step (`launch_thread.py`) as
one row (keys `COLUMNS`; see `bench.py` for what each column means)."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...cache.cache import available_host_bytes
from ...generate.timing import TimingStreamer
from ...runtime.progress import GenerationProgress
from .bench_accounting import cache_accounting
from .bench_grid import BUDGETED, FORCED_MISS, BenchGrid
from .bench_models import PromptSource, kv_bytes_estimate
from .launch_thread import StepProbe

NAN = float("nan")
GIB = 1024 ** 3

# every key a cell row carries (tests check all of them are present)
COLUMNS = (
    "method", "model", "device", "dtype", "context", "batch", "budget", "new_tokens", "decode_steps",
    "prefill_s", "decode_tokens_per_s", "ms_per_step",
    "device_bytes_per_request", "cuda_peak_bytes_per_request", "cuda_decode_peak_bytes_per_request",
    "cuda_peak_total_bytes", "cuda_decode_peak_total_bytes", "host_bytes_per_request",
    "dense_equivalent_bytes_per_request", "bytes_copied_per_step", "bytes_copied_per_sequence_step",
    "host_core_ms_per_sequence_step", "resident_share", "overlap_ratio", "idle_copy_fraction",
    "idle_host_fraction", "wait_seconds", "sync_points_per_step", "sync_points_by_op", "blocked_ms_per_step",
    "spec_hit_rate", "spec_row_hit_rate_min", "repaired_fraction", "forced_miss_rate", "prompts", "temperature",
    "top_p", "threads", "error",
)


@dataclass
class StepTimer(TimingStreamer):
    """`TimingStreamer` that also records when `generate()` hands over the prompt (`prompt_time`, seconds) and marks
    each generated token on `probe` (the launch thread's synchronization points and blocked time per step, read from
    `cache`'s wait clock; `launch_thread.StepProbe`).

    With `cuda_device` set, it records the peak allocated bytes up to the first generated token (`prefill_peak`)
    and resets the peak counter there, so `torch.cuda.max_memory_allocated()` afterwards is the decode-phase peak.
    """

    prompt_time: float = NAN
    cuda_device: torch.device | None = None
    prefill_peak: int = 0
    probe: StepProbe | None = None
    cache: Any = None

    def put(self, value):
        if not self._prompt_seen:
            self.prompt_time = time.perf_counter()
        else:
            if not self.times and self.cuda_device is not None:
                self.prefill_peak = torch.cuda.max_memory_allocated(self.cuda_device)
                torch.cuda.reset_peak_memory_stats(self.cuda_device)
            if self.probe is not None:
                self.probe.mark(self.cache)
        super().put(value)


def is_oom(error: BaseException) -> bool:
    """True for torch's out-of-memory errors (device allocations, incl. a `set_per_process_memory_fraction` cap)."""
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
        threads=torch.get_num_threads(), prompts=grid.prompts, temperature=grid.temperature,
        top_p=grid.top_p if grid.temperature > 0 else NAN, sync_points_by_op={},
        forced_miss_rate=grid.forced_miss_rate if method == FORCED_MISS else NAN,
    )
    row.update(extra)
    return row


def _generate_kwargs(model, method: str, budget: int | None, grid: BenchGrid, prompt_len: int, new_tokens: int,
                     host_limit_bytes: int | None) -> dict[str, Any]:
    """`generate()` keyword arguments of a cell: a dual / quest cell's cache as an object (`DualDecoderCache`, or a
    `ForcedMissCache`; the step timer reads its wait clock), the baselines' by name, and the decoding settings (the
    global torch generator seeded with 0 when sampling)."""
    kwargs: dict[str, Any] = {}
    if method in BUDGETED:
        config = grid.cache_config(method, budget)
        if host_limit_bytes is not None:
            config.setdefault("max_host_bytes", int(host_limit_bytes))
        max_cache_len = prompt_len + new_tokens + 2  # as generate(cache_implementation="dual") sizes it
        if method == FORCED_MISS:
            from .forced_miss import ForcedMissCache

            kwargs["cache"] = ForcedMissCache(model.config, max_cache_len=max_cache_len,
                                              miss_rate=grid.forced_miss_rate, **config)
        else:
            from ...cache.cache import DualDecoderCache

            kwargs["cache"] = DualDecoderCache(model.config, max_cache_len=max_cache_len, **config)
    else:
        if method == "offloaded":
            kwargs["cache_implementation"] = "offloaded"
        if prompt_len > grid.prefill_chunk_size:
            kwargs["prefill_chunk_size"] = grid.prefill_chunk_size
    kwargs.update(grid.sampling_kwargs())
    if grid.temperature > 0:
        torch.manual_seed(0)
    return kwargs


def run_cell(model, prompts: PromptSource, method: str, context: int, batch: int, budget: int | None,
             grid: BenchGrid, new_tokens: int | None = None, model_name: str = "",
             host_limit_bytes: int | None = None, keep_going: bool = False, progress: bool = False) -> dict:
    """Run one `generate()` and return its row (keys `COLUMNS`); running out of device or host memory sets `error`
    ("out of memory: ...", "host memory: ...") instead of raising.

    Args:
        new_tokens: overrides `grid.new_tokens`.
        host_limit_bytes: host memory the cell's KV may use (bytes): a cell whose full KV would exceed it is not
            run (`error` "host memory: ..."), and dual / quest caches get it as `max_host_bytes`. None: 85% of the
            host memory available now.
        keep_going: record any other exception as `error` "failed: ..." instead of raising.
        progress: draw the cell's prefill (by layer) and decode (by token) on stderr
            (`dual_cache.runtime.progress.GenerationProgress`).
    """
    import dual_cache  # noqa: F401  (registers cache_implementation="dual")

    device = model.device
    new_tokens = grid.new_tokens if new_tokens is None else new_tokens
    row = empty_row(method, context, batch, budget, grid, model=model_name, device=device.type,
                    dtype=str(model.dtype).removeprefix("torch."), new_tokens=new_tokens)
    ids, mask = prompts.batch(batch, context)
    row["context"] = ids.shape[1]

    needs_host = method != "dense" or device.type == "cpu"
    estimate = kv_bytes_estimate(model.config, batch, ids.shape[1] + new_tokens, model.dtype)
    limit = host_limit_bytes if host_limit_bytes is not None else 0.85 * available_host_bytes()
    if needs_host and estimate > limit:
        row["error"] = (f"host memory: the KV cache needs ~{estimate / GIB:.1f} GiB, more than the "
                        f"{limit / GIB:.1f} GiB allowed")
        return row

    cuda = device.type == "cuda"
    _free_device(device, collect=cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    probe = StepProbe()
    bars = GenerationProgress(model, ids.shape[1], grid.prefill_chunk_size, new_tokens, enabled=progress)
    timer = StepTimer(cuda_device=device if cuda else None, probe=probe, inner=bars)
    out = cache = None
    failed = None
    kwargs: dict[str, Any] = {}
    try:
        kwargs = _generate_kwargs(model, method, budget, grid, ids.shape[1], new_tokens, host_limit_bytes)
        timer.cache = kwargs.get("cache")
        with bars, probe.counting() if grid.count_sync_points else contextlib.nullcontext():
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
            row["cuda_decode_peak_total_bytes"] = decode_peak
            row["cuda_peak_bytes_per_request"] = (peak - base) / batch
            row["cuda_decode_peak_bytes_per_request"] = (decode_peak - base) / batch
        acct = cache_accounting(method, cache)
    except MemoryError as error:  # dual_cache.HostMemoryError: the host stores would pass max_host_bytes
        failed = f"host memory: {str(error).splitlines()[0][:200]}"
    except Exception as error:  # noqa: BLE001  (out of memory is recorded; anything else is a bug ...)
        if is_oom(error):
            failed = f"out of memory: {str(error).splitlines()[0][:200]}"
        elif keep_going:  # ... recorded only when asked, so one broken method does not end a long device run
            failed = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        else:
            raise
    if hasattr(kwargs.get("cache"), "close"):
        kwargs["cache"].close()  # its host stores go now (after the accounting above, which the close freezes)
    del out, cache
    timer.cache = None
    kwargs.clear()  # an explicit cache object goes with the call's other references
    _free_device(device)
    if failed is not None:
        row["error"] = failed
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
        bytes_copied_per_sequence_step=copied / batch,
        host_core_ms_per_sequence_step=1000 * acct["retrieval_cpu_seconds"] / (steps * batch) if steps else NAN,
        resident_share=acct["resident_share"],
        overlap_ratio=acct["overlap_ratio"], idle_copy_fraction=acct["idle_copy_fraction"],
        idle_host_fraction=acct["idle_host_fraction"], wait_seconds=acct["wait_seconds"],
        spec_hit_rate=(acct["spec_hits"] / acct["spec_steps"]) if acct["spec_steps"] else NAN,
        spec_row_hit_rate_min=acct["spec_row_hit_rate_min"],
        repaired_fraction=acct["repaired_fraction"],
    )
    if method != "offloaded":  # transformers' offloaded cache waits for its layer copies on no clock of its own
        row.update(probe.summary(skip=grid.warmup_steps))
    return row
