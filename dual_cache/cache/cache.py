"""`DualDecoderCache`: a `transformers.Cache` whose full-attention layers keep every K/V in host memory and only
sink + local window + the current selection on the device (docs/design.md §2).

Each full-attention layer is a `DualLayer` (`layer/layer.py`); sliding-window layers (e.g. Gemma 3) keep their own
window on the device (`cache.layers.SlidingWindowLayer`, transformers' `DynamicSlidingWindowLayer`). The cache knows
nothing of generation: the decode loop tells it when a request begins (`begin_request`), when its prompt is stored
(`end_prefill`), which sequences each step repairs (`begin_step`, which returns the step's plan, `call.DualCall`, that
the forward hands the attention of each layer) and when the request ends (`end_request`). Data flows one way: the
cache hands its layers what they need (at construction, per request, per step); layers never refer back to it.
Between requests the cache keeps its host stores and indexes and holds no thread and no device memory, so a later
request can continue the same sequences. What it checks before any work is `checks.py`'s, what a request takes in
host memory `host_admission.py`'s, its accounting `stats.py`'s.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..config import DualDecoderConfig
from ..layer.call import DualCall
from .checks import check_batch_continues, check_continuation, check_kv_heads, check_layer_budgets, check_model_layout
from .host_admission import host_bytes_needed, plan_request
from .stats import CacheAccounting, device_bytes, dump_timeline
from ..host.memory import HostMemory, HostMemoryError, available_host_bytes  # noqa: F401  (public re-exports)
from ..layer.layer import DualLayer
from ..layer.repair import StepRows
from ..layer.sequences import SequenceState
from ..model.layer_types import check_attention_model, resolve_layer_types
from ..model.tensor_parallel import TensorShard, adopt_shard, head_dim_of, whole_model
from ..transfer.schedule import TransferSchedule
from .layers import build_layers, share_layers, slide_layers


class DualDecoderCache(Cache):
    """A KV cache for DualDecoder decoding: the full cache in host memory, only a few entries per step on device.

    Use it through `model.generate(..., cache_implementation="dual", cache_config={...})` after
    `import dual_cache`, or pass `cache=DualDecoderCache(model.config, budget=256)`. A cache passed to `generate()`
    stays open afterwards: pass it again with `input_ids` that extend its sequences to continue them without a
    new prefill of what it holds; `close()` (or a `with` block, or garbage collection) releases it.

    Args:
        config: the model's `PretrainedConfig` (its text config is used); needs `num_hidden_layers`,
            `num_key_value_heads` and, for mixed models, `layer_types` + `sliding_window`.
        dual_config: a `DualDecoderConfig`; or give its fields as keyword arguments (`budget=256, ...`).
        max_cache_len: expected total tokens per sequence (prompt + new), checked against the host memory limit
            before the first allocation (tokens).

    Under tensor parallelism (transformers' `tp_plan`, one process per rank) each rank's cache holds the KV heads of
    its rank's attention: `check_model(model)`, which `generate()` and the serving scheduler call with the model,
    adopts that shard (`shard`, `kv_heads`), so host-memory checks, retrieval threads and `stats()` are this rank's.

    Raises:
        ValueError: for bad option values, or layer types this cache cannot serve (anything other than
            full and sliding-window attention). A sliding window at least `max_cache_len` long is served as full
            attention (`fit_layers` decides again once the request's length is known, and a conversation continued
            past the window slides from then on).
    """

    def __init__(self, config: Any, dual_config: DualDecoderConfig | None = None, max_cache_len: int | None = None,
                 **options: Any) -> None:
        if dual_config is not None and options:
            raise ValueError("Pass either `dual_config` or option keywords to DualDecoderCache, not both.")
        self.dual_config = dual_config if dual_config is not None else DualDecoderConfig.from_dict(options)
        if dual_config is not None:
            dual_config.validate()  # fields may have been changed since the config was built
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.text_config = text_config
        check_attention_model(text_config)  # before any attribute of attention is read
        check_layer_budgets(self.dual_config, text_config.num_hidden_layers)
        self.shard: TensorShard = whole_model(text_config)  # the KV heads this process holds (`check_model`)
        self.kv_heads = self.shard.kv_heads
        self.head_dim = head_dim_of(text_config)
        self.sequences = SequenceState(self.dual_config.n_sink)
        self.host_memory = HostMemory(self.dual_config.max_host_bytes)
        self.schedule: TransferSchedule | None = None  # the running request's
        self.max_cache_len = max_cache_len
        self.requests = 0  # requests begun on this cache
        self.accounting = CacheAccounting()  # speculation and schedule counters, for `stats()` and `timeline()`
        self.token_ids: torch.Tensor | None = None  # (B, stored) int64 host: the stored positions' token ids
        super().__init__(layers=self._build_layers(max_cache_len))

    def _build_layers(self, tokens: int | None) -> list[CacheLayerMixin]:
        """Sets `layer_types` for requests of `tokens` tokens and returns one fresh layer per model layer."""
        return self.layers_of_types(resolve_layer_types(self.text_config, tokens))

    def layers_of_types(self, layer_types: list[str]) -> list[CacheLayerMixin]:
        """Sets `layer_types` and returns one fresh, empty layer per model layer of those types
        (`cache.layers.build_layers`)."""
        self.layer_types = list(layer_types)
        return build_layers(self.layer_types, getattr(self.text_config, "sliding_window", None), self.dual_config,
                            self.sequences, self.host_memory)

    def fit_layers(self, tokens: int) -> None:
        """Serve each layer as the model defines it for sequences of `tokens` tokens (prompt + new + speculated).

        A sliding-window layer whose window covers `tokens` is served as full attention (host store + selection;
        `layer_types.resolve_layer_types`). Before anything is stored the layers are rebuilt for `tokens`; once
        tokens are stored (a continued conversation, a resumed session, a shared prefix, a regrouped batch), a
        sliding layer served as full attention for an earlier, shorter request starts sliding, holding the last
        `sliding_window - 1` stored tokens on the device as the default cache does (`cache.layers.slide_layers`).
        """
        wanted = resolve_layer_types(self.text_config, tokens)
        if self.get_seq_length() == 0:
            if wanted != self.layer_types:
                self.layers = self._build_layers(tokens)
            return
        slide_layers(self.layers, self.layer_types, wanted, getattr(self.text_config, "sliding_window", None),
                     self.sequences, self.host_memory)

    @property
    def dual_layers(self) -> list[DualLayer]:
        return [layer for layer in self.layers if isinstance(layer, DualLayer)]

    def check_model(self, model: Any) -> None:
        """Raise `ValueError` unless this cache was built for `model` (a transformers `PreTrainedModel`, loaded with
        or without a `tp_plan`, or its config): the same layers, KV head shape, layer types and `sliding_window`
        (`checks.check_model_layout`); given the model itself, adopt the KV heads this rank holds under tensor
        parallelism (`use_shard`; ValueError for a shard of other KV heads than the ones this cache stores)."""
        shard = check_model_layout(model, self.text_config, len(self.layers), self.shard, self.head_dim)
        if shard is not None:
            self.use_shard(shard)

    def use_shard(self, shard: TensorShard) -> None:
        """Hold the KV heads of `shard` (a tensor-parallel rank's; `tensor_parallel.shard_of`): host-memory checks,
        the retrieval threads and `stats()` become this rank's (`tensor_parallel.adopt_shard`; ValueError when the
        cache already stores tokens of another number of KV heads)."""
        self.shard = adopt_shard(self.shard, shard, self.get_seq_length(), self.host_memory)
        self.kv_heads = self.shard.kv_heads

    def host_bytes_needed(self, batch_size: int, tokens: int, dtype: torch.dtype, kv_heads: int | None = None,
                          head_dim: int | None = None, prompt_tokens: int = 0) -> int:
        """Host bytes the stores of every full-attention layer (and their selectors' host state) take for `tokens`
        tokens of `batch_size` sequences, when the first `prompt_tokens` are reserved at once and the rest arrive
        a decode step at a time (`host_admission.host_bytes_needed`)."""
        return host_bytes_needed(self.dual_config, self.dual_layers, batch_size, tokens, dtype,
                                 kv_heads or self.kv_heads, head_dim or self.head_dim, prompt_tokens)

    # --- one request -----------------------------------------------------------------------------------------
    def begin_request(self, batch_size: int, tokens: int, dtype: torch.dtype, device: torch.device,
                      valid: torch.Tensor | None, input_tokens: int) -> None:
        """A request begins: check that it fits in host memory (before anything is allocated), record which input
        positions are real tokens, and start its transfer schedule.

        Args:
            batch_size: sequences of the request.
            tokens: tokens per sequence the cache will hold at most during the request (input + new + 1).
            dtype: the model's K/V dtype; device: where attention runs.
            valid: `(B, input_tokens)` bool or 0/1 attention mask of the whole input (positions already stored
                included), or None when every position is real.
            input_tokens: positions of the input (stored + new prompt tokens).

        Raises:
            RuntimeError: if the cache is closed or a request is already running on it.
            ValueError: if the batch differs from the stored sequences'.
            HostMemoryError: naming the bytes needed, the bytes allowed and the knobs to turn.
        """
        if self.closed:
            raise RuntimeError("This DualDecoderCache was closed; create a new one for the next generate() call.")
        if self.schedule is not None:
            raise RuntimeError("A request is already running on this DualDecoderCache; one generate() at a time.")
        stored = self.get_seq_length()
        held = 0 if stored == 0 else self.sequences.valid.shape[0]
        if stored == 0:
            tokens = max(tokens, self.max_cache_len or 0)
        else:
            check_batch_continues(held, batch_size, self.dual_config.selector)
        self.fit_layers(tokens)  # a sliding layer served as full attention slides once the window is passed
        plan = plan_request(self.dual_config, self.dual_layers, batch_size, tokens, stored, input_tokens, held, dtype,
                            self.kv_heads, self.head_dim)
        plan.check(self.host_memory)
        if stored and batch_size != self.sequences.valid.shape[0]:
            self._share(batch_size)
        self.sequences.set_prompt(valid, batch_size, input_tokens)
        self.requests += 1
        self._ensure_schedule(device)
        for layer in self.layers:
            layer.begin_request(self.schedule, tokens, reserve=plan.reserve)

    def _share(self, batch_size: int) -> None:
        """The one stored sequence becomes a prefix `batch_size` sequences continue (`cache.layers.share_layers`)."""
        self.sequences.share(batch_size)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.expand(batch_size, -1).clone()
        share_layers(self.layers, batch_size)

    def _ensure_schedule(self, device: torch.device) -> None:
        """Start the request's transfer schedule (its device slots are made on first use, one ring per budget)."""
        if self.schedule is not None:
            return
        config, retrieving = self.dual_config, [layer for layer in self.dual_layers if layer.budget > 0]
        self.schedule = TransferSchedule(
            device, layer_order=[layer.layer_idx for layer in retrieving], layers_in_flight=config.layers_in_flight,
            lookahead=config.lookahead, threads=config.threads_for(torch.device(device), self.shard.ranks_per_host),
            record_timeline=config.record_timeline)

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store `(B, H_kv, q, D)` new keys/values of `layer_idx` (transformers `Cache.update` contract). Runs
        eagerly under `torch.compile` (a graph break: the host store is not traceable)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, DualLayer) and self.schedule is None:
            raise RuntimeError(
                "DualDecoderCache stores tokens only during generate(): pass it to model.generate(..., cache=cache)."
            )
        check_kv_heads(layer, layer_idx, key_states.shape[1], self.kv_heads, self.shard)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def end_prefill(self) -> None:
        """The request's prompt is stored: fix the sink (on the first request), fill the device tiers and schedule
        the first step's selections.

        Raises:
            RuntimeError: if no prompt was stored.
        """
        n = self.get_seq_length()
        if n == 0 or self.sequences.valid is None:
            raise RuntimeError("end_prefill() called before any prompt tokens were stored in the cache.")
        self.sequences.finish_prompt(self.sequences.valid.shape[0], n)
        for layer in self.dual_layers:
            layer.start_decoding()

    def prefill_call(self) -> DualCall:
        """The plan a prefill forward hands the layers' attention (`dual_cache=`): this cache's layers."""
        return DualCall(self.layers)

    def begin_step(self, rows: StepRows) -> DualCall:
        """The plan of the next decode forward, to pass as its `dual_cache` argument: this cache's layers and the
        sequences the step re-selects with the real token's query (`miss_repair`), decided on the host before the
        step (`repair.RepairPolicy.rows`); under tensor parallelism with the drift flags agreed across ranks."""
        return DualCall(self.layers, dataclasses.replace(rows, agree=self.shard.any_rank) if self.shard.sharded
                        else rows)

    def record_speculation(self, outcomes: Sequence[bool | None]) -> None:
        """Add one decode step's speculation outcomes, per sequence: its speculated token equalled the real next
        token (True) or not (False); None for a sequence not speculated for (finished)."""
        self.accounting.record_speculation(outcomes)

    def check_continuation(self, input_ids: torch.Tensor | None, input_tokens: int,
                           attention_mask: torch.Tensor | None = None) -> None:
        """Raise `ValueError` unless a request's `input_ids` `(B, input_tokens)` extend the sequences this cache
        holds by at least one token, and its attention mask keeps each sequence's leading pads and sink tokens as
        they were stored, before any work (`checks.check_continuation`); `RuntimeError` once the cache is closed.
        `input_ids` is None for a request given as embeddings; `attention_mask` `(B, input_tokens)` 0/1, or None.
        """
        if self.closed:
            raise RuntimeError("This DualDecoderCache was closed; create a new one for the next generate() call.")
        check_continuation(input_ids, input_tokens, attention_mask, self.get_seq_length(), self.token_ids,
                           self.sequences)

    def end_request(self, sequences: torch.Tensor | None = None) -> None:
        """The request ended: stop its retrieval threads and release its device memory (tiers, selection pool,
        staging). The host stores and indexes stay for a request that continues these sequences; a prompt that was
        prefilled but never decoded gets its sink fixed here (as `end_prefill` would).

        Args:
            sequences: `(B, T)` token ids of the request's sequences (input + generated), kept for the stored
                positions to check a continuing request (`check_continuation`); None when unknown (embeddings).
        """
        if self.schedule is not None:  # a request was running
            stored = self.get_seq_length()
            if stored and self.sequences.first_real is None:  # prefilled, never decoded (or no full layer)
                self.sequences.finish_prompt(self.sequences.valid.shape[0], stored)
            self.token_ids = None if sequences is None or sequences.shape[1] < stored else \
                sequences[:, :stored].to("cpu", copy=True)
            self.accounting.decoding_device_bytes = self._device_bytes()
            self.accounting.end_rows()
        schedule, self.schedule = self.schedule, None
        # what each layer's last submitted selection was handed (its query selects a continuing request's first step)
        pending = {} if schedule is None else {layer.layer_idx: schedule.pending(layer.layer_idx)
                                                for layer in self.dual_layers}
        try:
            if schedule is not None:
                try:
                    schedule.close()  # drains the copy stream, reads the device clock
                finally:
                    self.accounting.end_schedule(schedule)
        finally:
            for layer in self.layers:
                if isinstance(layer, DualLayer):
                    layer.end_request(pending.get(layer.layer_idx))
                else:
                    layer.end_request()

    # --- transformers Cache API ------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens stored (true count for every layer type; sliding layers report their cumulative length)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens of every sequence (transformers' `Cache.crop`: a negative count;
        0 lets sliding-window layers drop what fell out of their window). The decode loop crops each step's
        speculated token; between requests a user may crop to continue the conversation from an earlier point.

        Raises:
            ValueError: for a positive count; between requests, for a crop that would remove a sequence's sink
                tokens or leading pads (fixed by the first request; `SequenceState.check_crop`), or that a
                sliding-window layer past its window cannot serve (`SlidingWindowLayer.check_crop`): use a fresh
                cache for those. Every layer checks before any layer crops.
        """
        for layer in self.layers:  # each layer refuses what it cannot crop, before any layer crops
            layer.check_crop(tokens_to_remove)
        for layer in self.layers:  # transformers' `Cache.crop`: each layer crops itself
            layer.crop(tokens_to_remove)
        if self.token_ids is not None and self.token_ids.shape[1] > self.get_seq_length():
            self.token_ids = self.token_ids[:, : self.get_seq_length()]

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError(
            "DualDecoderCache cannot reorder sequences (beam search). Use num_beams=1 with cache_implementation='dual'."
        )

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("DualDecoderCache cannot be expanded after prefill; expand the inputs instead.")

    def batch_select_indices(self, indices: torch.Tensor):
        raise NotImplementedError("DualDecoderCache cannot drop sequences after prefill.")

    def stats(self) -> dict[str, float]:
        """Memory, traffic and pipeline accounting over every request of this cache (frozen when it is closed):
        device, host and dense-equivalent bytes, bytes copied, speculation outcomes, steps and requests, the
        pipeline's times and overlap, repairs, and the tensor-parallel rank; every key is described at
        `cache.stats.CacheAccounting.stats`."""
        return self.accounting.stats(self.layers, self.schedule, self.get_seq_length(), self.requests, self.shard)

    @property
    def held_device_bytes(self) -> int:
        """Device bytes this cache holds now, in bytes: while a request runs, its tiers, selection pool and sliding
        windows; between requests only the sliding-window layers' windows (full-attention layers hold none)."""
        return self._device_bytes()

    def _device_bytes(self) -> int:
        """Device bytes held now: full layers' tiers (and Quest metadata), the selection pool, sliding windows."""
        return device_bytes(self.layers, self.schedule)

    def timeline(self) -> list[dict]:
        """Per-(step, layer) pipeline records of every request (needs `record_timeline=True`); see
        `TransferSchedule.timeline`."""
        return self.accounting.timeline(self.schedule)

    def dump_timeline(self, path: str) -> None:
        """Write `{"stats": stats(), "timeline": timeline()}` as JSON to `path`."""
        dump_timeline(path, self.stats(), self.timeline())

    # --- lifecycle -------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether `close()` was called (the host stores are freed; the cache cannot take requests)."""
        return self.accounting.final is not None

    @property
    def request_running(self) -> bool:
        """Whether a request is running on the cache (between `begin_request` and `end_request`)."""
        return self.schedule is not None

    def close(self) -> None:
        """End any running request and free the host stores and indexes (pinned or registered memory included).
        Idempotent; `stats()`, `timeline()` and `get_seq_length()` stay readable."""
        if self.closed:
            return
        try:
            self.end_request()
        finally:
            self.accounting.final = self.stats()
            for layer in self.dual_layers:
                layer.free()
            self.host_memory.release_all()

    def __enter__(self) -> "DualDecoderCache":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __deepcopy__(self, memo: dict) -> "DualDecoderCache":
        """A copy of a cache that holds no tokens yet (or is closed); an open cache holding tokens is refused.

        Raises:
            TypeError: when the cache holds tokens and is open (its host stores, device tiers and retrieval threads
                serve its sequences).
        """
        if self.accounting.final is None and self.get_seq_length() > 0:
            raise TypeError(
                "A DualDecoderCache that holds tokens cannot be copied: its host stores, device tiers and retrieval "
                "threads serve its sequences. Copy it before the request starts (or once it is closed), or run a "
                "new generate() with a fresh DualDecoderCache."
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
