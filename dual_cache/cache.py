"""`DualDecoderCache`: a `transformers.Cache` whose full-attention layers keep every K/V in host memory and only
sink + local window + the current selection on the device (DESIGN.md §2).

Each full-attention layer is a `DualLayer`; sliding-window layers (e.g. Gemma 3) keep their own window on the
device with transformers' `DynamicSlidingWindowLayer`. The cache knows nothing of generation: it is told when a
prefill ends (`end_prefill`) and receives, per layer, the query that selects the next step's entries
(`submit_selection`). Retrieval and host→device transfer go through `TransferSchedule`.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .config import DualDecoderConfig
from .host_store import HostKVStore, planned_capacity
from .kernels import KVSegment
from .layer_types import SLIDING_ATTENTION, resolve_layer_types
from .schedule import Selection, TransferSchedule
from .selectors import SELECTORS, Candidates, Selector


class HostMemoryError(MemoryError):
    """The host store of a request would not fit in the host memory the cache may use."""


def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def available_host_bytes() -> int:
    """Host memory available to new allocations now (Linux `MemAvailable`; else free physical pages), bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class _SequenceState:
    """State shared by all layers of one cache: which prompt positions are real tokens, where the sink ends."""

    prompt_valid: torch.Tensor | None = None  # (B, P) bool host; False at pad positions
    sink_last: torch.Tensor | None = None  # (B,) int64 host: last sink position (first real position - 1 if none)
    first_real: torch.Tensor | None = None  # (B,) int64 host: first real (non-pad) position; where blocks begin
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # hi -> (B, hi) bool host
    ring: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # n -> ring positions, valid

    def first_real_so_far(self, host: HostKVStore) -> torch.Tensor:
        """`(B,)` int64 first real position among the `host.length` prompt positions recorded so far (that length
        where a sequence has none yet; 0 when no padding was recorded)."""
        batch, n = host.shape_prefix[0], host.length
        valid = self.prompt_valid
        if valid is None or valid.shape[1] != n:
            return torch.zeros(batch, dtype=torch.long)
        return torch.where(valid, torch.arange(n), n).amin(dim=1)

    def candidates_below(self, hi: int) -> torch.Tensor:
        """`(B, hi)` bool: positions < hi that are real tokens and not sink tokens (selectable)."""
        cached = self.candidates.get(hi)
        if cached is None:
            positions = torch.arange(hi)
            cached = positions[None, :] > self.sink_last[:, None]
            prompt = min(hi, self.prompt_valid.shape[1])
            cached[:, :prompt] &= self.prompt_valid[:, :prompt]
            if len(self.candidates) >= 2:  # keep two bounds: a repaired step asks for hi and hi + 1 in turn
                del self.candidates[min(self.candidates)]
            self.candidates[hi] = cached
        return cached

    def ring_view(self, n: int, q: int, window: int, ring_size: int, sink_last: torch.Tensor):
        """Positions `(1, 1, R)` held by each window-ring slot once `n` tokens are stored, and their validity
        `(B, 1, R)` for a step of `q` new tokens: the window `[n - q - window, n)` minus sink and pad positions.
        Shared by every layer of the step (all layers hold the same positions)."""
        cached = self.ring.get(n)
        if cached is None:
            slots = torch.arange(ring_size, device=sink_last.device)
            positions = (n - 1) - torch.remainder(n - 1 - slots, ring_size)  # latest position p < n in slot
            valid = (positions >= n - q - window) & (positions >= 0) & (positions[None, :] > sink_last)
            cached = (positions[None, None, :], valid[:, None, :])
            self.ring = {n: cached}
        return cached


