"""`DualDecoderCache`: a `transformers.Cache` whose full-attention layers keep every K/V in host memory and only
sink + local window + the current selection on the device (DESIGN.md §2).

Each full-attention layer is a `DualLayer`; sliding-window layers (e.g. Gemma 3) keep their own window on the
device with transformers' `DynamicSlidingWindowLayer`. The cache knows nothing of generation: it is told when a
prefill ends (`end_prefill`) and receives, per layer, the query that selects the next step's entries
(`submit_selection`). Retrieval and host→device transfer go through `TransferSchedule`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import retrieval
from .config import DualDecoderConfig
from .host_store import HostKVStore
from .schedule import Selection, TransferSchedule

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class _SequenceState:
    """State shared by all layers of one cache: which prompt positions are real tokens, where the sink ends."""

    prompt_valid: torch.Tensor | None = None  # (B, P) bool host; False at pad positions
    sink_last: torch.Tensor | None = None  # (B,) int64 host: last sink position (-1 if no sink)
    candidates: dict[int, torch.Tensor] = field(default_factory=dict)  # hi -> (B, hi) bool host

    def candidates_below(self, hi: int) -> torch.Tensor:
        """`(B, hi)` bool: positions < hi that are real tokens and not sink tokens (selectable)."""
        cached = self.candidates.get(hi)
        if cached is None:
            positions = torch.arange(hi)
            cached = positions[None, :] > self.sink_last[:, None]
            prompt = min(hi, self.prompt_valid.shape[1])
            cached[:, :prompt] &= self.prompt_valid[:, :prompt]
            self.candidates = {hi: cached}  # one step's bound at a time
        return cached


class DualLayer(CacheLayerMixin):
    """One full-attention layer: host store of every K/V plus device-resident sink, window ring and selection.

    Device tiers (B = batch, H_kv = KV heads, D = head dim):
      - sink: `(B, H_kv, n_sink, D)`, the first `n_sink` real prompt tokens of each sequence;
      - window ring: `(B, H_kv, window + 2, D)`, slot `p % (window + 2)` holds position p; the last `window`
        committed tokens plus the (up to two) tokens of the running step;
      - selection: a slot of the schedule's pool, `(B, H_kv, budget, D)`.

    `update()` appends new K/V to the host store (and the ring once decoding) and returns them unchanged: the
    dual attention function reads the tiers through `prefill_kv()` and `decode_kv()`.
    """

    is_sliding = False
    is_croppable = True

    def __init__(
        self, layer_idx: int, config: DualDecoderConfig, state: _SequenceState, schedule: TransferSchedule,
        capacity: int | None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.budget = config.budget_for_layer(layer_idx)
        self.state = state
        self.schedule = schedule
        self.capacity_hint = capacity
        self.host: HostKVStore | None = None
        self.decoding = False
        self.last_query: torch.Tensor | None = None  # (B, H_q, D) host, the latest position's query
        self.scaling: float = 1.0
        self.sink_keys = self.sink_values = self.sink_pos = self.sink_valid = self.sink_last = None
        self.ring_keys = self.ring_values = None
        self.ring_size = config.window + 2

    # --- transformers CacheLayerMixin API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, q, dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.host = HostKVStore(
            batch, kv_heads, dim, key_states.dtype, max(self.capacity_hint or 0, q + 2),
            pin=key_states.device.type == "cuda",
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `(B, H_kv, q, D)` new keys/values; returns them unchanged."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.host.length
        self.host.append(key_states, value_states)
        if self.decoding:
            slots = [(start + i) % self.ring_size for i in range(key_states.shape[2])]
            self.ring_keys[:, :, slots] = key_states
            self.ring_values[:, :, slots] = value_states
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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "DualDecoderCache cannot reorder sequences (beam search). Use num_beams=1 with cache_implementation='dual'."
        )

    def reset(self) -> None:
        self.host = None
        self.decoding = False
        self.is_initialized = False

    # --- tiers used by the dual attention function -----------------------------------------------------
    def prefill_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All keys/values so far, `(B, H_kv, n, D)` on the compute device (one layer at a time)."""
        n = self.host.length
        keys, values = self.host.keys[:, :, :n], self.host.values[:, :, :n]
        if self.device.type != "cpu":
            keys = keys.to(self.device, non_blocking=True)
            values = values.to(self.device, non_blocking=True)
        return keys, values

    def record_query(self, query: torch.Tensor, scaling: float) -> None:
        """Keep the last position's query `(B, H_q, D)` of a prefill chunk; it selects the first decode step."""
        self.last_query = query.detach().to("cpu", torch.float32)
        self.scaling = scaling

    def start_decoding(self) -> None:
        """Fill sink and window tiers from the host store and schedule the first step's selection."""
        n = self.host.length
        batch, kv_heads = self.host.shape_prefix
        n_sink = self.config.n_sink
        valid = self.state.prompt_valid
        # sink positions: the first n_sink real tokens of each sequence (pads never are sink tokens)
        order = torch.where(valid, torch.arange(valid.shape[1]), valid.shape[1] + torch.arange(valid.shape[1]))
        first = torch.sort(order, dim=1).values[:, :n_sink]
        sink_valid = first < valid.shape[1]
        sink_pos = torch.where(sink_valid, first, torch.zeros_like(first))
        index = sink_pos[:, None, :, None].expand(batch, kv_heads, sink_pos.shape[1], self.host.head_dim)
        self.sink_keys = torch.gather(self.host.keys[:, :, :n], 2, index).to(self.device)
        self.sink_values = torch.gather(self.host.values[:, :, :n], 2, index).to(self.device)
        self.sink_pos = sink_pos.to(self.device)
        self.sink_valid = sink_valid.to(self.device)
        self.sink_last = self.state.sink_last[:, None].to(self.device)  # (B, 1)
        # window ring: the last `window` positions (ring slot p % ring_size)
        self.ring_keys = torch.zeros(
            batch, kv_heads, self.ring_size, self.host.head_dim, dtype=self.dtype, device=self.device
        )
        self.ring_values = torch.zeros_like(self.ring_keys)
        first_pos = max(0, n - self.config.window)
        positions = list(range(first_pos, n))
        slots = [p % self.ring_size for p in positions]
        self.ring_keys[:, :, slots] = self.host.keys[:, :, first_pos:n].to(self.device)
        self.ring_values[:, :, slots] = self.host.values[:, :, first_pos:n].to(self.device)
        self.decoding = True
        if self.config.selector != "oracle":
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
        hi = max(0, committed - self.config.window)
        host_query = query.detach().to("cpu", torch.float32)
        keys = self.host.keys[:, :, :hi]
        host = self.host
        candidates = self.state.candidates_below(hi)
        budget, scaling, block = self.budget, self.scaling, (
            self.config.block_size if self.config.selector == "block" else 1
        )

        def job() -> Selection:
            if hi == 0:
                batch, kv_heads = host.shape_prefix
                indices = torch.zeros(batch, kv_heads, budget, dtype=torch.long)
                valid = torch.zeros(batch, kv_heads, budget, dtype=torch.bool)
            else:
                indices, valid = retrieval.select(host_query, keys, candidates, budget, scaling, block)
            sel_keys, sel_values = host.gather(indices)
            return Selection(indices, valid, sel_keys, sel_values)

        self.schedule.submit(self.layer_idx, job)

    def decode_kv(
        self, query: torch.Tensor, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Resident keys/values for the running step, ordered by position.

        Args:
            query: `(B, H_q, q, D)` queries of the step (q = 1 or 2), used only by the oracle selector.

        Returns:
            keys, values: `(B, H_kv, S, D)` with S = n_sink + budget + window + q;
            positions: `(B, H_kv, S)` int64; valid: `(B, H_kv, S)` bool (False for unused slots).
        """
        q = query.shape[2]
        n = self.host.length  # includes the q new tokens
        committed = n - q
        batch, kv_heads = self.host.shape_prefix
        parts_k, parts_v, parts_pos, parts_ok = [self.sink_keys], [self.sink_values], [
            self.sink_pos[:, None, :].expand(batch, kv_heads, -1)
        ], [self.sink_valid[:, None, :].expand(batch, kv_heads, -1)]
        if self.budget > 0:
            if self.config.selector == "oracle":
                self.scaling = scaling
                self.submit_selection(query[:, :, 0], committed=committed)
            selection = self.schedule.acquire(self.layer_idx)
            parts_k.append(selection.keys)
            parts_v.append(selection.values)
            parts_pos.append(selection.indices)
            parts_ok.append(selection.valid)
        window_pos = torch.arange(committed - self.config.window, n, device=self.device)
        slots = window_pos.remainder(self.ring_size)
        window_ok = window_pos[None, :] > self.sink_last  # (B, W+q); excludes sink, pads and negatives
        parts_k.append(self.ring_keys[:, :, slots])
        parts_v.append(self.ring_values[:, :, slots])
        parts_pos.append(window_pos.clamp(min=0)[None, None, :].expand(batch, kv_heads, -1))
        parts_ok.append(window_ok[:, None, :].expand(batch, kv_heads, -1))
        return (
            torch.cat(parts_k, dim=2), torch.cat(parts_v, dim=2), torch.cat(parts_pos, dim=2),
            torch.cat(parts_ok, dim=2),
        )

    def release(self) -> None:
        """The running step's attention at this layer is queued; its selection slot may be reused."""
        if self.budget > 0:
            self.schedule.release(self.layer_idx)

    @property
    def device_bytes(self) -> int:
        """Bytes of this layer's sink and window tiers on the device (selection slots are pooled)."""
        tensors = (self.sink_keys, self.sink_values, self.ring_keys, self.ring_values)
        return sum(t.nbytes for t in tensors if t is not None)

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes

    def dense_bytes(self) -> int:
        """Bytes a `DynamicCache` layer would hold for the same tokens."""
        if self.host is None:
            return 0
        batch, kv_heads = self.host.shape_prefix
        return 2 * batch * kv_heads * self.host.length * self.host.head_dim * self.host.keys.element_size()


class DualDecoderCache(Cache):
    """A KV cache for DualDecoder decoding: the full cache in host memory, only a few entries per step on device.

    Use it through `model.generate(..., cache_implementation="dual", cache_config={...})` after
    `import dual_cache`, or pass `cache=DualDecoderCache(model.config, budget=256)`.

    Args:
        config: the model's `PretrainedConfig` (its text config is used); needs `num_hidden_layers`,
            `num_key_value_heads` and, for mixed models, `layer_types` + `sliding_window`.
        dual_config: a `DualDecoderConfig`; or give its fields as keyword arguments (`budget=256, ...`).
        max_cache_len: expected total tokens (prompt + new), used to size the host store once (tokens).

    Raises:
        ValueError: for bad option values, or layer types this cache cannot serve (anything other than
            full and sliding-window attention).
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
        layer_types = getattr(text_config, "layer_types", None)
        sliding_window = getattr(text_config, "sliding_window", None)
        if layer_types is None:
            layer_types = [SLIDING_ATTENTION if sliding_window else FULL_ATTENTION] * n_layers
        unsupported = sorted({t for t in layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if unsupported:
            raise ValueError(
                f"DualDecoderCache serves full-attention and sliding-window layers only; this model has layer "
                f"types {unsupported}. Use the default cache for this model."
            )
        for layer_idx in self.dual_config.layer_budgets:
            if layer_idx >= n_layers:
                raise ValueError(
                    f"`layer_budgets` names layer {layer_idx}, but the model has {n_layers} layers (0..{n_layers - 1})."
                )
        self.layer_types = list(layer_types)
        self.state = _SequenceState()
        self.schedule: TransferSchedule | None = None
        self.max_cache_len = max_cache_len
        self.spec_hits = 0
        self.spec_steps = 0
        layers: list[CacheLayerMixin] = []
        for layer_idx, layer_type in enumerate(self.layer_types):
            if layer_type == SLIDING_ATTENTION:
                layer = DynamicSlidingWindowLayer(sliding_window=sliding_window)
                layer.activate_past_recording()  # keeps the speculated token until crop(-1) removes it
            else:
                layer = DualLayer(layer_idx, self.dual_config, self.state, None, max_cache_len)
            layers.append(layer)
        super().__init__(layers=layers)

    @property
    def dual_layers(self) -> list[DualLayer]:
        return [layer for layer in self.layers if isinstance(layer, DualLayer)]

    def _ensure_schedule(self, device: torch.device) -> None:
        if self.schedule is None or self.schedule.closed:
            self.schedule = TransferSchedule(
                device, self.dual_config.layers_in_flight, self.dual_config.threads_for(torch.device(device))
            )
            for layer in self.dual_layers:
                layer.schedule = self.schedule

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
        self.state.sink_last = torch.where(is_sink, positions, torch.full_like(positions, -1)).amax(dim=1)
        self.state.candidates = {}
        for layer in dual:
            layer.start_decoding()

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
        """Memory and traffic accounting.

        Returns a dict with:
            device_bytes: bytes resident on the compute device while decoding (sink + window tiers of full
                layers, the selection pool, the windows of sliding layers);
            host_bytes: bytes of the host stores;
            dense_equivalent_bytes: bytes a `DynamicCache` would hold on the device for the same tokens;
            bytes_copied: host→device bytes of selections so far;
            spec_hits, spec_steps: speculated tokens that equalled the real one / speculated tokens;
            seq_length: tokens stored.
        """
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
        if self.schedule is not None:
            device += self.schedule.peak_device_bytes  # the pool's size while decoding (freed by close())
        return {
            "device_bytes": device,
            "host_bytes": host,
            "dense_equivalent_bytes": dense,
            "bytes_copied": 0 if self.schedule is None else self.schedule.bytes_copied,
            "spec_hits": self.spec_hits,
            "spec_steps": self.spec_steps,
            "seq_length": self.get_seq_length(),
        }

    def close(self) -> None:
        """Stop the retrieval thread and free the device selection pool. Idempotent; stats stay readable."""
        if self.schedule is not None:
            self.schedule.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
