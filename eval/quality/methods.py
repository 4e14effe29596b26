"""The methods compared by the evaluation harness, each a cache configuration for `generate()`.

| method | budget | cache |
|---|---|---|
| `dense` | null | transformers' default `DynamicCache` (no `cache_implementation`) |
| `dual` | b | `cache_config={"budget": b}`, the library defaults: since issue 57 the speculated token's query fetches `2 × b` entries plus the next position of each entry the real token attended, and the real token's query picks `b` of them on the device; rows written before it have `{"budget": b, "miss_repair": True}` (the `dual-sync-repair` configuration; the rows record their `cache_config`). Default selector `lowbit` since 2026-12-04 (`exact` in rows written before); default sink 4, window 64, and the first 2 layers retrieve `max(b, 1024)` |
| `dual-sync-repair` | b | `{"budget": b, "miss_repair": True, "fetch_factor": 1, "fetch_next": False}`: the default before issue 57: mis-speculated steps, and layers of hit steps whose real query drifted (`repair_drift` 0.4), re-selected with the real token's query, the step waiting for the host |
| `dual-no-repair` | b | `{"budget": b, "miss_repair": False, "fetch_factor": 1, "fetch_next": False}`: speculated-token selection only (the paper's method) |
| `dual-none` | b | `{"budget": b, "speculator": "none"}`: the previous real token's selection (what speculation buys) |
| `oracle` | b | `{"budget": b, "selector": "oracle"}`: the real token's own top-k (upper bound) |
| `streaming` | 0 | `{"budget": 0, "early_layers": 0, "speculator": "none"}`: StreamingLLM-style sink + window only |
| `streaming@b` | b | the same with `window` = 64 + b: sink + window hold as many entries as dual's sink + window + selection at budget b |
| `dual-exact` | b | `dual` with exact top-k over every key (the default selector before 2026-12-04) |
| `dual-lowbit` | b | `dual` with the 2-bit key index and exact rescoring of `lowbit_factor × b` positions |
| `quest` | b | `{"budget": b, "selector": "quest", "block_size": 16, "speculator": "none"}`: Quest-style pages ranked by min/max key bounds |

Budgets are reported as given (`budget`), although the dual configurations' first two layers retrieve
`max(budget, 1024)` tokens (`early_layers=2`, `early_layer_budget=1024`, the library default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The one registry of compared methods (evaluation harness, throughput benchmark, needle sweep): each name's
# `cache_config` for `generate(cache_implementation="dual")` before its budget is added; None for transformers' own
# caches. Each tool runs the subset it supports.
CACHE_CONFIGS: dict[str, dict[str, Any] | None] = {
    "dense": None,  # transformers' default DynamicCache
    "offloaded": None,  # transformers' cache_implementation="offloaded" (CUDA; throughput benchmark)
    "dual": {},  # the library defaults
    # the default before issue 57: misses repaired synchronously, the guess drawn with its own randomness
    "dual-sync-repair": {"miss_repair": True, "fetch_factor": 1, "fetch_next": False, "coupled_sampling": False},
    "dual-self": {"speculator": "self"},
    "dual-ngram": {"speculator": "ngram"},
    "dual-none": {"speculator": "none"},  # the previous real token's selection: what speculation buys
    "dual-no-repair": {"miss_repair": False, "fetch_factor": 1, "fetch_next": False},  # the paper's method
    "dual-no-drift": {"miss_repair": True, "fetch_factor": 1, "fetch_next": False, "repair_drift": None},
    # with eval/throughput/forced_miss.py (benchmark only): the synchronous repair at a forced miss rate
    "dual-forced-miss": {"speculator": "self", "miss_repair": True, "fetch_factor": 1, "fetch_next": False},
    "dual-exact": {"selector": "exact"},
    "dual-lowbit": {"selector": "lowbit"},  # the 2-bit key index + exact rescoring (native engine)
    "oracle": {"selector": "oracle"},  # the real token's own top-k: upper bound
    "streaming": {"budget": 0, "early_layers": 0, "speculator": "none"},  # sink + window only
    "quest": {"selector": "quest", "block_size": 16, "speculator": "none"},  # one token per step, own query
}


def cache_config(name: str, budget: int | None = None) -> dict[str, Any] | None:
    """`CACHE_CONFIGS[name]` with `budget` added (when given and the method has none of its own); None for
    transformers' caches.

    Raises:
        ValueError: for a name that is not in the registry.
    """
    if name not in CACHE_CONFIGS:
        raise ValueError(f"unknown method {name!r}; choose from {list(CACHE_CONFIGS)}.")
    config = CACHE_CONFIGS[name]
    if config is None:
        return None
    return {"budget": budget, **config} if budget is not None and "budget" not in config else dict(config)


METHOD_NAMES = ("dense", "dual", "dual-sync-repair", "dual-no-repair", "dual-none", "dual-lowbit", "dual-exact", "oracle",
                "streaming", "quest")  # what the evaluation harness runs


@dataclass(frozen=True)
class Method:
    """One evaluated configuration.

    Attributes:
        name: one of `METHOD_NAMES` (kvpress rows use `kvpress-<press>`).
        budget: retrieval budget in tokens per KV head (None for dense).
        cache_config: `cache_config` for `generate(cache_implementation="dual")`; None means the dense default cache.
        skip_reason: why this method cannot run with the installed library (None when it can).
    """

    name: str
    budget: int | None
    cache_config: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    skip_reason: str | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """`"dual@256"`, `"dense"`, ...: name and budget."""
        return self.name if self.budget is None else f"{self.name}@{self.budget}"

    def generate_kwargs(self) -> dict[str, Any]:
        """Keyword arguments selecting this method's cache in `model.generate()`."""
        if self.cache_config is None:
            return {}
        return {"cache_implementation": "dual", "cache_config": dict(self.cache_config)}


