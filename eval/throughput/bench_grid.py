"""What the throughput benchmark measures: method names, the grid of cells, and each method's `cache_config`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ...config import SPECULATORS, DualDecoderConfig
from .cpu_linear import MAX_ROWS as CPU_GEMM_MAX_ROWS
from ..quality.methods import CACHE_CONFIGS


def registered_config(method: str) -> dict[str, Any]:
    """The registry's `cache_config` fragment of a dual / quest method (`eval/quality/methods.py`)."""
    return dict(CACHE_CONFIGS[method])

DUAL_METHODS = tuple(f"dual-{s}" for s in SPECULATORS)  # dual-self, dual-ngram, dual-none
BASELINES = ("dense", "offloaded")
LOWBIT = "dual-lowbit"  # dual-self with the 2-bit key index (`selector="lowbit"`)
NO_REPAIR = "dual-no-repair"  # dual-self attending to the speculated selection as it is: the paper's method
SYNC_REPAIR = "dual-sync-repair"  # dual-self with the default before issue 57: misses repaired synchronously
FORCED_MISS = "dual-forced-miss"  # dual-self with synchronous repairs at a forced miss rate (forced_miss.py)
ALL_METHODS = BASELINES + DUAL_METHODS + (NO_REPAIR, SYNC_REPAIR, FORCED_MISS, LOWBIT, "quest")
METHOD_ALIASES = {"dual": DUAL_METHODS, "all": BASELINES + DUAL_METHODS + (LOWBIT, "quest")}
BUDGETED = DUAL_METHODS + (NO_REPAIR, SYNC_REPAIR, FORCED_MISS, LOWBIT, "quest")  # cells vary with the budget
RATIO_BASELINES = ("dense", "offloaded", "quest")  # what "the best baseline" of the max-batch table ranges over
CPU_LINEARS = ("stock", "gemm")  # see eval/throughput/cpu_linear.py
PROMPT_KINDS = ("needle", "natural")  # see bench_models.PromptSource


