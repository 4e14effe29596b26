"""The methods compared by the evaluation harness, each a cache configuration for `generate()`.

| method | budget | cache |
|---|---|---|
| `dense` | null | transformers' default `DynamicCache` (no `cache_implementation`) |
| `dual` | b | `cache_config={"budget": b, "miss_repair": True}` (speculated-token selection, mis-speculated steps, and layers of hit steps whose real query drifted (`repair_drift` 0.4), re-selected with the real token's query; default sink 4, window 64, and the first 2 layers retrieve `max(b, 1024)`) |
| `dual-no-repair` | b | `{"budget": b, "miss_repair": False}`: speculated-token selection only (the paper's method) |
| `dual-none` | b | `{"budget": b, "speculator": "none"}`: the previous real token's selection (what speculation buys) |
| `oracle` | b | `{"budget": b, "selector": "oracle"}`: the real token's own top-k (upper bound) |
| `streaming` | 0 | `{"budget": 0, "early_layers": 0, "speculator": "none"}`: StreamingLLM-style sink + window only |
| `quest` | b | `{"budget": b, "selector": "quest", "block_size": 16}`: Quest-style pages ranked by min/max key bounds |

Budgets are reported as given (`budget`), although the dual configurations' first two layers retrieve
`max(budget, 1024)` tokens (`early_layers=2`, `early_layer_budget=1024`, the library default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

METHOD_NAMES = ("dense", "dual", "dual-no-repair", "dual-none", "oracle", "streaming", "quest")


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
    """The `Method` called `name` at `budget` (ignored for dense; 0 for streaming).

    Raises:
        ValueError: unknown method name, or a budget missing / negative where one is needed.
    """
    if name not in METHOD_NAMES:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHOD_NAMES)}.")
    if name == "dense":
        return Method("dense", None, None)
    if name == "streaming":
        config = {"budget": 0, "early_layers": 0, "speculator": "none"}
        return Method("streaming", 0, config, _check(config))
    if budget is None or isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"method {name!r} needs a positive integer budget, got {budget!r}.")
    config: dict[str, Any] = {"budget": budget}
    if name in ("dual", "dual-no-repair"):
        config["miss_repair"] = name == "dual"
    elif name == "dual-none":
        config["speculator"] = "none"
    elif name == "oracle":
        config["selector"] = "oracle"
    elif name == "quest":
        config.update(selector="quest", block_size=16)
    return Method(name, budget, config, _check(config))


def parse_method(spec: str, default_budget: int) -> Method:
    """`"dual@128"` → dual at 128; `"oracle"` → oracle at `default_budget`; `"dense"`, `"streaming"`."""
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
