"""`DualDecoderConfig`: every knob of the DualDecoder method, validated before any work starts."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .kernels import BACKENDS as ATTENTION_KERNELS
from .selection.selectors import SELECTORS

SPECULATORS = ("self", "ngram", "none")
RESIDENT_ATTENTION = ("all", "rerank")


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity (`os.sched_getaffinity`, which a container's cpuset or
    `taskset` narrows), else `os.cpu_count()`."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1
SELECTOR_NAMES = tuple(SELECTORS)  # `selector` values, in the registry's order


@dataclass
class DualDecoderConfig:
    """Configuration of the dual cache and the dual-token decode loop (docs/design.md §2).

    Attributes:
        budget: middle tokens retrieved per decode step, per KV head, per full-attention layer (tokens).
            With `selector="quest"`, a multiple of `block_size`.
        n_sink: first real (non-pad) prompt tokens kept resident on the device (tokens).
        window: most recent tokens kept resident on the device, a ring buffer (tokens).
        block_size: page size of `selector="quest"` (tokens); the other selectors choose single tokens and
            ignore it.
        early_layers: the first `early_layers` layers retrieve `max(budget, early_layer_budget)` entries: they are
            far less sparse than the later ones (docs/design.md §2). 0 disables.
        early_layer_budget: budget of those early layers (tokens per KV head).
        layer_budgets: per-layer override `{layer_idx: budget}`, taking precedence over everything else.
        layers_in_flight: device buffers of the layer-scoped pool the deltas are copied into (each holds the most
            one step of one layer can copy: `B × H_kv × (fetch_factor + 1) × budget` rows of K, V, an int64 slot
            and an int64 position), independent of context length and layer count.
        lookahead: layers between issuing a delta's host→device copy and the layer that uses it; must be smaller
            than `layers_in_flight`.
        speculator: how the speculated token x̂ is proposed. `"self"`: argmax of the model's own logits at the
            speculated slot (two tokens per forward); after a miss, prompt lookup on the true sequence where it
            matches (`speculators.SelfSpeculator`). `"ngram"`: prompt lookup (transformers'
            `PromptLookupCandidateGenerator`), falling back to `"self"` where it finds no match. `"none"`: one
            token per forward, no speculation: each step uses the entries the previous real token's query chose
            (prefetched a step early, as a speculated query's).
        fetch_factor: entries per KV head a prefetched selection fetches, as a multiple of the layer's budget: the
            speculated token's query chooses `fetch_factor × budget` entries a step early, which the layer's
            resident set holds beside what earlier steps chose (the real token attends to the set: a wrong guess,
            or a request's first step, never makes the step wait for the host). Host selection and host→device
            bytes per step grow with this factor; the measured choice is in docs/design.md.
        resident_factor: entries each full-attention layer keeps on the device per KV head across steps (its
            resident set), as a multiple of the layer's budget (at least what one step wants: `fetch_factor ×
            budget`, plus `budget` with `fetch_next`): each step copies only the entries its selection wants that
            the set lacks, into the slots of the least recently wanted or attended ones (`transfer/resident_set.py`).
            Device bytes per request: `resident_factor × Σ_layers budget × H_kv × (2 × D × dtype bytes + 8)`; the
            measured choice is in docs/design.md.
        resident_attention: what the real token attends to of its layer's resident set: `"all"` of it (more than
            the budget, at no extra copies) or `"rerank"`: the `budget` entries of most mass of its query
            (`rerank.top_entries`, on the device).
        fetch_next: with a prefetched selector, also fetch, for each entry the real token attended in a step, the
            entry at the next position (`budget` more slots): where a token continues a copy (a needle's digits),
            its query needs the entry after the one the previous token attended, which a mis-speculated token's
            query does not choose. The real query's re-rank picks among them too.
        coupled_sampling: under sampling, draw the speculated token with the randomness that will draw the next
            real token (Gumbel-max with the same noise on both slots' processed scores; `generate/sampling.py`), so
            sampled decoding guesses about as well as greedy decoding; every real token stays an exact sample of
            `generate()`'s processed distribution. False draws the real token with `torch.multinomial` as
            transformers' `_sample` does (the default cache's tokens for a seed, at full budget) and guesses the
            argmax.
        miss_repair: when the real token differs from the speculated token that chose its step's entries (and on
            the first decode step, whose entries the prompt's last position chose), select that step's entries
            again with the real token's own query, synchronously, layer by layer (only for the sequences that
            missed, and only in layers whose candidates outnumber their budget). Restores exact-top-k quality on
            miss steps at the cost of a host retrieval on the critical path of those steps; False keeps the step
            fully pipelined (the paper's method). Applies to the `"self"` and `"ngram"` speculators with the
            prefetched selectors (`Selector.prefetched`).
        repair_drift: with `miss_repair`, also repair a layer on a step whose speculated token hit, for the
            sequences whose real query there drifted from the speculated token's query that chose the entries:
            relative L2 distance `‖q − q̂‖ / ‖q‖` over the query heads of a KV head (`query_drift`) at or above
            `repair_drift` in any KV head. The two queries belong to the same token at the same position but
            were computed over different selections in the layers below, and on copying steps (a needle's
            digits) they can point at different entries. None disables; 0 repairs every step (with
            `selector="exact"`, the `"oracle"` selection). The default and what it costs are measured in
            results/needle/ (docs/benchmarks.md). A check reads a `(B,)` flag back to the host per layer:
            `drift_on_hit_steps` says in which steps it runs.
        drift_on_hit_steps: whether the `repair_drift` check also runs in steps where every live sequence's
            guess hit (True), or only in steps that repair a miss, which wait for the host per layer anyway
            (False: steps where every guess hit never wait inside the layers, `repair.RepairPolicy`). None (the
            default) picks True on a CPU device (no waits to save) and False on CUDA.
        selector: how each step's entries are chosen (`dual_cache.selection.selectors`, one class per value):
            `"carried"` (the default) the `"lowbit"` selection every `rescan_interval` steps per (sequence, KV
            head), and in between an exact rescoring of the `carried_factor × budget` best positions of its last
            scan plus the positions appended since (`selectors/carried.py`); `"lowbit"` a 2-bit copy of every key
            on the host, scanned by the native engine every step to shortlist `lowbit_factor × budget` positions
            that are rescored exactly (`selectors/lowbit.py`; the flat scan the default is tested against);
            `"exact"` top-k over every host key (the reference it is tested against), scored by the native
            engine; `"oracle"` the real token's own exact top-k, synchronously at the step that uses it
            (evaluation upper bound only); `"quest"` the Quest baseline (Tang et al., 2024): pages of
            `block_size` tokens ranked by a min/max key bound against the real token's query at the step that
            uses it; its page metadata counts as device bytes (evaluation baseline). Any other value raises
            `ValueError` listing these.
        rescan_interval: `selector="carried"`: selections of a (sequence, KV head) from one full scan of the key
            index to the next (1: every step scans, as `"lowbit"`).
        rescan_cosine: `selector="carried"`: a (sequence, KV head) whose GQA group's query has a cosine below this
            to the query of its last scan scans again at once; None: only every `rescan_interval`.
        carried_factor: `selector="carried"`: positions per KV head carried from a scan to the steps until the
            next one, as a multiple of the budget (the best of those the scan rescored exactly).
        lowbit_factor: `selector="lowbit"` and `"carried"`: positions per KV head the 2-bit key scan shortlists for exact
            rescoring, as a multiple of the budget.
        lowbit_channels: `selector="lowbit"` and `"carried"`: fraction of the channel quads (4 channels each) whose codes the scan
            reads, in (0, 1]; the quads are chosen per step and KV head by `Σ_h |q_h| ×` the channel's step, and
            the other channels enter at each 64-token group's midpoint (`engine/reference.py`). 1.0 reads them all.
        retrieval_threads: host threads running retrieval jobs ahead of the compute, several layers at once; 0
            runs each job synchronously on the calling thread (the reference path; identical tokens and
            selections for any count); None picks the cores this process may use (`usable_cores`: its CPU
            affinity, divided among the tensor-parallel ranks of the host) when the model runs on CUDA and 0
            on CPU (where retrieval threads only compete with the compute for cores).
        prefill_chunk_size: prompt tokens per prefill forward pass (tokens).
        ngram_size: maximum n-gram length matched by the `"ngram"` speculator (tokens).
        prefill_progress: show a tqdm progress bar over the prefill, by layer of every chunk (`progress.PrefillBar`).
        host_chunk_tokens: the largest growth step of a host store (tokens): its first chunk holds the prompt,
            later chunks add half the capacity, at least 16 and at most this many tokens (appending never copies
            what is stored; `host.growth.next_chunk_tokens`).
        max_host_bytes: host bytes the cache may allocate (all layers); None = 90% of the memory available when
            the cache is sized. A request that cannot fit raises `HostMemoryError` before anything is allocated.
        record_timeline: keep a per-(step, layer) timeline of retrieval, copy and attention (`cache.timeline()`).
        attention_kernel: decode attention implementation: `"auto"` (Triton on CUDA when available, else the
            torch reference), `"torch"`, or `"triton"`.

    Raises:
        ValueError: from `validate()` (called on construction) for any out-of-range or inconsistent value,
            naming the field and what to change.
    """

    budget: int = 256
    n_sink: int = 4
    window: int = 64
    block_size: int = 1
    early_layers: int = 2
    early_layer_budget: int = 1024
    layer_budgets: dict[int, int] = field(default_factory=dict)
    layers_in_flight: int = 2
    speculator: str = "self"
    fetch_factor: int = 1
    resident_factor: int = 3
    resident_attention: str = "all"
    fetch_next: bool = True
    coupled_sampling: bool = True
    miss_repair: bool = False
    repair_drift: float | None = 0.4
    drift_on_hit_steps: bool | None = None
    selector: str = "carried"
    rescan_interval: int = 16
    rescan_cosine: float | None = 0.7
    carried_factor: int = 4
    lowbit_factor: int = 8
    lowbit_channels: float = 0.25
    retrieval_threads: int | None = None
    prefill_chunk_size: int = 8192
    ngram_size: int = 3
    prefill_progress: bool = False
    lookahead: int = 1
    host_chunk_tokens: int = 4096
    max_host_bytes: int | None = None
    record_timeline: bool = False
    attention_kernel: str = "auto"

    def __post_init__(self) -> None:
        try:
            self.layer_budgets = {int(k): v for k, v in dict(self.layer_budgets or {}).items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"`layer_budgets` must map layer indices to budgets, e.g. {{5: 128}}; got {self.layer_budgets!r}."
            ) from None
        self.validate()

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "DualDecoderConfig":
        """Build from a `cache_config` dict as passed to `generate()`; unknown keys or anything but a mapping raise
        `ValueError`."""
        if values is not None and not isinstance(values, Mapping):
            raise ValueError(f"cache_config must be a dict of DualDecoderConfig fields (e.g. {{'budget': 256}}) or a "
                             f"DualDecoderConfig, got {type(values).__name__} {values!r}.")
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            hints = []
            for name in unknown:
                if name.startswith("no_") and name[3:] in known:  # `no_miss_repair`: the CLI flag's spelling
                    hints.append(f"{name!r}: set {name[3:]!r} to false")
                elif match := difflib.get_close_matches(name, known, n=1):
                    hints.append(f"{name!r}: did you mean {match[0]!r}?")
            hints = "; ".join(hints)
            raise ValueError(
                f"Unknown dual cache option(s) {unknown}{' (' + hints + ')' if hints else ''}. "
                f"Valid options: {sorted(known)}."
            )
        return cls(**values)

    @staticmethod
    def json_fields(text: str) -> dict[str, Any]:
        """The fields of a JSON object given inline (`'{"budget": 512}'`) or in a file (its path; UTF-8, a BOM
        allowed), not yet validated. Raises `ValueError` for a missing, unreadable or empty file, text that is not
        JSON, or JSON that is not an object (the CLI's `--cache-config`)."""
        source = "the text"
        try:
            values = json.loads(text)
        except json.JSONDecodeError as inline_error:
            if text.lstrip().startswith(("{", "[")):
                raise ValueError(f"not a JSON object ({inline_error})") from None
            source = f"file {text}"
            try:
                with open(text, encoding="utf-8-sig") as handle:
                    content = handle.read()
            except (OSError, UnicodeDecodeError) as error:
                raise ValueError(f"neither a JSON object nor a readable file: {error}") from None
            if not content.strip():
                raise ValueError(f"{source} is empty; it should hold a JSON object of DualDecoderConfig fields")
            try:
                values = json.loads(content)
            except json.JSONDecodeError as error:
                raise ValueError(f"{source} is not a JSON object ({error})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{source} must be a JSON object of DualDecoderConfig fields, got "
                             f"{type(values).__name__} {values!r}")
        return values

    @classmethod
    def from_json(cls, text: str) -> "DualDecoderConfig":
        """Build from a JSON object of fields, inline or in a file (`json_fields`, then `from_dict`); raises
        `ValueError` for either's errors."""
        return cls.from_dict(cls.json_fields(text))

    def replace(self, **changes: Any) -> "DualDecoderConfig":
        """A validated copy with `changes` applied."""
        return dataclasses.replace(self, **changes)

    def budget_for_layer(self, layer_idx: int) -> int:
        """Retrieval budget of `layer_idx` in tokens per KV head."""
        if layer_idx in self.layer_budgets:
            return self.layer_budgets[layer_idx]
        if layer_idx < self.early_layers:
            return max(self.budget, self.early_layer_budget)
        return self.budget

    def threads_for(self, device: torch.device, ranks_per_host: int = 1) -> int:
        """Retrieval threads to use for a model on `device` (resolves `retrieval_threads=None`): on CUDA the cores
        this process may run on (`usable_cores()`) divided among the `ranks_per_host` tensor-parallel ranks sharing
        them (at least 1), on CPU 0."""
        if self.retrieval_threads is None:
            return max(1, usable_cores() // max(1, ranks_per_host)) if device.type == "cuda" else 0
        return self.retrieval_threads

    def validate(self) -> None:
        """Check every field; raises `ValueError` naming the offending field and a valid range. An integer field
        given as another integral type (a numpy integer) is stored as the int it holds."""

        def _int(name: str, value: Any, minimum: int) -> int:
            """`value` as an int (a numpy integer, e.g. a budget computed with numpy, becomes the int it holds)."""
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"`{name}` must be an int, got {value!r} ({type(value).__name__}).")
            value = int(value)
            if value < minimum:
                raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
            return value

        self.budget = _int("budget", self.budget, 0)
        self.n_sink = _int("n_sink", self.n_sink, 0)
        self.window = _int("window", self.window, 1)
        self.block_size = _int("block_size", self.block_size, 1)
        self.layers_in_flight = _int("layers_in_flight", self.layers_in_flight, 1)
        self.fetch_factor = _int("fetch_factor", self.fetch_factor, 1)
        self.resident_factor = _int("resident_factor", self.resident_factor, 1)
        self.early_layers = _int("early_layers", self.early_layers, 0)
        self.early_layer_budget = _int("early_layer_budget", self.early_layer_budget, 0)
        if self.retrieval_threads is not None:
            self.retrieval_threads = _int("retrieval_threads", self.retrieval_threads, 0)
        self.prefill_chunk_size = _int("prefill_chunk_size", self.prefill_chunk_size, 1)
        self.ngram_size = _int("ngram_size", self.ngram_size, 1)
        self.lookahead = _int("lookahead", self.lookahead, 0)
        self.host_chunk_tokens = _int("host_chunk_tokens", self.host_chunk_tokens, 1)
        if self.max_host_bytes is not None:
            self.max_host_bytes = _int("max_host_bytes", self.max_host_bytes, 1)
        if self.lookahead >= self.layers_in_flight:
            raise ValueError(
                f"`lookahead` ({self.lookahead}) must be smaller than `layers_in_flight` ({self.layers_in_flight}): "
                "each copy issued ahead needs its own device slot. Raise layers_in_flight or lower lookahead."
            )
        if not isinstance(self.fetch_next, bool):
            raise ValueError(f"`fetch_next` must be a bool, got {self.fetch_next!r}.")
        wanted = self.fetch_factor + int(self.fetch_next)
        if self.resident_factor < wanted:
            raise ValueError(
                f"`resident_factor` ({self.resident_factor}) must be at least what one step wants resident, "
                f"fetch_factor{' + 1 (fetch_next)' if self.fetch_next else ''} = {wanted}: raise resident_factor "
                f"(cache_config {{\"resident_factor\": {wanted}}}; on the command line --cache-config)"
                + (" or lower fetch_factor" if self.fetch_factor > 1 else "")
                + (", or set fetch_next=False" if self.fetch_next else "") + ".")
        if self.resident_attention not in RESIDENT_ATTENTION:
            raise ValueError(f"`resident_attention` must be one of {RESIDENT_ATTENTION}, got "
                             f"{self.resident_attention!r}.")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise ValueError(f"`attention_kernel` must be one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}.")
        for layer_idx, layer_budget in self.layer_budgets.items():
            self.layer_budgets[layer_idx] = _int(f"layer_budgets[{layer_idx}]", layer_budget, 0)
            if layer_idx < 0:
                raise ValueError(f"`layer_budgets` keys are layer indices >= 0, got {layer_idx}.")
        if self.repair_drift is not None:
            if isinstance(self.repair_drift, bool) or not isinstance(self.repair_drift, numbers.Real):
                raise ValueError(
                    f"`repair_drift` must be a number >= 0 or None (off), got {self.repair_drift!r}."
                )
            try:
                self.repair_drift = float(self.repair_drift)  # numpy scalars, ints
            except OverflowError:  # an int beyond float range
                self.repair_drift = math.inf
            if not 0 <= self.repair_drift < math.inf:  # also rejects NaN
                raise ValueError(
                    f"`repair_drift` must be a finite number >= 0, got {self.repair_drift}; use None to turn it off."
                )
        if self.speculator not in SPECULATORS:
            raise ValueError(f"`speculator` must be one of {SPECULATORS}, got {self.speculator!r}.")
        if self.selector not in SELECTOR_NAMES:
            raise ValueError(f"`selector` must be one of {SELECTOR_NAMES}, got {self.selector!r}.")
        SELECTORS[self.selector].check_config(self)
        if self.drift_on_hit_steps is not None and not isinstance(self.drift_on_hit_steps, bool):
            raise ValueError(
                f"`drift_on_hit_steps` must be True, False or None (auto), got {self.drift_on_hit_steps!r}.")
        for name in ("prefill_progress", "record_timeline", "miss_repair", "fetch_next", "coupled_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")