@dataclass
class BenchGrid:
    """What to measure. Token counts are tokens; `budgets` are tokens per KV head per full-attention layer.

    Attributes:
        methods: names from `ALL_METHODS`, run in the order given, or the aliases `"dual"` (every speculator) and
            `"all"`. `dual-<speculator>`: that speculator with the library defaults (the default selector, the
            real token's re-rank of `fetch_factor × budget` fetched entries and their next positions on the device);
            `dual-no-repair`: `dual-self` attending to the speculated selection as it is (`fetch_factor` 1, no next
            positions, no repair: the paper's method); `dual-sync-repair`: `dual-self` as the library's default
            was before issue 57 (`fetch_factor` 1, no next positions, a miss re-selected synchronously with the
            real token's query, layer by layer: `miss_repair`; the guess drawn with its own randomness:
            `coupled_sampling` off); `dual-forced-miss`: `dual-self` with synchronous miss
            repair (`fetch_factor` 1) of a `forced_miss_rate` fraction of the live sequences each step (benchmark
            only, `eval/throughput/forced_miss.py`); `dual-lowbit`: `dual-self` with
            `selector="lowbit"`; `quest`: the Quest baseline.
        batches: sequences per `generate()` call.
        contexts: prompt lengths (tokens; the embedded model's needle prompts meet them within a few tokens).
        budgets: dual / quest retrieval budgets; dense and offloaded cells ignore them.
        new_tokens: generated tokens per sequence (every one is generated: `min_new_tokens = new_tokens`).
        warmup_steps: decode steps excluded from tokens/s and ms/step.
        n_sink, window: dual resident tiers (tokens).
        prefill_chunk_size: prompt tokens per prefill forward, used by every method (fair activation memory).
        quest_block_size: page size of the Quest baseline (tokens).
        temperature: 0 decodes greedily; > 0 samples at this temperature (transformers' processors, top-k off).
        top_p: nucleus mass kept when sampling, in (0, 1] (1: off); must stay 1 for greedy decoding.
        prompts: `"needle"` (a word-needle question over the Python reference per row) or `"natural"` (a passage of
            the RULER essay haystack per row, asked to be continued: `eval/quality/natural_text.py`); both need a
            tokenizer (random-weight models get random ids). Row `b` of a batch uses seed `b`.
        dual_options: further `DualDecoderConfig` fields for dual / quest cells (e.g. `{"early_layers": 0}`);
            `speculator`, `selector` and `budget` are set by the method and may not appear here.
        forced_miss_rate: fraction in [0, 1] of live sequences `dual-forced-miss` repairs per step.
        cpu_linear: `"gemm"` routes every method's few-row linears through `eval/throughput/cpu_linear.py` (CPU only).
        count_sync_points: count the launch thread's synchronization points per step during the timed runs
            (`launch_thread.py`; a TorchFunctionMode that adds Python work to every torch call); False leaves them NaN.
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
    temperature: float = 0.0
    top_p: float = 1.0
    prompts: str = "needle"
    dual_options: dict[str, Any] = field(default_factory=dict)
    forced_miss_rate: float | None = None
    cpu_linear: str = "stock"
    count_sync_points: bool = True

    def expanded_methods(self) -> tuple[str, ...]:
        """Methods with aliases expanded, in the order given, without duplicates."""
        out: list[str] = []
        for name in self.methods:
            for method in METHOD_ALIASES.get(name, (name,)):
                if method not in out:
                    out.append(method)
        return tuple(out)

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
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}.")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1: off), got {self.top_p!r}.")
        if self.top_p < 1 and self.temperature == 0:
            raise ValueError(f"--top-p {self.top_p} applies to sampling; give --temperature > 0 with it.")
        if self.prompts not in PROMPT_KINDS:
            raise ValueError(f"--prompts must be one of {PROMPT_KINDS}, got {self.prompts!r}.")
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
        methods = self.expanded_methods()
        if FORCED_MISS in methods:
            rate = self.forced_miss_rate
            if rate is None or isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise ValueError(f"method {FORCED_MISS} needs --forced-miss-rate in [0, 1], got {rate!r}.")
            if self.dual_options.get("miss_repair") is False:
                raise ValueError(f"method {FORCED_MISS} forces miss repairs; drop miss_repair from --dual-options.")
        for method in methods:
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
        config.update(registered_config(method))  # eval/quality/methods.py: one registry for every tool
        if method == "quest":
            config["block_size"] = self.quest_block_size
        return config

    def sampling_kwargs(self) -> dict[str, Any]:
        """`generate()`'s decoding arguments: greedy, or sampling with this temperature and top-p (top-k off, not
        transformers' default 50; every argument given, so the model's `generation_config` adds nothing)."""
        if self.temperature == 0:
            return {"do_sample": False, "temperature": None, "top_k": None, "top_p": None}
        return {"do_sample": True, "temperature": float(self.temperature), "top_k": 0, "top_p": float(self.top_p)}

    def budgets_of(self, method: str) -> tuple[int | None, ...]:
        """The budgets a method's cells run at: the grid's for budgeted methods, `(None,)` for baselines."""
        return self.budgets if method in BUDGETED else (None,)

    def cells(self, skip: set[str] = frozenset()) -> list[tuple[str, int, int, int | None]]:
        """`(method, context, batch, budget)` of every cell, contexts outermost; budget None for baselines."""
        return [(method, context, batch, budget)
                for context in self.contexts for batch in self.batches
                for method in self.expanded_methods() if method not in skip
                for budget in self.budgets_of(method)]


def skipped_methods(grid: BenchGrid, device: torch.device) -> dict[str, str]:
    """`{method: reason}` for methods of the grid that cannot run here (printed, never an error)."""
    skip = {}
    if "offloaded" in grid.expanded_methods() and device.type != "cuda":
        skip["offloaded"] = (
            "transformers' offloaded cache needs CUDA (it prefetches layers on a CUDA stream); skipped on "
            f"{device.type}"
        )
    return skip


def decoding_text(grid: dict) -> str:
    """`"greedy"` or `"sampling at temperature 0.8, top-p 0.9"` (top-p left out when off) for a grid as a dict
    (`asdict(BenchGrid)`; older runs' `do_sample` read as temperature 1)."""
    temperature = grid.get("temperature", 1.0 if grid.get("do_sample") else 0.0)
    top_p = grid.get("top_p", 1.0)
    if not temperature:
        return "greedy"
    return f"sampling at temperature {temperature:g}" + (f", top-p {top_p:g}" if top_p < 1 else "")


def method_label(method: str, budget: int | None, forced_miss_rate: float | None = None) -> str:
    """`method` for baselines, `method k=budget` for budgeted methods, plus the forced miss rate where set."""
    name = method if budget is None else f"{method} k={budget}"
    if method == FORCED_MISS and forced_miss_rate is not None and math.isfinite(forced_miss_rate):
        name += f" ({forced_miss_rate:.0%} missed)"
    return name
