"""Throughput and memory benchmark: dense vs offloaded vs dual (vs Quest) over method × batch × context × budget,
and each method's throughput at its max batch under a device-memory cap and the host memory available.

Run it as `dual-decoder bench ...` (see `bench_cli.py`) or `python -m dual_cache.eval.throughput.bench ...`. The parts:
`bench_grid.py` (methods, grid), `bench_models.py` (models, prompts), `bench_cell.py` (one timed `generate()`),
`bench_accounting.py` (cache bytes), `bench_capacity.py` (max-batch search), `bench_report.py` (tables, plots),
`forced_miss.py` (the benchmark-only forced miss rate); this file runs a whole grid and holds the command line.

Per cell (one `generate()` call of `batch` prompts of `context` tokens (`--prompts`: needle questions or natural
text, one seed per row), `new_tokens` new tokens each; run `--repeats`
times, round by round with the methods of a context and batch in a rotated order, the timings reported as the median
of the runs with `<field>_min` / `<field>_max` beside it, `eval/spread.py`) it records:

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
  call's peak including weights (what the max-batch search compares with the device cap),
  `cuda_decode_peak_total_bytes` the decode phase's; NaN on CPU;
- `host_bytes_per_request`: KV bytes in host memory per sequence (dual host store; offloaded: the whole cache);
- `bytes_copied_per_step`: host→device bytes per decode step for the whole batch (dual: the resident sets' deltas;
  offloaded: every layer is prefetched once per step, so the whole cache at its final size; dense: 0), and
  `bytes_copied_per_sequence_step` the same per sequence: with the link's bandwidth R, the method's ceiling is R /
  this many sequence-steps per second;
- `host_core_ms_per_sequence_step`: host CPU milliseconds of selection (the retrieval jobs' thread CPU time, every
  thread of the native engine counted: `cache.stats()["retrieval_cpu_seconds"]`) per decode step and sequence: with
  N host cores the method's ceiling is N / this many sequence-steps per second (0 for dense); `resident_share`: the
  share of the entries the steps wanted resident that already were (dual only);
- `overlap_ratio`, `wait_seconds`: the dual pipeline's telemetry (`cache.stats()`), NaN where absent; on CUDA
  `idle_copy_fraction` and `idle_host_fraction`, the shares of the device's step time it idled waiting for selection
  copies and without work while the launch thread waited on host selection (`overlap_ratio` is 1 − their sum);
- `sync_points_per_step`: the launch thread's synchronization points per decode step after the warm-up steps (mean;
  `dual_cache.runtime.sync_points.SyncCounter` around `generate()`, read at each generated token), and
  `sync_points_by_op` the same by operation; NaN for `offloaded` and with counting off (`BenchGrid.count_sync_points`);
- `blocked_ms_per_step`: milliseconds per decode step after the warm-up steps (mean) the launch thread waited for
  host selection (the dual cache's `wait_seconds`: retrieval it ran in line or waited for, a CPU device's copies,
  synchronous miss repairs; 0 for dense, which never selects; NaN for `offloaded`; `launch_thread.py` defines it);
- `spec_hit_rate`: speculated tokens equal to the real next token / speculated tokens (dual only);
  `spec_row_hit_rate_min`: the worst sequence's own hit rate (the table shows it in parentheses);
- `repaired_fraction`: decode steps in which miss repair redid any selection (a miss, or a drifted query on a hit:
  `repair_drift`) / decode steps (dual only; `miss_repair`); `forced_miss_rate`: `dual-forced-miss` only;
- `prompts`, `temperature`, `top_p`: the prompts (`needle` or `natural`) and the decoding (temperature 0: greedy).

Max batch (`--device-budget-gib` and / or `--host-budget-gib`): for each method, context and budget, the largest
batch that fits the device cap and the host memory, found and measured by `bench_capacity.find_max_batch`; its
decode tokens/s, ms/step and time to first token are measured at that batch (or extrapolated, and labelled so, when
the run would exceed `--max-cell-seconds`), and the table compares each method at its own max batch with the best
baseline (dense, offloaded, Quest) at its own.

Timings go only to the printed table and the JSON files; tests check columns and memory accounting, never speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict
from typing import Callable

import torch
from tqdm.auto import tqdm

from ...cache.cache import available_host_bytes
from ...config import DualDecoderConfig
from ...runtime.progress import shown
from .. import spread
from ..outputs import default_out
from .bench_capacity import GIB, MemoryLimits, apply_device_cap, find_max_batch
from .bench_cell import run_cell
from .bench_grid import ALL_METHODS, CPU_LINEARS, PROMPT_KINDS, BenchGrid, skipped_methods
from .bench_models import NAMED_MODELS, PromptSource, load_bench_model, weight_bytes
from .bench_result import BenchResult
from .cpu_linear import gemm_linears


TIMED = ("prefill_s", "decode_tokens_per_s", "ms_per_step", "overlap_ratio", "idle_copy_fraction", "idle_host_fraction",
         "wait_seconds", "blocked_ms_per_step", "sync_points_per_step")  # vary between runs


def run_bench(model, tokenizer, grid: BenchGrid, limits: MemoryLimits | None = None, model_name: str = "",
              max_batch_cap: int = 256, max_cell_seconds: float | None = None, log: Callable[[str], None] = print,
              on_progress: Callable[[BenchResult], None] | None = None, keep_going: bool = False,
              repeats: int = 1, max_batch: bool = True, progress: bool = False) -> BenchResult:
    """Measure every cell of `grid` on `model` (already loaded), with `limits` each method's max batch first.

    Args:
        tokenizer: None for random-weight models (random prompt ids).
        limits: device cap and host memory for the max-batch search and for every cell (a device cap on CUDA must
            already be applied, `bench_capacity.apply_device_cap`); None: no search, each cell's host memory
            limited to 85% of what is available when it starts.
        max_batch: False measures the grid alone (each cell still within `limits`), without the search.
        max_batch_cap: largest batch the search considers. max_cell_seconds: see `find_max_batch`.
        log: where progress lines go (each finished cell's JSON too).
        on_progress: called with the result so far after each cell and each max-batch row (e.g. to write files,
            so an interrupted run keeps what it measured).
        keep_going: a cell failing for another reason than memory is recorded (`error` "failed: ...") and the run
            goes on, instead of raising.
        repeats: runs of every grid cell, round by round, the methods of a context and batch in an order rotated
            each round (`eval/spread.py`); a cell's row holds the median of its timings (`TIMED`) and their
            `<field>_min` / `<field>_max`. The max-batch search measures each batch it probes once.
        progress: draw progress bars on stderr (`dual_cache.runtime.progress`): the cells ("cell k of N" and the cell's
            name; the max-batch search's probes are named, not counted) and, inside each cell, its prefill by layer
            and decode by token. `log` lines are then written above the bars.

    Raises:
        ValueError: `repeats` < 1, or what `grid.validate()` raises.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}.")
    grid.validate()
    device = model.device
    if grid.cpu_linear == "gemm" and device.type != "cpu":
        raise ValueError("--cpu-linear gemm is a CPU benchmark condition; use --cpu-linear stock on " + device.type)
    linears = gemm_linears(model) if grid.cpu_linear == "gemm" else contextlib.nullcontext()
    with linears:
        cells = len(grid.cells(set(skipped_methods(grid, model.device)))) * repeats
        bar = tqdm(total=cells, desc="bench", unit="cell", file=sys.stderr, dynamic_ncols=True) if progress else None
        try:
            return _run_bench(model, tokenizer, grid, limits, model_name, max_batch_cap, max_cell_seconds,
                              log if bar is None else tqdm.write, on_progress or (lambda result: None), keep_going,
                              repeats, max_batch, bar)
        finally:
            if bar is not None:
                bar.close()


def _run_bench(model, tokenizer, grid, limits, model_name, max_batch_cap, max_cell_seconds, log, on_progress,
               keep_going, repeats, max_batch, bar=None):
    device = model.device
    skip = skipped_methods(grid, device)
    for method, reason in skip.items():
        log(f"skip {method}: {reason}")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompts = PromptSource(tokenizer, vocab, device, kind=grid.prompts)
    weights = weight_bytes(model)
    result = BenchResult(meta={
        "model": model_name, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "weight_bytes": weights, "grid": asdict(grid),
        "skipped": skip, "torch": torch.__version__, "python": platform.python_version(),
        "limits": asdict(limits) if limits else None, "max_cell_seconds": max_cell_seconds,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "repeats": repeats, "cores": os.cpu_count(),
        "load_average_max": spread.load_average(),
    })
    try:
        import transformers

        result.meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        result.meta["cuda_device"] = torch.cuda.get_device_name(device)
    host_limit = limits.host_bytes if limits else None

    # untimed warm-up of each method on a short prompt (kernel selection, thread pools, lazy imports)
    short = min(min(grid.contexts), 256)
    warm = BenchGrid(**{**asdict(grid), "new_tokens": grid.warmup_steps + 3})
    for method in dict.fromkeys(m for m, *_ in grid.cells(set(skip))):
        run_cell(model, prompts, method, short, 1, grid.budgets_of(method)[0], warm, model_name=model_name,
                 host_limit_bytes=host_limit, keep_going=keep_going)

    measured: dict[tuple, list[dict]] = {}  # cell -> its runs, in the order cells were first measured

    def measure(key: tuple, counted: bool = True) -> None:
        method, context, batch, budget = key
        if bar is not None:
            name = f"{method}{'' if budget is None else f'@{budget}'} {context} tokens × {batch}"
            where = f"cell {bar.n + 1} of {bar.total}" if counted else "max-batch search"
            bar.set_description(f"{where}: {name}")
        row = run_cell(model, prompts, method, context, batch, budget, grid, model_name=model_name,
                       host_limit_bytes=host_limit, keep_going=keep_going, progress=bar is not None)
        if bar is not None and counted:
            bar.update(1)
        measured.setdefault(key, []).append(row)
        result.cells = [spread.merge_runs(runs, TIMED) for runs in measured.values()]
        load, highest = spread.load_average(), result.meta["load_average_max"]
        if math.isfinite(load) and not load <= highest:  # `not <=`: also replaces a NaN
            result.meta["load_average_max"] = load
        log(json.dumps(_jsonable(row)))
        on_progress(result)

    def cell(method: str, context: int, batch: int, budget: int | None) -> dict:
        key = (method, context, batch, budget)
        if key not in measured:
            measure(key, counted=key in grid_cells)
        return spread.merge_runs(measured[key], TIMED)

    grid_cells = set(grid.cells(set(skip)))
    warning = spread.load_warning(result.meta["load_average_max"])
    if warning:
        log(warning)
    if limits is not None and max_batch:  # method by method: each one's max-batch row lands before the next starts
        for context in grid.contexts:
            for method in grid.expanded_methods():
                if method in skip:
                    continue
                for budget in grid.budgets_of(method):
                    found = find_max_batch(lambda batch: cell(method, context, batch, budget), limits, weights,
                                           cap=max_batch_cap, max_cell_seconds=max_cell_seconds)
                    found.update(method=method, context=context, budget=budget,
                                 forced_miss_rate=measured[(method, context, 1, budget)][0]["forced_miss_rate"])
                    result.max_batch.append(found)
                    log(json.dumps(_jsonable({k: v for k, v in found.items() if k != "runs"})))
                    on_progress(result)
    cells = grid.cells(set(skip))
    for round_ in range(repeats):  # every cell once per round; the methods of a context and batch rotate
        for key in spread.rotated(cells, round_, group=lambda c: (c[1], c[2])):
            if len(measured.get(key, [])) <= round_:
                measure(key)
    warning = spread.load_warning(result.meta["load_average_max"])
    if warning:
        log(warning)
    return result


def _jsonable(value):
    """NaN/inf → None so the JSON stays standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_result(result: BenchResult, out_dir: str, plots: bool = True, cells_jsonl: bool = True,
                 log: Callable[[str], None] = print, table: bool = True) -> dict:
    """Write `cells.jsonl` (one JSON object per cell; `summary.json` holds the same rows), `summary.json`,
    `table.md` and the plots under `out_dir` (`summary.json` always, the others as asked).

    Returns `{kind: path}` of the files written.
    """
    from . import bench_report

    os.makedirs(out_dir, exist_ok=True)
    paths = {"summary": os.path.join(out_dir, "summary.json")}
    if table:
        paths["table"] = os.path.join(out_dir, "table.md")
    if cells_jsonl:
        paths["cells"] = os.path.join(out_dir, "cells.jsonl")
        with open(paths["cells"], "w", encoding="utf-8") as handle:
            for row in result.cells:
                handle.write(json.dumps(_jsonable(row)) + "\n")
    with open(paths["summary"], "w", encoding="utf-8") as handle:
        json.dump(_jsonable(asdict(result)), handle, indent=1)
    if table:
        with open(paths["table"], "w", encoding="utf-8") as handle:
            handle.write(bench_report.render_markdown(result))
    if plots:
        paths.update(bench_report.plot_all(result, out_dir, log=log))
    return paths


# ----------------------------------------------------------------------------------------------------------------
# command line (shared by `dual-decoder bench` and `python -m dual_cache.eval.throughput.bench`)
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
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (auto: CUDA when available)")
    parser.add_argument("--methods", nargs="+", default=["all"],
                        help=f"from {', '.join(ALL_METHODS)}, run in this order (dual-self: the library defaults, "
                             "the registry's dual; dual-sync-repair: the default before issue 57); aliases: dual "
                             "(every speculator), all (default: every method but dual-no-repair, dual-sync-repair "
                             "and dual-forced-miss)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1], help="sequences per generate() call")
    parser.add_argument("--contexts", type=int, nargs="+", default=None,
                        help="prompt tokens (default: 2048 4096 8192 on CPU, 32768 131072 on CUDA)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[DualDecoderConfig.budget],
                        help="dual / quest tokens retrieved per KV head per layer")
    parser.add_argument("--new-tokens", type=int, default=32, help="generated tokens per sequence")
    parser.add_argument("--warmup-steps", type=int, default=2, help="decode steps excluded from timings")
    parser.add_argument("--n-sink", type=int, default=DualDecoderConfig.n_sink, help="dual sink tokens")
    parser.add_argument("--window", type=int, default=DualDecoderConfig.window, help="dual local window (tokens)")
    parser.add_argument("--prefill-chunk-size", type=int, default=DualDecoderConfig.prefill_chunk_size,
                        help="prompt tokens per prefill forward")
    parser.add_argument("--prompts", default="needle", choices=PROMPT_KINDS,
                        help="needle: a word-needle question over the Python reference per row; natural: a passage of "
                             "the RULER essay haystack per row, asked to be continued (eval/quality/natural_text.py); "
                             "rows use seeds 0, 1, ... (random ids for random-weight models, which refuse natural)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sample at this temperature (top-k off; the torch generator seeded with 0 per cell); "
                             "default greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept when sampling (1: off)")
    parser.add_argument("--sample", action="store_true", help="the same as --temperature 1")
    parser.add_argument("--no-sync-points", action="store_true",
                        help="do not count the launch thread's synchronization points (counted by default, during "
                             "the timed runs: a TorchFunctionMode that adds Python work to every torch call, so "
                             "compare timings with it off)")
    parser.add_argument("--dual-options", type=_json_object, default={},
                        help='further DualDecoderConfig fields as JSON, e.g. \'{"early_layers": 0}\'')
    parser.add_argument("--forced-miss-rate", type=float, default=None,
                        help="dual-forced-miss: fraction of live sequences repaired per step, as if their speculated "
                             "token missed (benchmark only; eval/throughput/forced_miss.py)")
    parser.add_argument("--cpu-linear", default="stock", choices=CPU_LINEARS,
                        help="CPU only: 'gemm' computes every method's few-row linears as W·xᵀ (1 row padded to 2), "
                             "the fast BLAS path on CPUs where F.linear's 2-row GEMM costs ~2x one row; "
                             "see eval/throughput/cpu_linear.py")
    parser.add_argument("--device-budget-gib", type=float, default=None,
                        help="device memory cap (GiB, weights included) for the max-batch table; on CUDA this "
                             "process's allocations are capped there (one large GPU stands in for a smaller one)")
    parser.add_argument("--host-budget-gib", type=float, default=None,
                        help="host memory the KV may use for the max-batch table (GiB; on CPU everything, the device "
                             "being the host); default 90%% of the host memory available at the start")
    parser.add_argument("--max-batch-cap", type=int, default=256, help="largest batch the max-batch search considers")
    parser.add_argument("--max-cell-seconds", type=float, default=None,
                        help="max-batch runs predicted to take longer are not made; their throughput is extrapolated "
                             "from the measured batches and labelled so (default: always measure)")
    parser.add_argument("--keep-going", action="store_true",
                        help="record a cell that fails for another reason than memory (error 'failed: ...') and go on")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of every cell, the methods interleaved (rotated each round); cells report the "
                             "median and the min-max of their runs")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bars (cells, and each cell's prefill and decode; drawn on stderr only when "
                             "it is a terminal)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: a new eval-results/bench/<device>-<model>-<time>/; "
                             "the project's record is results/bench/, written only when --out names it)")
    parser.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")
    parser.add_argument("--no-cells-jsonl", action="store_true",
                        help="skip cells.jsonl (summary.json holds the same rows; fewer files to bring back)")
    parser.add_argument("--summary-only", action="store_true",
                        help="write summary.json alone, after every cell (no cells.jsonl, table.md or plots; the "
                             "tables are printed): one file to bring back")
    parser.add_argument("--no-max-batch", action="store_true",
                        help="with --device-budget-gib / --host-budget-gib: measure the --batches grid alone, "
                             "each cell within those limits, without the max-batch search")


def grid_from_args(args) -> BenchGrid:
    """`BenchGrid` from parsed options (contexts default by device)."""
    return BenchGrid(
        methods=tuple(args.methods), batches=tuple(args.batches), contexts=tuple(args.contexts),
        budgets=tuple(args.budgets), new_tokens=args.new_tokens, warmup_steps=args.warmup_steps,
        n_sink=args.n_sink, window=args.window, prefill_chunk_size=args.prefill_chunk_size,
        temperature=temperature_from_args(args), top_p=args.top_p, prompts=args.prompts,
        dual_options=dict(args.dual_options), forced_miss_rate=args.forced_miss_rate, cpu_linear=args.cpu_linear,
        count_sync_points=not args.no_sync_points,
    )


def temperature_from_args(args) -> float:
    """The sampling temperature of `--temperature` / `--sample` (0: greedy).

    Raises:
        ValueError: both given with different temperatures.
    """
    if args.sample:
        if args.temperature is not None and args.temperature != 1.0:
            raise ValueError(f"--sample means --temperature 1; drop it to sample at {args.temperature}.")
        return 1.0
    return 0.0 if args.temperature is None else args.temperature


def limits_from_args(args, device: torch.device) -> MemoryLimits | None:
    """The limits of the max-batch search and of every cell (None without `--device-budget-gib` /
    `--host-budget-gib`)."""
    if args.device_budget_gib is None and args.host_budget_gib is None:
        return None
    host = args.host_budget_gib * GIB if args.host_budget_gib is not None else 0.9 * available_host_bytes()
    device_cap = args.device_budget_gib * GIB if args.device_budget_gib is not None else None
    return MemoryLimits(device_bytes=None if device_cap is None else int(device_cap), host_bytes=int(host),
                        shared=device.type == "cpu")


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
                raise ValueError(f"--contexts {small}: needle and natural-text prompts need at least 128 tokens.")
        elif args.prompts == "natural":
            raise ValueError(f"--prompts natural needs a model with a tokenizer; --model {model_name} is random "
                             "weights (random prompt ids): use --model embedded or a path / Hub id.")
        grid = grid_from_args(args)
        grid.validate()
        for name in ("device_budget_gib", "host_budget_gib", "max_cell_seconds"):
            value = getattr(args, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}.")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}.")
        if args.no_max_batch and args.device_budget_gib is None and args.host_budget_gib is None:
            raise ValueError("--no-max-batch keeps the grid within --device-budget-gib / --host-budget-gib; give "
                             "one of them (without them there is no max-batch search to skip).")
        if args.max_batch_cap < 1:
            raise ValueError(f"--max-batch-cap must be >= 1, got {args.max_batch_cap}.")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}.")
        skip = skipped_methods(grid, device)
        if not set(grid.expanded_methods()) - set(skip):
            raise ValueError("no method of --methods can run here: " + "; ".join(skip.values()))
        if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
            raise ValueError(f"--out {args.out} exists and is not a folder.")
        limits = limits_from_args(args, device)
        if limits and limits.device_bytes is not None and device.type == "cuda":
            apply_device_cap(device, limits.device_bytes)  # raises ValueError past the device's memory
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = args.out or default_out("bench", f"{device.type}-{os.path.basename(model_name)}")
    print(f"loading {model_name} on {device} ...", flush=True)
    model, tokenizer = load_bench_model(model_name, device)
    files = {"cells_jsonl": not (args.no_cells_jsonl or args.summary_only), "table": not args.summary_only}
    result = run_bench(model, tokenizer, grid, limits=limits, model_name=model_name,
                       max_batch_cap=args.max_batch_cap, max_cell_seconds=args.max_cell_seconds,
                       keep_going=args.keep_going, repeats=args.repeats, max_batch=not args.no_max_batch,
                       on_progress=lambda partial: write_result(partial, out_dir, plots=False, **files),
                       progress=shown(args.quiet))
    from . import bench_report

    print()
    print(bench_report.render_markdown(result))
    paths = write_result(result, out_dir, plots=not (args.no_plots or args.summary_only), **files)
    print("wrote " + ", ".join(paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m dual_cache.eval.throughput.bench [options]` (same options as `dual-decoder bench`)."""
    parser = argparse.ArgumentParser(prog="python -m dual_cache.eval.throughput.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