def query_drift(query: torch.Tensor, chooser: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Relative distance between a token's query and the query that chose its entries, per sequence.

    Args:
        query: `(B, H_q, D)` the real token's query at one layer (any float dtype, any device).
        chooser: `(B, H_q, D)` the query that selected the entries it attends to (the speculated token's).
        kv_heads: `H_kv`; the query heads of one KV head (its GQA group) are compared as one `G·D` vector.

    Returns:
        `(B,)` float32 on `query`'s device: the largest over KV heads of `‖q − q̂‖₂ / ‖q‖₂` (0 for equal queries;
        huge or inf for a zero query with a non-zero `chooser`).
    """
    batch = query.shape[0]
    real = query.float().reshape(batch, kv_heads, -1)
    diff = (real - chooser.float().reshape(batch, kv_heads, -1)).norm(dim=-1)
    return (diff / real.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)).amax(dim=-1)


class DualLayer(CacheLayerMixin):
    """One full-attention layer: host store of every K/V plus device-resident sink, window ring and selection.

    Device tiers (B = batch, H_kv = KV heads, D = head dim):
      - sink: `(B, H_kv, n_sink, D)`, the first `n_sink` real prompt tokens of each sequence;
      - window ring: `(B, H_kv, window + 2, D)`, slot `p % (window + 2)` holds position p; the last `window`
        committed tokens plus the (up to two) tokens of the running step;
      - selection: a slot of the schedule's pool, `(B, H_kv, budget, D)`;
      - whatever the selector keeps there (`Selector.device_bytes`; only the Quest baseline's page metadata).

    The layer's `Selector` (`config.selector`) owns any host-side index; the layer extends it after each prefill
    chunk and submits its selection jobs to the schedule.

    `update()` appends new K/V to the host store (and the ring once decoding) and returns them unchanged: the
    dual attention function reads the tiers through `prefill_kv()` and `decode_segments()`.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, layer_idx: int, config: DualDecoderConfig, owner: "DualDecoderCache") -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.budget = config.budget_for_layer(layer_idx)
        self.owner = owner
        self.state = owner.state
        self.host: HostKVStore | None = None
        self.decoding = False
        self.last_query: torch.Tensor | None = None  # (B, H_q, D) host, the latest position's query
        self.scaling: float = 1.0
        self.sink_keys = self.sink_values = self.sink_pos = self.sink_valid = self.sink_last = None
        self.ring_keys = self.ring_values = None
        self.ring_size = config.window + 2
        self.selector: Selector | None = None  # built with the host store when the layer retrieves (budget > 0)
        self.chooser_query: torch.Tensor | None = None  # (B, H_q, D) the query that chose the next step's entries

    @property
    def schedule(self) -> TransferSchedule:
        return self.owner.schedule

    # --- transformers CacheLayerMixin API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, q, dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.owner.reserve_host(batch, q, key_states.dtype, kv_heads=kv_heads, head_dim=dim)
        self.host = HostKVStore(
            batch, kv_heads, dim, key_states.dtype, self.config.host_chunk_tokens,
            page_lock=key_states.device.type == "cuda", on_alloc=self.owner.claim_host_bytes,
        )
        self.host.reserve(self.owner.prompt_tokens)
        if self.budget > 0:
            self.selector = SELECTORS[self.config.selector](
                self.config, self.budget, self.host, self.device, claim_host=self.owner.claim_host_bytes
            )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `(B, H_kv, q, D)` new keys/values; returns them unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.host.length
        self.host.append(key_states, value_states)
        if self.decoding:
            q = key_states.shape[2]
            slot = start % self.ring_size
            if slot + q <= self.ring_size:
                self.ring_keys[:, :, slot : slot + q] = key_states
                self.ring_values[:, :, slot : slot + q] = value_states
            else:
                slots = torch.arange(start, start + q, device=self.device) % self.ring_size
                self.ring_keys.index_copy_(2, slots, key_states)
                self.ring_values.index_copy_(2, slots, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.host is None else self.host.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (negative counts only, as transformers ≥5.22)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative count of tokens to remove, e.g. crop(-1)."
            )
        if tokens_to_remove == 0 or self.host is None:
            return
        self.host.crop(-tokens_to_remove)
        if self.selector is not None:
            self.selector.truncate(self.host.length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "DualDecoderCache cannot reorder sequences (beam search). Use num_beams=1 with cache_implementation='dual'."
        )

    def reset(self) -> None:
        self.free()
        self.host = None
        self.decoding = False
        self.is_initialized = False

    # --- tiers used by the dual attention function -----------------------------------------------------
    def prefill_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of every position so far, `(B, H_kv, n, D)` on the compute device, for dense prefill.

        The chunk's own `key_states`/`value_states` `(B, H_kv, q, D)` are used as they are; earlier chunks are
        read back from the host store (one layer at a time on the device).
        """
        q = key_states.shape[2]
        past = self.host.length - q
        if past == 0:
            return key_states, value_states
        self.host.wait_written()
        keys, values = self.host.read(0, past)
        keys = torch.cat([keys.to(self.device, non_blocking=True), key_states], dim=2)
        values = torch.cat([values.to(self.device, non_blocking=True), value_states], dim=2)
        return keys, values

    def index_prompt(self) -> None:
        """Extend the selector's host index over the prompt tokens stored so far (after each prefill chunk)."""
        if self.selector is None:
            return
        self.selector.extend(self.host.length, self.state.first_real_so_far(self.host))

    def record_query(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the last position's query `(B, H_q, D)` of a prefill chunk; it selects the first decode step."""
        self.last_query = query.detach().to("cpu", torch.float32)
        self.scaling = scaling

    def start_decoding(self) -> None:
        """Fill sink and window tiers from the host store and schedule the first step's selection."""
        self.host.wait_written()
        n = self.host.length
        batch, kv_heads = self.host.shape_prefix
        dim = self.host.head_dim
        n_sink = self.config.n_sink
        valid = self.state.prompt_valid
        # sink positions: the first n_sink real tokens of each sequence (pads never are sink tokens)
        order = torch.where(valid, torch.arange(valid.shape[1]), valid.shape[1] + torch.arange(valid.shape[1]))
        first = torch.sort(order, dim=1).values[:, :n_sink]
        sink_valid = first < valid.shape[1]
        sink_pos = torch.where(sink_valid, first, torch.zeros_like(first))
        sink_keys, sink_values = self.host.gather(sink_pos[:, None, :].expand(batch, kv_heads, sink_pos.shape[1]))
        self.sink_keys, self.sink_values = sink_keys.to(self.device), sink_values.to(self.device)
        self.sink_pos = sink_pos[:, None, :].to(self.device)  # (B, 1, n_sink)
        self.sink_valid = sink_valid[:, None, :].to(self.device)
        self.sink_last = self.state.sink_last[:, None].to(self.device)  # (B, 1)
        # window ring: the last `window` positions (ring slot p % ring_size)
        self.ring_keys = torch.zeros(batch, kv_heads, self.ring_size, dim, dtype=self.dtype, device=self.device)
        self.ring_values = torch.zeros_like(self.ring_keys)
        first_pos = max(0, n - self.config.window)
        slots = torch.arange(first_pos, n, device=self.device) % self.ring_size
        keys, values = self.host.read(first_pos, n)
        self.ring_keys.index_copy_(2, slots, keys.to(self.device))
        self.ring_values.index_copy_(2, slots, values.to(self.device))
        self.decoding = True
        if self.selector is not None and self.selector.prefetched:
            self.submit_selection(self.last_query, committed=n)
        self.last_query = None

    def submit_selection(self, query: torch.Tensor, committed: int) -> None:
        """Schedule the selection for the step whose committed length is `committed` tokens.

        Args:
            query: `(B, H_q, D)` query (any device) of the (speculated or real) token predicting that step.
            committed: real tokens in the cache when that step starts; its window is `[committed - window,
                committed)` and candidates lie in `[0, committed - window)` minus sink and pads.
        """
        if self.budget == 0:
            return
        self.chooser_query = query
        batch, kv_heads = self.host.shape_prefix
        shape = (batch, kv_heads, self.budget, self.host.head_dim)
        self.schedule.submit(self.layer_idx, self._selection_job(query, committed), shape, self.host.dtype)

    def repair_selection(self, query: torch.Tensor, committed: int, rows: torch.Tensor) -> None:
        """Miss repair: re-select the running step's entries of `rows` with the real token's own query.

        Args:
            query: `(B, H_q, D)` the real token's query at this layer (slot 0 of the step).
            committed: real tokens in the cache before the step (as in `submit_selection`).
            rows: `(B,)` bool host tensor, True for the sequences repaired (a miss, or a drifted query).
        """
        if self.budget > 0:
            self.schedule.repair(self.layer_idx, self._selection_job(query, committed, rows), rows)

    def _selection_job(self, query: torch.Tensor, committed: int, rows: torch.Tensor | None = None):
        """A job filling a staging `Selection` `(B, H_kv, budget[, D])` with the selector's choice for `query`
        `(B, H_q, D)` among the candidates below `committed - window`, then gathering their K/V from the host.

        With `rows` (`(B,)` bool host, a repair of a strict subset), only those sequences are selected, one at a
        time (a sequence's selection depends on it alone); the other rows of the staging buffer get placeholder
        entries (position 0, invalid), which `TransferSchedule.repair` never copies."""
        hi = max(0, committed - self.config.window)
        subset = None if rows is None or bool(rows.all()) else rows.nonzero().flatten().tolist()
        query_ready = None
        if query.device.type == "cuda":  # no host sync on the launch thread: the job waits for the copy's event
            host_query = torch.empty(query.shape, dtype=torch.float32, pin_memory=True)
            host_query.copy_(query.detach(), non_blocking=True)
            query_ready = torch.cuda.Event()
            query_ready.record(torch.cuda.current_stream(query.device))
        else:
            host_query = query.detach().to("cpu", torch.float32)
        host, selector, scaling = self.host, self.selector, self.scaling
        candidates = Candidates(self.state.candidates_below(hi), self.state.first_real)

        def job(staging: Selection) -> None:
            if query_ready is not None:
                query_ready.synchronize()
            if hi == 0:
                staging.indices.zero_()
                staging.valid.zero_()
            else:
                host.wait_written()
                if subset is None:
                    indices, valid = selector.select(host_query, candidates, scaling)
                else:
                    indices, valid = staging.indices.zero_(), staging.valid.zero_()
                    for row in subset:
                        one = slice(row, row + 1)
                        indices[one], valid[one] = selector.select(host_query[one], candidates.row(row), scaling)
                staging.indices.copy_(indices)
                staging.valid.copy_(valid)
            host.gather(staging.indices, out=(staging.keys, staging.values))

        return job

    def decode_segments(self, query: torch.Tensor, scaling: float) -> list[KVSegment]:
        """The device-resident KV segments the running step attends to: sink, selection, window ring.

        Args:
            query: `(B, H_q, q, D)` queries of the step (q = 1 or 2); the oracle and Quest selectors select with
                the real token's query (slot 0) here, synchronously, and so does miss repair for the rows in
                `DualDecoderCache.repair_rows`.

        Returns:
            `KVSegment`s read in place (no concatenation); the ring segment also holds the step's q new tokens.
        """
        q = query.shape[2]
        n = self.host.length  # includes the q new tokens
        segments = [KVSegment(self.sink_keys, self.sink_values, self.sink_pos, self.sink_valid)]
        if self.budget > 0:
            selector = self.selector
            if not selector.prefetched:  # chosen now, with the real token's query
                self.scaling = scaling
                self.submit_selection(query[:, :, 0], committed=n - q)
            selection = self.schedule.acquire(self.layer_idx)
            if selector.repairable and not selector.selects_everything(n - q - self.config.window):
                repair = self._rows_to_repair(query[:, :, 0])
                if repair is not None:
                    self.repair_selection(query[:, :, 0], n - q, repair)
            segments.append(KVSegment(selection.keys, selection.values, selection.indices, selection.valid))
        ring_pos, ring_valid = self.state.ring_view(n, q, self.config.window, self.ring_size, self.sink_last)
        segments.append(KVSegment(self.ring_keys, self.ring_values, ring_pos, ring_valid))
        return segments

    def _rows_to_repair(self, real_query: torch.Tensor) -> torch.Tensor | None:
        """`(B,)` bool host rows whose entries this layer re-selects with `real_query` `(B, H_q, D)`: the owner's
        miss rows, plus the hit rows whose query drifted from the one that chose the entries (`repair_drift`);
        None when there are none."""
        missed, hit = self.owner.repair_rows, self.owner.drift_check_rows
        threshold = self.config.repair_drift
        if hit is None or threshold is None or self.chooser_query is None:
            return missed
        chooser = self.chooser_query.to(real_query.device, non_blocking=True)
        drifted = (query_drift(real_query, chooser, self.host.shape_prefix[1]) >= threshold).cpu() & hit
        if not drifted.any():
            return missed
        self.owner.drift_repairs += 1
        return drifted if missed is None else missed | drifted

    def release(self) -> None:
        """The running step's attention at this layer is queued; its selection slot may be reused."""
        if self.budget > 0:
            self.schedule.release(self.layer_idx)

    @property
    def device_bytes(self) -> int:
        """Bytes of this layer's device tiers: sink, window ring, what the selector keeps there (the Quest
        baseline's page metadata); selection slots are pooled and counted by the schedule."""
        tensors = (self.sink_keys, self.sink_values, self.ring_keys, self.ring_values)
        selector = 0 if self.selector is None else self.selector.device_bytes
        return sum(t.nbytes for t in tensors if t is not None) + selector

    @property
    def host_bytes(self) -> int:
        """Host bytes of this layer's store and of its selector's host state (an index, a key copy)."""
        if self.host is None:
            return 0
        return self.host.nbytes + (0 if self.selector is None else self.selector.host_bytes)

    def dense_bytes(self) -> int:
        """Bytes a `DynamicCache` layer would hold for the same tokens."""
        if self.host is None:
            return 0
        batch, kv_heads = self.host.shape_prefix
        element = torch.empty((), dtype=self.host.dtype).element_size()
        return 2 * batch * kv_heads * self.host.length * self.host.head_dim * element

    def free(self) -> None:
        """Release host chunks and device tiers (the token count stays readable)."""
        if self.host is not None:
            self.host.free()
        if self.selector is not None:
            self.selector.free()
        self.sink_keys = self.sink_values = self.ring_keys = self.ring_values = None
        self.chooser_query = None


class DualDecoderCache(Cache):
    """A KV cache for DualDecoder decoding: the full cache in host memory, only a few entries per step on device.

    Use it through `model.generate(..., cache_implementation="dual", cache_config={...})` after
    `import dual_cache`, or pass `cache=DualDecoderCache(model.config, budget=256)`.

    Args:
        config: the model's `PretrainedConfig` (its text config is used); needs `num_hidden_layers`,
            `num_key_value_heads` and, for mixed models, `layer_types` + `sliding_window`.
        dual_config: a `DualDecoderConfig`; or give its fields as keyword arguments (`budget=256, ...`).
        max_cache_len: expected total tokens per sequence (prompt + new), checked against the host memory limit
            before the first allocation (tokens).

    Raises:
        ValueError: for bad option values, or layer types this cache cannot serve (anything other than
            full and sliding-window attention). A sliding window at least `max_cache_len` long is served as full
            attention (`fit_layers` decides again once the request's length is known).
    """

    def __init__(
        self,
        config: Any,
        dual_config: DualDecoderConfig | None = None,
        max_cache_len: int | None = None,
        **options: Any,
    ) -> None:
        if dual_config is not None and options:
            raise ValueError("Pass either `dual_config` or option keywords to DualDecoderCache, not both.")
        self.dual_config = dual_config if dual_config is not None else DualDecoderConfig.from_dict(options)
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n_layers = text_config.num_hidden_layers
        self.text_config = text_config
        for layer_idx in self.dual_config.layer_budgets:
            if layer_idx >= n_layers:
                raise ValueError(
                    f"`layer_budgets` names layer {layer_idx}, but the model has {n_layers} layers (0..{n_layers - 1})."
                )
        self.kv_heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self.state = _SequenceState()
        self.schedule: TransferSchedule | None = None
        self.max_cache_len = max_cache_len
        self.spec_hits = 0
        self.spec_steps = 0
        self.repair_rows: torch.Tensor | None = None
        self.drift_check_rows: torch.Tensor | None = None
        self.drift_repairs = 0
        self.host_limit: int | None = None
        self.host_claimed = 0
        self.prompt_tokens = 0  # reserved at once by each host store (`reserve_host`)
        self._final_stats: dict | None = None
        self._timeline: list[dict] = []
        super().__init__(layers=self._build_layers(max_cache_len))

    def _build_layers(self, tokens: int | None) -> list[CacheLayerMixin]:
        """Sets `layer_types` for requests of `tokens` tokens and returns one fresh layer per model layer."""
        self.layer_types = resolve_layer_types(self.text_config, tokens)
        layers: list[CacheLayerMixin] = []
        for layer_idx, layer_type in enumerate(self.layer_types):
            if layer_type == SLIDING_ATTENTION:
                layer = DynamicSlidingWindowLayer(sliding_window=self.text_config.sliding_window)
                layer.activate_past_recording()  # keeps the speculated token until crop(-1) removes it
            else:
                layer = DualLayer(layer_idx, self.dual_config, self)
            layers.append(layer)
        return layers

    def fit_layers(self, tokens: int) -> None:
        """Before anything is stored: serve as full attention the sliding-window layers whose window covers a
        request of `tokens` tokens per sequence (`layer_types.resolve_layer_types`)."""
        if self.get_seq_length() == 0 and resolve_layer_types(self.text_config, tokens) != self.layer_types:
            self.layers = self._build_layers(tokens)

    @property
    def dual_layers(self) -> list[DualLayer]:
        return [layer for layer in self.layers if isinstance(layer, DualLayer)]

    def _ensure_schedule(self, device: torch.device) -> None:
        if self._final_stats is not None:
            raise RuntimeError("This DualDecoderCache was closed; create a new one for the next generate() call.")
        if self.schedule is None:
            if self.max_cache_len:  # no layer can select or hold more than every token of the request
                for layer in self.dual_layers:
                    layer.budget = min(layer.budget, self.max_cache_len)
                    layer.ring_size = min(self.dual_config.window, self.max_cache_len) + 2
            retrieving = [layer for layer in self.dual_layers if layer.budget > 0]
            self.schedule = TransferSchedule(
                device,
                layer_order=[layer.layer_idx for layer in retrieving],
                slot_tokens=max([layer.budget for layer in retrieving], default=0),
                layers_in_flight=self.dual_config.layers_in_flight,
                lookahead=self.dual_config.lookahead,
                threads=self.dual_config.threads_for(torch.device(device)),
                record_timeline=self.dual_config.record_timeline,
            )

    def check_model(self, config: Any) -> None:
        """Raise `ValueError` unless this cache was built for a model with `config`'s layers and KV head shape."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        mine = (len(self.layers), self.kv_heads, self.head_dim)
        theirs = (text.num_hidden_layers, kv_heads, head_dim)
        if mine != theirs:
            raise ValueError(
                f"This DualDecoderCache was built for (layers, KV heads, head_dim) = {mine}, but the model has "
                f"{theirs}. Build it from the model's own config: DualDecoderCache(model.config, ...)."
            )

    def host_bytes_needed(self, batch_size: int, tokens: int, dtype: torch.dtype, kv_heads: int | None = None,
                          head_dim: int | None = None, prompt_tokens: int = 0) -> int:
        """Host bytes the stores of every full-attention layer (and their selectors' host state) take for `tokens`
        tokens of `batch_size` sequences, when the first `prompt_tokens` are reserved at once and the rest arrive
        a decode step at a time (`host_store.planned_capacity`)."""
        kv_heads, head_dim = kv_heads or self.kv_heads, head_dim or self.head_dim
        capacity = planned_capacity(prompt_tokens, tokens, self.dual_config.host_chunk_tokens)
        store = HostKVStore.chunk_nbytes(batch_size, kv_heads, head_dim, dtype, capacity)
        selector = SELECTORS[self.dual_config.selector].host_bytes_per_token(
            self.dual_config, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size()
        )
        retrieving = sum(1 for layer in self.dual_layers if layer.budget > 0)
        return len(self.dual_layers) * store + int(retrieving * batch_size * capacity * selector)

    def reserve_host(self, batch_size: int, tokens: int, dtype: torch.dtype, kv_heads: int | None = None,
                     head_dim: int | None = None, prompt_tokens: int | None = None) -> None:
        """Check, before anything is allocated, that `tokens` tokens per sequence fit in host memory.

        Uses `max(tokens, max_cache_len)`. The limit is `max_host_bytes`, or 90% of the host memory available at
        the first check. With `prompt_tokens`, every layer's host store reserves that many tokens in its first
        chunk when it is created (the prompt), and grows geometrically from there.

        Raises:
            HostMemoryError: naming the bytes needed, the bytes allowed and the knobs to turn.
        """
        if self.host_claimed:
            return  # already allocating: each further chunk is checked by `claim_host_bytes`
        if prompt_tokens is not None:
            self.prompt_tokens = prompt_tokens
        tokens = max(tokens, self.max_cache_len or 0)
        needed = self.host_bytes_needed(batch_size, tokens, dtype, kv_heads, head_dim, self.prompt_tokens)
        if self.host_limit is None:
            configured = self.dual_config.max_host_bytes
            self.host_limit = configured if configured is not None else int(0.9 * available_host_bytes())
        if self.host_claimed + needed > self.host_limit:
            raise HostMemoryError(
                f"The dual cache needs {_size(needed)} ({needed:,} bytes) of host memory for {batch_size} sequence(s) of "
                f"{tokens} tokens ({len(self.dual_layers)} full-attention layers), but may use "
                f"{_size(self.host_limit - self.host_claimed)} more (max_host_bytes="
                f"{self.dual_config.max_host_bytes}). Lower the batch size, the prompt length or max_new_tokens, "
                "or raise `max_host_bytes` in cache_config."
            )

    def claim_host_bytes(self, nbytes: int) -> None:
        """Account for a host chunk about to be allocated; raises `HostMemoryError` past the limit."""
        if self.host_limit is None:
            self.reserve_host(1, 0, torch.float32)  # sets the limit
        if self.host_claimed + nbytes > self.host_limit:
            raise HostMemoryError(
                f"The dual cache's host stores would exceed {_size(self.host_limit)} (another "
                f"{_size(nbytes)} chunk requested). Lower the batch size or the number of tokens, or raise "
                "`max_host_bytes` in cache_config."
            )
        self.host_claimed += nbytes

    @torch.compiler.disable  # host-side work: a graph break under torch.compile, never traced
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store `(B, H_kv, q, D)` new keys/values of `layer_idx` (transformers `Cache.update` contract)."""
        if isinstance(self.layers[layer_idx], DualLayer):
            self._ensure_schedule(key_states.device)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def record_prompt_validity(self, valid: torch.Tensor) -> None:
        """Record which key positions `[0, n)` are real tokens; `valid` is `(B, n)` bool, False at pads."""
        self.state.prompt_valid = valid.detach().to("cpu", torch.bool)

    def end_prefill(self) -> None:
        """The prompt is complete: fill the device sink and window tiers and schedule step 1's selection.

        Raises:
            RuntimeError: if no prompt was stored.
        """
        dual = self.dual_layers
        if not dual or dual[0].host is None:
            raise RuntimeError("end_prefill() called before any prompt tokens were stored in the cache.")
        n = dual[0].host.length
        batch = dual[0].host.shape_prefix[0]
        if self.state.prompt_valid is None or self.state.prompt_valid.shape[1] != n:
            self.state.prompt_valid = torch.ones(batch, n, dtype=torch.bool)
        valid = self.state.prompt_valid
        n_sink = self.dual_config.n_sink
        sink_count = valid.long().cumsum(dim=1)
        is_sink = valid & (sink_count <= n_sink)
        positions = torch.arange(n).expand(batch, n)
        first_real = torch.where(valid, positions, torch.full_like(positions, n)).amin(dim=1)
        last_sink = torch.where(is_sink, positions, torch.full_like(positions, -1)).amax(dim=1)
        self.state.sink_last = torch.maximum(last_sink, first_real - 1)  # pads lie at or below it
        self.state.first_real = first_real
        self.state.candidates = {}
        self.state.ring = {}
        for layer in dual:
            layer.start_decoding()

    def set_repair_rows(self, missed: torch.Tensor | None, hit: torch.Tensor | None = None) -> None:
        """Mark the sequences whose selections for the next forward are repaired (`miss_repair`).

        Args:
            missed: `(B,)` bool, True where the speculated token that chose the next step's entries differed from
                the real token (or on the first decode step): repaired in every layer of the next forward.
            hit: `(B,)` bool, True for the live sequences whose speculated token hit: repaired in the layers where
                their query drifted (`repair_drift`). None (or no True) = nothing to repair / check.
        """
        def host_rows(rows: torch.Tensor | None) -> torch.Tensor | None:
            if rows is None:
                return None
            rows = rows.detach().to("cpu", torch.bool)
            return rows if rows.any() else None

        self.repair_rows, self.drift_check_rows = host_rows(missed), host_rows(hit)

    def record_speculation(self, hits: int, steps: int) -> None:
        """Add speculation outcomes: `hits` of `steps` speculated tokens equalled the real next token."""
        self.spec_hits += int(hits)
        self.spec_steps += int(steps)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens stored (true count for every layer type; sliding layers report their cumulative length)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError(
            "DualDecoderCache cannot reorder sequences (beam search). Use num_beams=1 with cache_implementation='dual'."
        )

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("DualDecoderCache cannot be expanded after prefill; expand the inputs instead.")

    def batch_select_indices(self, indices: torch.Tensor):
        raise NotImplementedError("DualDecoderCache cannot drop sequences after prefill.")

    def stats(self) -> dict[str, float]:
        """Memory, traffic and pipeline accounting (frozen when the cache is closed).

        Returns a dict with:
            device_bytes: bytes resident on the compute device while decoding (sink + window tiers of full
                layers, Quest page metadata, the selection pool, the windows of sliding layers);
            host_bytes: bytes of the host stores;
            dense_equivalent_bytes: bytes a `DynamicCache` would hold on the device for the same tokens;
            bytes_copied: host→device bytes of selections so far (K, V, indices, validity);
            spec_hits, spec_steps: speculated tokens that equalled the real one / speculated tokens;
            seq_length: tokens stored; steps: decode forward passes;
            retrieval_seconds, copy_seconds: host time spent scoring + gathering, and issuing copies;
            wait_seconds: time the compute side waited for selections (all of it on the synchronous path);
            overlap_ratio: `1 − wait / (retrieval + copy)` (nan before the first decode step);
            repairs, repaired_steps, repair_seconds: (step, layer) selections redone by miss repair (misses and
                drift), the decode steps in which any was, and the time they took;
            drift_repairs: those of the `repairs` made for drifted queries on hit steps (`repair_drift`).
        """
        if self._final_stats is not None:
            return dict(self._final_stats)
        device = host = dense = 0
        for layer in self.layers:
            if isinstance(layer, DualLayer):
                device += layer.device_bytes
                host += layer.host_bytes
                dense += layer.dense_bytes()
            elif layer.is_initialized and layer.keys is not None:
                nbytes = layer.keys.nbytes + layer.values.nbytes
                device += nbytes
                dense += nbytes
        schedule = self.schedule
        if schedule is not None:
            device += schedule.device_bytes
        return {
            "device_bytes": device,
            "host_bytes": host,
            "dense_equivalent_bytes": dense,
            "bytes_copied": 0 if schedule is None else schedule.bytes_copied,
            "spec_hits": self.spec_hits,
            "spec_steps": self.spec_steps,
            "seq_length": self.get_seq_length(),
            "steps": 0 if schedule is None else schedule.steps,
            "retrieval_seconds": 0.0 if schedule is None else schedule.retrieval_seconds,
            "copy_seconds": 0.0 if schedule is None else schedule.copy_seconds,
            "wait_seconds": 0.0 if schedule is None else schedule.wait_seconds,
            "overlap_ratio": float("nan") if schedule is None else schedule.overlap_ratio(),
            "repairs": 0 if schedule is None else schedule.repairs,
            "repaired_steps": 0 if schedule is None else schedule.repaired_steps,
            "repair_seconds": 0.0 if schedule is None else schedule.repair_seconds,
            "drift_repairs": self.drift_repairs,
        }

    def timeline(self) -> list[dict]:
        """Per-(step, layer) pipeline records (needs `record_timeline=True`); see `TransferSchedule.timeline`."""
        return list(self._timeline) if self._final_stats is not None else (
            [] if self.schedule is None else self.schedule.timeline()
        )

    def dump_timeline(self, path: str) -> None:
        """Write `{"stats": stats(), "timeline": timeline()}` as JSON to `path`."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"stats": self.stats(), "timeline": self.timeline()}, handle, indent=1)

    def close(self) -> None:
        """Stop the retrieval thread, free the device tiers, the selection pool and the host stores (pinned or
        registered memory included). Idempotent; `stats()`, `timeline()` and `get_seq_length()` stay readable."""
        if self._final_stats is not None:
            return
        final, timeline = self.stats(), self.timeline()
        self.repair_rows = self.drift_check_rows = None
        try:
            if self.schedule is not None:
                self.schedule.close()
        finally:
            self._final_stats, self._timeline = final, timeline
            self.schedule = None
            for layer in self.dual_layers:
                layer.free()

    def __deepcopy__(self, memo: dict) -> "DualDecoderCache":
        """A copy of a cache that holds no tokens yet (or is closed); an open cache holding tokens is refused.

        Raises:
            TypeError: when the cache holds tokens and is open (its host stores, device tiers and retrieval thread
                serve one request).
        """
        if self._final_stats is None and self.get_seq_length() > 0:
            raise TypeError(
                "A DualDecoderCache that holds tokens cannot be copied: its host stores, device tiers and retrieval "
                "thread serve one running request. Copy it before the request starts (or once it is closed), or "
                "run a new generate() with a fresh DualDecoderCache."
            )
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            setattr(copied, name, copy.deepcopy(value, memo))
        return copied

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
