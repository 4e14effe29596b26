"""`dual-decoder bench-serve`: a Poisson stream of long-context requests with mixed output lengths, served by

- `dual`: the scheduler with the dual cache (`Scheduler`);
- `dense`: the same scheduler with transformers' default `DynamicCache` rows;
- `static`: static batches of `generate()` with the dual cache, in arrival order (a batch starts when its last
  request has arrived and the previous batch is done, and runs until its longest request ends);
- `generate-batch`: transformers' continuous batching (`init_continuous_batching`, paged cache), the anchor.

Reports output tokens/s (all output tokens / first arrival to last finish), time to first token and time per output
token (p50 / p99, seconds), the peak KV bytes on the device and in host memory, the speculation hit rate (dual
cache systems: speculated tokens equal to the real one / speculated tokens) and, per decode step of the running
batch, the launch thread's synchronization points and the milliseconds it was blocked waiting for host selection
(`eval/throughput/launch_thread.py`: the scheduler's loop thread for `dual` / `dense`, the thread calling
`generate()` for `static`; not measured for `generate-batch`), one row per system, to stdout and to `<out>.json` /
`<out>.md` (default: a new file under the git-ignored eval-results/bench-serve/). Every system gets the same prompts
(`--prompts`: random token ids, or natural-text passages asked to be continued), arrival times, max_tokens and
decoding (`--temperature`, `--top-p`; greedy by default). With `--repeats N` the systems run N rounds, in an order
rotated each round (`eval/spread.py`); each row holds the medians of its runs, with `<field>_min` / `<field>_max`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
import threading
import time

import torch

from ...cli.help_format import DefaultsHelpFormatter
from ...config import DualDecoderConfig
from ...serving.rows import GREEDY_BELOW
from .. import spread
from ..options import add_sampling_options
from ..outputs import default_out, write_rows_and_table
from ..quality.natural_text import natural_prompt_ids
from ..spread import with_range
from .bench_grid import decoding_text
from .launch_thread import StepProbe

SYSTEMS = ("dual", "dense", "static", "generate-batch")
PROMPT_KINDS = ("random", "natural")
TIMED = ("seconds", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "spec_hit_rate",
         "sync_points_per_step", "blocked_ms_per_step")  # every field that varies between runs


def workload(args, vocab: int, special: set[int], tokenizer=None) -> list[dict]:
    """Prompts, arrival offsets (seconds, Poisson at `--rate`) and max_tokens (uniform in [`--min-new`, `--max-new`]).

    `--prompts random`: `--context` token ids drawn uniformly from the vocabulary less `special` (with
    `--shared-prefix`, all but the last 64 shared); `natural`: per request a passage of the RULER essay haystack asked
    to be continued, about `--context` tokens in the model's chat format (`eval/quality/natural_text.py`, seed
    `--seed` + the request's index). The arrivals and max_tokens are the same for either kind (the random ids are
    drawn either way).

    Raises:
        ValueError: natural prompts without a tokenizer (before anything is drawn), or longer than the document.
    """
    if args.prompts == "natural" and tokenizer is None:
        raise ValueError("--prompts natural needs a model with a tokenizer; use --prompts random for this model.")
    gen = torch.Generator().manual_seed(args.seed)
    allowed = torch.tensor([t for t in range(vocab) if t not in special])
    draw = lambda n: allowed[torch.randint(len(allowed), (n,), generator=gen)]  # noqa: E731
    shared = draw(args.context - 64) if args.shared_prefix else None
    at, requests = 0.0, []
    for i in range(args.requests):
        prompt = torch.cat([shared, draw(64)]) if shared is not None else draw(args.context)
        if args.prompts == "natural":
            prompt = torch.tensor(natural_prompt_ids(tokenizer, args.context, args.seed + i), dtype=torch.long)
        new = int(torch.randint(args.min_new, args.max_new + 1, (1,), generator=gen))
        requests.append({"prompt": prompt, "max_tokens": new, "at": at, "seed": args.seed + i})
        at += float(torch.empty(1).exponential_(args.rate, generator=gen))
    return requests


def sampling_kwargs(args) -> dict:
    """`generate()`'s / `GenerationConfig`'s decoding arguments for `--temperature` / `--top-p` (0: greedy; top-k
    off when sampling, not transformers' default 50)."""
    if args.temperature == 0:
        return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
    return {"do_sample": True, "temperature": args.temperature, "top_k": 0, "top_p": args.top_p}


def run_scheduler(model, requests, args, dense: bool) -> list[dict]:
    from ...serving.requests import GenerationOptions
    from ...serving.scheduler import Scheduler

    probe = StepProbe(count=not args.no_sync_points)
    scheduler = Scheduler(model, cache_config=args.cache_config, dense=dense, max_batch=args.max_batch,
                          prefix_block=0 if dense else args.prefix_block, step_probe=probe)
    peak = {"device": 0, "host": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            m = scheduler.metrics()  # dense rows: the DynamicCache K/V on the device (DenseBatch.memory)
            peak["device"] = max(peak["device"], m["device_bytes"])
            peak["host"] = max(peak["host"], m["host_bytes"])

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    handles = []
    try:
        for request in requests:
            time.sleep(max(0.0, start + request["at"] - time.perf_counter()))
            handles.append(scheduler.add_request(request["prompt"], GenerationOptions(
                max_tokens=request["max_tokens"], temperature=args.temperature, top_p=args.top_p,
                seed=request["seed"] if args.temperature > 0 else None)))
        for handle in handles:
            handle.wait()
    finally:
        done.set()
        sampler.join()
        scheduler.stop()
    batching = {"decode_steps": scheduler.counters["decode_steps"], "regroups": scheduler.counters["regroups"],
                "spec_hit_rate": math.nan if dense else scheduler.metrics()["spec_hit_rate"], **probe.summary()}
    return [{"arrived": h.arrived - start, "first": h.first_token - start, "finished": h.finished - start,
             "tokens": len(h.token_ids), "error": h.error, **({"peak": peak, **batching} if i == 0 else {})}
            for i, h in enumerate(handles)]


def run_static(model, requests, args, pad_id: int) -> list[dict]:
    from ...cache.cache import DualDecoderCache

    out, start = [], time.perf_counter()
    peak = {"device": 0, "host": 0}
    spec = {"hits": 0, "steps": 0}
    probe = StepProbe()  # a step: the interval between two of generate()'s tokens (`mark`, from the streamer)
    for first in range(0, len(requests), args.max_batch):
        batch = requests[first:first + args.max_batch]
        time.sleep(max(0.0, start + batch[-1]["at"] - time.perf_counter()))
        width = max(r["prompt"].numel() for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - r["prompt"].numel():] = r["prompt"]
            mask[row, width - r["prompt"].numel():] = 1
        first_token = []
        cache = DualDecoderCache(model.config, dual_config=args.cache_config)

        class Streamer:
            calls = 0

            def put(self, value):
                Streamer.calls += 1
                if Streamer.calls == 2:
                    first_token.append(time.perf_counter() - start)
                if Streamer.calls >= 2:  # the first call is the prompt
                    probe.mark(cache)

            def end(self):
                pass

        if args.temperature > 0:
            torch.manual_seed(batch[0]["seed"])  # generate() samples with torch's default generator
        probe.restart()
        try:
            with contextlib.nullcontext() if args.no_sync_points else probe.counting():
                output = model.generate(ids, attention_mask=mask, max_new_tokens=max(r["max_tokens"] for r in batch),
                                        **sampling_kwargs(args), pad_token_id=pad_id, streamer=Streamer(),
                                        cache=cache, return_dict_in_generate=True)
            stats = cache.stats()
        finally:
            cache.close()
        peak["device"] = max(peak["device"], int(stats["device_bytes"]))
        peak["host"] = max(peak["host"], int(stats["host_bytes"]))
        spec["hits"] += int(stats["spec_hits"])
        spec["steps"] += int(stats["spec_steps"])
        end = time.perf_counter() - start
        for row, r in enumerate(batch):
            new = output.sequences[row, width:width + r["max_tokens"]]
            out.append({"arrived": r["at"], "first": first_token[0], "finished": end, "tokens": int(new.numel()),
                        "error": None})
    out[0].update(peak=peak, spec_hit_rate=spec["hits"] / spec["steps"] if spec["steps"] else math.nan,
                  **probe.summary())
    return out


def run_generate_batch(model, requests, args) -> list[dict]:
    from transformers import GenerationConfig

    from ...serving.openmp_pool import release_openmp_pool

    config = GenerationConfig(**sampling_kwargs(args), max_new_tokens=max(r["max_tokens"] for r in requests),
                              eos_token_id=None, pad_token_id=model.generation_config.pad_token_id or 0)
    manager = model.init_continuous_batching(generation_config=config)
    release_openmp_pool()  # its loop thread gets the same treatment as the scheduler's (openmp_pool.py)
    manager.start()
    start, out, ids = time.perf_counter(), {}, []
    try:
        for i, r in enumerate(requests):
            time.sleep(max(0.0, start + r["at"] - time.perf_counter()))
            ids.append(manager.add_request(r["prompt"].tolist(), request_id=f"r{i}", max_new_tokens=r["max_tokens"],
                                           record_timestamps=True))
        while len(out) < len(requests):
            result = manager.get_result(timeout=600)
            if result is None:
                raise TimeoutError("generate_batch: no result within 600 s")
            out[result.request_id] = (result, time.perf_counter() - start)
    finally:
        manager.stop(block=True)
    rows = []
    for i, r in enumerate(requests):
        result, finished = out[f"r{i}"]
        stamps = getattr(result, "timestamps", None) or []
        first = (stamps[0] - result.created_time) + r["at"] if stamps and getattr(result, "created_time", None) \
            else finished
        rows.append({"arrived": r["at"], "first": first, "finished": finished,
                     "tokens": len(result.generated_tokens), "error": None})
    rows[0]["peak"] = {"device": None, "host": None}
    return rows


def summarize(system: str, rows: list[dict], args) -> dict:
    """One system's row: throughput, latency percentiles, peak KV bytes, the batching and launch-thread measures of
    its first raw row (None, or NaN for the speculation and launch-thread measures, where the system has none), and
    the run's prompts and decoding."""
    def pct(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")

    ttft = [r["first"] - r["arrived"] for r in rows if r["error"] is None]
    tpot = [(r["finished"] - r["first"]) / (r["tokens"] - 1) for r in rows if r["error"] is None and r["tokens"] > 1]
    span = max(r["finished"] for r in rows) - min(r["arrived"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    peak = rows[0].get("peak", {})
    return {"system": system, "requests": len(rows), "errors": sum(r["error"] is not None for r in rows),
            "output_tokens": tokens, "seconds": span, "output_tokens_per_s": tokens / span,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "tpot_p50_s": pct(tpot, 0.5),
            "tpot_p99_s": pct(tpot, 0.99), "peak_device_kv_bytes": peak.get("device"),
            "peak_host_kv_bytes": peak.get("host"),
            # the scheduler's: decode steps of its running batch (output tokens / steps = rows per step), regroups
            "decode_steps": rows[0].get("decode_steps"), "regroups": rows[0].get("regroups"),
            "spec_hit_rate": rows[0].get("spec_hit_rate", math.nan),
            # the launch thread's, per decode step of the batch (launch_thread.StepProbe): counts; milliseconds
            "sync_points_per_step": rows[0].get("sync_points_per_step", math.nan),
            "sync_points_by_op": rows[0].get("sync_points_by_op", {}),
            "blocked_ms_per_step": rows[0].get("blocked_ms_per_step", math.nan),
            "prompts": args.prompts, "temperature": args.temperature, "top_p": args.top_p}


def _options(config) -> dict:
    """The fields of a DualDecoderConfig that differ from the defaults."""
    default = dataclasses.asdict(type(config)())
    return {k: v for k, v in dataclasses.asdict(config).items() if v != default[k]}


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f}"


def table(rows: list[dict], args) -> str:
    prompts = ("natural-text prompts (RULER essay passages asked to be continued) of about "
               if args.prompts == "natural" else "random-id prompts of ")
    lines = [f"Serving benchmark: {args.requests} requests, Poisson arrivals at {args.rate}/s, {prompts}"
             f"{args.context} tokens{' sharing all but their last 64' if args.shared_prefix else ''}, max_tokens "
             f"uniform in [{args.min_new}, {args.max_new}], {decoding_text(vars(args))}; max batch {args.max_batch}; "
             f"cache config {json.dumps(_options(args.cache_config))}. "
             + (f"Median (min–max) of {args.repeats} runs per system, the systems interleaved."
                if args.repeats > 1 else "One run per system: no spread (--repeats 3 before reading a ratio)."),
             "",
             "Per decode step of the batch, the launch thread's synchronization points and the ms it was blocked "
             "waiting for host selection (eval/throughput/launch_thread.py"
             + ("; synchronization points not counted: --no-sync-points)." if args.no_sync_points else
                "; counting them slows every torch call of that thread: compare timings with --no-sync-points)."),
             "",
             "| system | output tok/s | vs static | TTFT p50 / p99 (s) | TPOT p50 / p99 (s) | peak device KV MiB | "
             "peak host KV MiB | rows per decode step | spec hit rate | sync points / step | blocked ms / step | "
             "errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    static = next((r["output_tokens_per_s"] for r in rows if r["system"] == "static"), None)
    for r in rows:
        ratio = f"{r['output_tokens_per_s'] / static:.2f}×" if static else "n/a"
        per_step = f"{r['output_tokens'] / r['decode_steps']:.1f}" if r.get("decode_steps") else "n/a"
        lines.append(f"| {r['system']} | {with_range(r, 'output_tokens_per_s')} | {ratio} | "
                     f"{with_range(r, 'ttft_p50_s')} / "
                     f"{r['ttft_p99_s']:.2f} | {r['tpot_p50_s']:.3f} / {r['tpot_p99_s']:.3f} | "
                     f"{_mib(r['peak_device_kv_bytes'])} | {_mib(r['peak_host_kv_bytes'])} | {per_step} | "
                     f"{with_range(r, 'spec_hit_rate')} | {with_range(r, 'sync_points_per_step', '{:.1f}')} | "
                     f"{with_range(r, 'blocked_ms_per_step')} | {r['errors']} |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    from ...cli.serve import cache_config

    p = sub.add_parser("bench-serve", help="serving benchmark: Poisson arrivals, dual vs dense vs static generate()",
                       description="Serving benchmark: a Poisson stream of long-context requests with mixed output "
                                   "lengths, served by this scheduler with the dual cache (dual), the same scheduler "
                                   "with DynamicCache rows (dense), static generate() batches (static) and "
                                   "transformers' continuous batching (generate-batch); output tokens/s, time to "
                                   "first token and per output token, peak KV bytes (docs/serving.md).",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=None,
                   help="named model, .gguf, folder or Hub id (default: the embedded smollm2-135m)")
    p.add_argument("--requests", type=int, default=16, help="requests in the stream")
    p.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--prompts", default="random", choices=PROMPT_KINDS,
                   help="random: token ids drawn uniformly from the vocabulary; natural: per request a passage of the "
                        "RULER essay haystack asked to be continued (eval/quality/natural_text.py, seed --seed + the "
                        "request's index; needs a model with a tokenizer)")
    p.add_argument("--shared-prefix", action="store_true",
                   help="prompts share all but their last 64 tokens (random prompts only)")
    add_sampling_options(p, top_p=True)  # every request's; its generator is seeded with --seed + its index
    p.add_argument("--no-sync-points", action="store_true",
                   help="do not count the launch thread's synchronization points (counted by default: a "
                        "TorchFunctionMode that adds Python work to every torch call of that thread, so compare "
                        "timings with it off); the blocked time is measured either way")
    p.add_argument("--prefix-block", type=int, default=0,
                   help="the dual server's prefix cache (Scheduler prefix_block; 0: off)")
    p.add_argument("--min-new", type=int, default=4, help="fewest output tokens a request asks for (max_tokens)")
    p.add_argument("--max-new", type=int, default=64,
                   help="most output tokens a request asks for; max_tokens is uniform in [--min-new, --max-new]")
    p.add_argument("--max-batch", type=int, default=8, help="batch rows decoding at once (every system)")
    p.add_argument("--cache-config", type=cache_config, default=None,
                   help="DualDecoderConfig fields as JSON, or a JSON file, for the dual rows (default: "
                        "DualDecoderConfig's defaults)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS, help="systems to run, in order")
    p.add_argument("--seed", type=int, default=0,
                   help="picks the prompts, arrival times, max_tokens and each request's sampling seed")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every system, in an order rotated each round; rows report the median and the "
                        "min-max (one run takes minutes: 1 by default, 3 before reading a ratio)")
    p.add_argument("--out", default=None,
                   help="output path without extension, writes .json and .md (default: a new "
                        "eval-results/bench-serve/<time>; results/ only when --out names it)")
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args) -> int:
    problems = [f"--{n.replace('_', '-')} must be >= 1" for n in ("requests", "min_new", "max_batch", "repeats")
                if getattr(args, n) < 1]
    if args.max_new < args.min_new:
        problems.append("--max-new must be >= --min-new")
    if args.rate <= 0:
        problems.append("--rate must be > 0")
    if args.context < 128:
        problems.append("--context must be >= 128")
    if args.prefix_block < 0:
        problems.append("--prefix-block must be >= 0")
    if not (math.isfinite(args.temperature) and (args.temperature == 0 or args.temperature >= GREEDY_BELOW)):
        problems.append(f"--temperature must be 0 (greedy) or a finite number >= {GREEDY_BELOW:g} (the scheduler "
                        f"decodes greedily below it), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # NaN fails too
        problems.append(f"--top-p must be in (0, 1] (1: off), got {args.top_p}")
    elif args.top_p < 1 and not args.temperature > 0:
        problems.append(f"--top-p {args.top_p} applies to sampling: give --temperature > 0 with it")
    if args.prompts == "natural" and args.shared_prefix:
        problems.append("--shared-prefix shares random ids: drop it with --prompts natural (one passage per request)")
    if problems:
        raise ValueError("; ".join(problems) + ".")
    args.cache_config = args.cache_config or DualDecoderConfig()
    from ...model.loading import load_model, model_display_name

    model, tokenizer = load_model(args.model)
    special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
    requests = workload(args, model.config.get_text_config(decoder=True).vocab_size, special, tokenizer)
    warm = requests[0]["prompt"][None, :128]  # first calls pay one-time costs (engine load, allocator): not timed
    model.generate(warm, max_new_tokens=2, do_sample=False)
    model.generate(warm, max_new_tokens=2, do_sample=False, cache_implementation="dual",
                   cache_config=args.cache_config)
    runs: dict[str, list[dict]] = {system: [] for system in args.systems}
    highest = spread.load_average()
    for round_ in range(args.repeats):
        for system in spread.rotated(args.systems, round_, group=lambda _: 0):
            try:
                if system in ("dual", "dense"):
                    raw = run_scheduler(model, requests, args, dense=system == "dense")
                elif system == "static":
                    raw = run_static(model, requests, args, tokenizer.pad_token_id or 0)
                else:
                    raw = run_generate_batch(model, requests, args)
            except Exception as error:  # noqa: BLE001 - a system that cannot run here is reported, not fatal
                print(f"{system}: failed: {type(error).__name__}: {error}", file=sys.stderr)
                continue
            runs[system].append(summarize(system, raw, args))
            print(json.dumps(runs[system][-1]), flush=True)
            highest = max(highest, spread.load_average())
    rows = [spread.merge_runs(runs[system], TIMED) for system in args.systems if runs[system]]
    warning = spread.load_warning(highest)
    text = (warning + "\n\n" if warning else "") + table(rows, args) + \
        f"\n\nModel {model_display_name(args.model)}, {model.dtype}, on this host.\n"
    print(text)
    record = {"args": {k: v for k, v in vars(args).items() if k not in ("func", "cache_config")},
              "cache_config": _options(args.cache_config), "rows": rows}
    print("wrote " + ", ".join(write_rows_and_table(args.out or default_out("bench-serve"), record, text)))
    return 0