def _check(config: dict[str, Any]) -> str | None:
    from dual_cache.config import DualDecoderConfig

    try:
        DualDecoderConfig.from_dict(config)
    except ValueError as error:
        return f"this dual_cache rejects {config}: {error}"
    return None


def make_method(name: str, budget: int | None = None) -> Method:
    """The `Method` called `name` at `budget` (ignored for dense). Streaming at budget 0 (or None) keeps the
    default sink + window; at budget b > 0 its window grows by b, so that it keeps as many entries per KV head as a
    dual configuration at budget b keeps resident in a step (sink + window + b).

    Raises:
        ValueError: unknown method name, or a budget missing / negative where one is needed.
    """
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHOD_NAMES)}.")
    if name == "dense":
        return Method("dense", None, None)
    if name == "streaming":
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"method 'streaming' needs a non-negative integer budget, got {budget!r}.")
        config = cache_config(name)
        if budget:
            from dual_cache.config import DualDecoderConfig

            config["window"] = DualDecoderConfig().window + budget
        return Method("streaming", budget or 0, config, _check(config))
    if budget is None or isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"method {name!r} needs a positive integer budget, got {budget!r}.")
    config = cache_config(name, budget)
    return Method(name, budget, config, _check(config))


def parse_method(spec: str, default_budget: int) -> Method:
    """`"dual@128"` → dual at 128; `"oracle"` → oracle at `default_budget`; `"dense"`, `"streaming"` (sink + default
    window), `"streaming@256"` (sink + a window as large as dual's resident entries at budget 256)."""
    name, _, budget = spec.partition("@")
    if budget:
        try:
            value = int(budget)
        except ValueError:
            raise ValueError(f"bad method spec {spec!r}: the budget after '@' must be an integer.") from None
    else:
        value = None if name in ("dense", "streaming") else default_budget
    return make_method(name, value)


def standard_methods(budgets: list[int], reference_budget: int = 256) -> list[Method]:
    """The full comparison: dense, dual at every budget, then dual-no-repair, dual-none and oracle at
    `reference_budget`, streaming, and quest at `reference_budget`."""
    methods = [make_method("dense")] + [make_method("dual", b) for b in budgets]
    methods += [make_method(n, reference_budget) for n in ("dual-no-repair", "dual-none", "oracle")]
    methods += [make_method("streaming"), make_method("quest", reference_budget)]
    return methods
