"""`DualDecoderCache`: a `transformers.Cache` whose full-attention layers keep every K/V in host memory and only
sink + local window + the current selection on the device (docs/design.md §2).

Each full-attention layer is a `DualLayer` (`layer.py`); sliding-window layers (e.g. Gemma 3) keep their own window
on the device with transformers' `DynamicSlidingWindowLayer`. The cache knows nothing of generation: the decode loop
tells it when a request begins (`begin_request`), when its prompt is stored (`end_prefill`), which sequences each
step repairs (`begin_step`, which returns the step's plan, `call.DualCall`, that the forward hands the attention of
each layer) and when the request ends (`end_request`). Data flows one way: the cache hands its layers what they need (at construction,
per request, per step); layers never refer back to it. Between requests the cache keeps its host stores and
indexes and holds no thread and no device memory, so a later request can continue the same sequences.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from .config import DualDecoderConfig
from .host_memory import HostMemory, HostMemoryError, available_host_bytes  # noqa: F401  (public re-exports)
from .host_growth import planned_capacity
from .host_store import HostKVStore
from .call import DualCall
from .layer import DualLayer
from .repair import StepRows
from .layer_types import SLIDING_ATTENTION, resolve_layer_types
from .schedule import TransferSchedule, overlap_ratio
from .selectors import SELECTORS
from .sequences import SequenceState
from .tensor_parallel import TensorShard, shard_of_model_or_config, whole_model

SCHEDULE_COUNTERS = ("steps", "bytes_copied", "retrieval_seconds", "copy_seconds", "wait_seconds", "repairs",
                     "repaired_steps", "repair_seconds", "device_wait_seconds", "device_starved_seconds",
                     "device_step_seconds")


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
        self.shard: TensorShard = whole_model(text_config)  # the KV heads this process holds (`check_model`)
        self.kv_heads = self.shard.kv_heads
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self.sequences = SequenceState(self.dual_config.n_sink)
        self.host_memory = HostMemory(self.dual_config.max_host_bytes)
        self.schedule: TransferSchedule | None = None  # the running request's
        self.max_cache_len = max_cache_len
        self.spec_hits = 0
        self.spec_steps = 0
        self.drift_repairs = 0
        self.requests = 0  # requests begun on this cache
        self.token_ids: torch.Tensor | None = None  # (B, stored) int64 host: the stored positions' token ids
        self._request_tokens = 0
        self._finished = dict.fromkeys(SCHEDULE_COUNTERS, 0)  # schedule counters of the requests that ended
        self._decoding_device_bytes = 0  # device bytes the last ended request held while decoding
        self._final_stats: dict | None = None
        self._timeline: list[dict] = []
        super().__init__(layers=self._build_layers(max_cache_len))

    def _build_layers(self, tokens: int | None) -> list[CacheLayerMixin]:
        """Sets `layer_types` for requests of `tokens` tokens and returns one fresh layer per model layer."""
        return self.layers_of_types(resolve_layer_types(self.text_config, tokens))

    def layers_of_types(self, layer_types: list[str]) -> list[CacheLayerMixin]:
        """Sets `layer_types` and returns one fresh, empty layer per model layer of those types."""
        self.layer_types = list(layer_types)
        layers: list[CacheLayerMixin] = []
        for layer_idx, layer_type in enumerate(self.layer_types):
            if layer_type == SLIDING_ATTENTION:
                layer = DynamicSlidingWindowLayer(sliding_window=self.text_config.sliding_window)
                layer.activate_past_recording()  # keeps the speculated token until crop(-1) removes it
            else:
                budget = self.dual_config.budget_for_layer(layer_idx)
                layer = DualLayer(layer_idx, self.dual_config, budget, self.sequences, self.host_memory)
            layers.append(layer)
        return layers

    def fit_layers(self, tokens: int) -> None:
        """Serve each layer as the model defines it for sequences of `tokens` tokens (prompt + new + speculated).

        A sliding-window layer whose window covers `tokens` attends to every token, so it is served as full
        attention (host store + selection; `layer_types.resolve_layer_types`). Before anything is stored the
        layers are simply rebuilt for `tokens`. Once tokens are stored (a continued conversation, a resumed
        session, a shared prefix, a regrouped batch), a sliding-window layer served as full attention for an
        earlier, shorter request becomes a transformers `DynamicSlidingWindowLayer` holding the last
        `sliding_window - 1` stored tokens on the device (read from its host store, which is then freed), as the
        default cache holds them; a layer already sliding stays sliding (it is exact at any length).
        """
        wanted = resolve_layer_types(self.text_config, tokens)
        if self.get_seq_length() == 0:
            if wanted != self.layer_types:
                self.layers = self._build_layers(tokens)
            return
        for layer_idx, layer_type in enumerate(wanted):
            layer = self.layers[layer_idx]
            if layer_type == SLIDING_ATTENTION and isinstance(layer, DualLayer):
                self.layers[layer_idx] = self._slide(layer)
                self.layer_types[layer_idx] = SLIDING_ATTENTION

    def _slide(self, layer: DualLayer) -> DynamicSlidingWindowLayer:
        """A sliding-window layer holding what `layer` (a full-attention-served sliding layer, between requests)
        stored that its window keeps: the last `sliding_window - 1` positions, on the layer's device. Frees
        `layer`'s host store and index and returns their bytes to the host-memory allowance."""
        window = self.text_config.sliding_window
        sliding = DynamicSlidingWindowLayer(sliding_window=window)
        sliding.activate_past_recording()  # keeps the speculated token until crop(-1) removes it
        if layer.host is not None and layer.host.length:
            stored = layer.host.length
            first = max(0, stored - (window - 1))
            batch, kv_heads = layer.host.shape_prefix
            keys = torch.empty(batch, kv_heads, stored - first, layer.host.head_dim, dtype=layer.host.dtype,
                               device=layer.device)
            values = torch.empty_like(keys)
            layer.host.read_into(first, stored, keys, values)
            sliding.lazy_initialization(keys[:, :, :0], values[:, :, :0])
            sliding.keys, sliding.values, sliding.cumulative_length = keys, values, stored
        freed = layer.host_bytes
        layer.free()
        self.host_memory.release(freed)
        return sliding

    @property
    def dual_layers(self) -> list[DualLayer]:
        return [layer for layer in self.layers if isinstance(layer, DualLayer)]

    def check_model(self, model: Any) -> None:
        """Raise `ValueError` unless this cache was built for a model with these layers and KV head shape; given the
        model itself (not its config), adopt the KV heads this rank holds under tensor parallelism.

        Args:
            model: the model (a transformers `PreTrainedModel`, loaded with or without a `tp_plan`), or its config.

        Raises:
            ValueError: a model of other layers / KV heads / head dim, or of other layer types or `sliding_window`
                (`layer_types.resolve_layer_types`); a tensor-parallel plan that cannot split the
                heads evenly over its ranks (`tensor_parallel.shard_of`); a shard of other KV heads than the ones
                this cache already stores.
        """
        is_model = isinstance(model, torch.nn.Module) and hasattr(model, "config")
        shard = shard_of_model_or_config(model)
        config = model.config if is_model else model
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        mine = (len(self.layers), self.shard.model_kv_heads, self.head_dim)
        theirs = (text.num_hidden_layers, shard.model_kv_heads, head_dim)
        if mine != theirs:
            raise ValueError(
                f"This DualDecoderCache was built for (layers, KV heads, head_dim) = {mine}, but the model has "
                f"{theirs}. Build it from the model's own config: DualDecoderCache(model.config, ...)."
            )
        # the attention layout too: a layer's sliding window decides what it keeps (same shapes are not enough)
        mine = (resolve_layer_types(self.text_config, None), getattr(self.text_config, "sliding_window", None))
        theirs = (resolve_layer_types(text, None), getattr(text, "sliding_window", None))
        if mine != theirs:
            raise ValueError(
                f"This DualDecoderCache was built for layer types {mine[0]} with sliding_window={mine[1]}, but the "
                f"model has {theirs[0]} with sliding_window={theirs[1]}. Build it from the model's own config: "
                "DualDecoderCache(model.config, ...)."
            )
        if is_model:
            self.use_shard(shard)

    def use_shard(self, shard: TensorShard) -> None:
        """Hold the KV heads of `shard` (a tensor-parallel rank's; `tensor_parallel.shard_of`): host-memory checks,
        the retrieval threads and `stats()` become this rank's.

        Raises:
            ValueError: when the cache already stores tokens of another number of KV heads.
        """
        if shard == self.shard:
            return
        if self.get_seq_length() and shard.kv_heads != self.kv_heads:
            raise ValueError(
                f"This DualDecoderCache stores {self.kv_heads} KV heads per layer ({self.shard.describe()}); the model "
                f"here is {shard.describe()}. Continue a cache on the rank (and tensor-parallel plan) that filled it."
            )
        self.shard, self.kv_heads = shard, shard.kv_heads
        self.host_memory.ranks_per_host = shard.ranks_per_host

    # --- host memory ---------------------------------------------------------------------------------------
    def host_bytes_needed(self, batch_size: int, tokens: int, dtype: torch.dtype, kv_heads: int | None = None,
                          head_dim: int | None = None, prompt_tokens: int = 0) -> int:
        """Host bytes the stores of every full-attention layer (and their selectors' host state) take for `tokens`
        tokens of `batch_size` sequences, when the first `prompt_tokens` are reserved at once and the rest arrive
        a decode step at a time (`host_store.planned_capacity`)."""
        kv_heads, head_dim = kv_heads or self.kv_heads, head_dim or self.head_dim
        capacity = planned_capacity(prompt_tokens, tokens, self.dual_config.host_chunk_tokens)
        store = HostKVStore.chunk_nbytes(batch_size, kv_heads, head_dim, dtype, capacity)
        selector = SELECTORS[self.dual_config.selector].host_bytes_for(
            self.dual_config, capacity, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size()
        )
        retrieving = sum(1 for layer in self.dual_layers if layer.budget > 0)
        return len(self.dual_layers) * store + retrieving * batch_size * selector

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
        if self._final_stats is not None:
            raise RuntimeError("This DualDecoderCache was closed; create a new one for the next generate() call.")
        if self.schedule is not None:
            raise RuntimeError("A request is already running on this DualDecoderCache; one generate() at a time.")
        stored = self.get_seq_length()
        if stored == 0:
            tokens = max(tokens, self.max_cache_len or 0)
            self.fit_layers(tokens)
            # the first request's length is known (prompt + max new tokens): its stores are sized to it at once;
            # a continuing conversation grows geometrically (`host_store.next_chunk_tokens`)
            reserve = tokens
            needed = self.host_bytes_needed(batch_size, tokens, dtype, prompt_tokens=reserve)
        else:
            held = self.sequences.valid.shape[0]
            if held != batch_size and (held != 1 or not SELECTORS[self.dual_config.selector].shares_prefix):
                raise ValueError(
                    f"This DualDecoderCache holds {held} sequence(s); a request continuing them must have the same "
                    f"batch size, got {batch_size}"
                    + ("." if held != 1 else f": selector={self.dual_config.selector!r} cannot share one stored "
                       f"sequence across a batch (use one of {[n for n, c in SELECTORS.items() if c.shares_prefix]}).")
                )
            self.fit_layers(tokens)  # a sliding layer served as full attention slides once the window is passed
            # only the new positions are each sequence's own: the stored ones are kept (shared when held == 1)
            reserve = input_tokens
            needed = self.host_bytes_needed(batch_size, tokens - stored, dtype, prompt_tokens=input_tokens - stored)
            if held != batch_size:  # a per-sequence index of the shared prefix is copied per sequence (`share`)
                needed += (batch_size - 1) * sum(layer.selector.host_bytes for layer in self.dual_layers
                                                 if layer.selector is not None)
        self.host_memory.check(
            needed, f"{batch_size} sequence(s) of {tokens} tokens ({len(self.dual_layers)} full-attention layers)"
        )
        if stored and batch_size != self.sequences.valid.shape[0]:
            self._share(batch_size)
        self.sequences.set_prompt(valid, batch_size, input_tokens)
        self._request_tokens = tokens
        self.requests += 1
        self._ensure_schedule(device)
        for layer in self.dual_layers:
            layer.begin_request(self.schedule, tokens, reserve=reserve)

    def _share(self, batch_size: int) -> None:
        """The one stored sequence becomes a prefix that `batch_size` sequences continue: full-attention layers
        keep it once on the host, sliding-window layers copy their window per sequence."""
        self.sequences.share(batch_size)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.expand(batch_size, -1).clone()
        for layer in self.layers:
            if isinstance(layer, DualLayer):
                layer.share(batch_size)
            elif layer.is_initialized:
                layer.batch_repeat_interleave(batch_size)

    def _ensure_schedule(self, device: torch.device) -> None:
        """Start the request's transfer schedule (its device slots are made on first use, one ring per budget)."""
        if self.schedule is not None:
            return
        retrieving = [layer for layer in self.dual_layers if layer.budget > 0]
        self.schedule = TransferSchedule(
            device,
            layer_order=[layer.layer_idx for layer in retrieving],
            layers_in_flight=self.dual_config.layers_in_flight,
            lookahead=self.dual_config.lookahead,
            threads=self.dual_config.threads_for(torch.device(device), self.shard.ranks_per_host),
            record_timeline=self.dual_config.record_timeline,
        )

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store `(B, H_kv, q, D)` new keys/values of `layer_idx` (transformers `Cache.update` contract). Runs
        eagerly under `torch.compile` (a graph break: the host store is not traceable)."""
        layer = self.layers[layer_idx]
        if isinstance(layer, DualLayer) and self.schedule is None:
            raise RuntimeError(
                "DualDecoderCache stores tokens only during generate(): pass it to model.generate(..., cache=cache)."
            )
        # a rank's share given to a cache sized for the whole model, or another share than this rank's (unsharded,
        # more heads than the config states is served as computed: GPT-NeoX ignores `num_key_value_heads`)
        heads = key_states.shape[1]
        if isinstance(layer, DualLayer) and not layer.is_initialized and (
                heads < self.kv_heads or (self.shard.sharded and heads != self.kv_heads)):
            raise ValueError(
                f"Layer {layer_idx} gave {heads} KV heads; this DualDecoderCache was sized for "
                f"{self.kv_heads} ({self.shard.describe()}). Under tensor parallelism pass the model itself to "
                "cache.check_model(model) (generate() does) so the cache holds this rank's heads."
            )
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

    def end_step(self, call: DualCall) -> None:
        """Add up what a decode forward's attention reported (`call.drift_repairs`)."""
        self.drift_repairs += call.drift_repairs

    def record_speculation(self, hits: int, steps: int) -> None:
        """Add speculation outcomes: `hits` of `steps` speculated tokens equalled the real next token."""
        self.spec_hits += int(hits)
        self.spec_steps += int(steps)

    def check_continuation(self, input_ids: torch.Tensor | None, input_tokens: int,
                           attention_mask: torch.Tensor | None = None) -> None:
        """Raise `ValueError` unless a request's `input_ids` `(B, input_tokens)` extend the sequences this cache
        holds by at least one token, and its attention mask keeps each sequence's leading pads and sink tokens as
        they were stored (they are fixed by the first request), before any work. Other held positions may be
        marked as padding (transformers infers a mask from `pad_token_id`, which a generated token may equal):
        they are then excluded from selection and the window, as the default cache masks them.

        Args:
            input_ids: the request's token ids, or None when its input is given as embeddings.
            input_tokens: positions of the request's input.
            attention_mask: the request's `(B, input_tokens)` 0/1 mask, or None (every position real).
        """
        if self._final_stats is not None:
            raise RuntimeError("This DualDecoderCache was closed; create a new one for the next generate() call.")
        stored = self.get_seq_length()
        if input_ids is None:
            raise ValueError(
                f"This DualDecoderCache holds {stored} tokens; a request continuing it must give input_ids (the "
                "held tokens followed by new ones), not inputs_embeds. Pass a fresh cache to prefill from embeddings."
            )
        if self.token_ids is None:
            raise ValueError(
                "This DualDecoderCache was filled from inputs_embeds, so a continuation cannot be checked against "
                "its tokens. Pass a fresh cache."
            )
        held = self.token_ids.shape[0]
        if input_ids.shape[0] != held and held != 1:
            raise ValueError(
                f"This DualDecoderCache holds {held} sequence(s); a request continuing them must have the same batch "
                f"size (or the cache must hold one sequence, a prefix the batch shares), got {input_ids.shape[0]}."
            )
        if input_tokens <= stored:
            raise ValueError(
                f"input_ids must extend the {stored} tokens this DualDecoderCache holds by at least one token; got "
                f"{input_tokens}. Pass the previous output (sequences) followed by the new tokens."
            )
        given = input_ids[:, :stored].to("cpu")
        held_ids = self.token_ids.expand(given.shape[0], -1)
        if not torch.equal(given, held_ids):
            row, position = (given != held_ids).nonzero()[0].tolist()
            raise ValueError(
                f"input_ids do not extend the sequences this DualDecoderCache holds: sequence {row} has token "
                f"{int(given[row, position])} at position {position}, where the cache holds "
                f"{int(held_ids[row, position])}. Pass the previous output (sequences) followed by the new "
                "tokens, or a fresh cache."
            )
        sink_last = self.sequences.sink_last.expand(given.shape[0])  # (B,) last fixed position of each sequence
        positions = torch.arange(min(int(sink_last.max()) + 1, stored))[None, :].expand(given.shape[0], -1)
        real = self.sequences.is_real(positions)
        marked = real.new_ones(real.shape) if attention_mask is None else \
            attention_mask[:, : positions.shape[1]].cpu().bool()
        changed = (marked != real) & (positions <= sink_last[:, None])
        if bool(changed.any()):
            row, position = changed.nonzero()[0].tolist()
            raise ValueError(
                f"attention_mask marks position {position} of sequence {row} as "
                f"{'a real token' if bool(marked[row, position]) else 'padding'}, but this DualDecoderCache stored it "
                f"as {'a real token (a sink token)' if bool(real[row, position]) else 'padding'}; leading pads and "
                "sink tokens are fixed by the first request. Repeat the previous call's mask for the held positions."
            )

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
            self._decoding_device_bytes = self._device_bytes()
        schedule, self.schedule = self.schedule, None
        try:
            if schedule is not None:
                try:
                    schedule.close()  # drains the copy stream, reads the device clock
                finally:
                    for name in SCHEDULE_COUNTERS:
                        self._finished[name] += getattr(schedule, name)
                    self._timeline.extend(schedule.timeline())
        finally:
            for layer in self.dual_layers:
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
                tokens or leading pads (fixed by the first request), or that a sliding-window layer past its window
                cannot serve (it keeps only the last `sliding_window - 1` tokens, so the tokens its window would
                need again are gone): use a fresh cache for those.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove, e.g. crop(-1).")
        if tokens_to_remove < 0 and self.schedule is None and self.get_seq_length():
            remaining = self.get_seq_length() + tokens_to_remove
            fixed = -1 if self.sequences.sink_last is None else int(self.sequences.sink_last.max())
            if remaining <= fixed:
                raise ValueError(
                    f"crop({tokens_to_remove}) would leave {remaining} tokens, but positions up to {fixed} hold sink "
                    "tokens or leading pads fixed by the first request; crop fewer tokens or use a fresh cache."
                )
            window = getattr(self.text_config, "sliding_window", None)
            if any(not isinstance(layer, DualLayer) and layer.get_seq_length() >= window for layer in self.layers):
                raise ValueError(
                    f"crop({tokens_to_remove}): a sliding-window layer past its window ({window} tokens) keeps only "
                    "the tokens that window needs, so it cannot continue from an earlier point; use a fresh cache."
                )
        super().crop(tokens_to_remove)
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

    # --- accounting ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Memory, traffic and pipeline accounting over every request of this cache (frozen when it is closed).

        Returns a dict with:
            device_bytes: bytes resident on the compute device (while a request decodes: sink + window tiers of
                full layers, Quest page metadata, the selection pool; the windows of sliding layers);
            host_bytes: bytes of the host stores and the selectors' host state;
            dense_equivalent_bytes: bytes a `DynamicCache` would hold on the device for the same tokens;
            bytes_copied: host→device bytes of selections so far (K, V, indices, validity);
            spec_hits, spec_steps: speculated tokens that equalled the real one / speculated tokens;
            seq_length: tokens stored; steps: decode forward passes; requests: requests begun;
            retrieval_seconds, copy_seconds: host time spent selecting + gathering, and issuing copies;
            wait_seconds: time the launching thread waited for selections (all of it on the synchronous path);
            device_wait_seconds, device_starved_seconds, device_step_seconds: on CUDA (device clock: timing
                events; under `simulated_streams()` the simulated one; 0 on a CPU device), over the finished
                requests: the compute stream's time waiting for selection copies (an event wait); its time with no
                work queued because the launch thread was waiting on host selection (a retrieval job not finished
                when its layer acquires, a synchronous or miss-repair job); and its time from one step's first
                layer to the next's. The device's idle time for selections is the first two together;
            overlap_ratio: on CUDA `1 − (device_wait + device_starved) / device_step` (the share of the device's
                step time it was not idle for selections); elsewhere `1 − wait / (retrieval + copy)` (nan before
                the first decode step);
            repairs, repaired_steps, repair_seconds: (step, layer) selections redone by miss repair (misses and
                drift), the decode steps in which any was, and the time they took;
            drift_repairs: those of the `repairs` made for drifted queries on hit steps (`repair_drift`);
            tp_rank, tp_size, kv_heads: under tensor parallelism every figure above is this rank's alone (its
                `kv_heads` of the model's KV heads); tp_size 1 without it.
        """
        if self._final_stats is not None:
            return dict(self._final_stats)
        host = dense = 0
        for layer in self.layers:
            if isinstance(layer, DualLayer):
                host += layer.host_bytes
                dense += layer.dense_bytes()
            elif layer.is_initialized and layer.keys is not None:
                dense += layer.keys.nbytes + layer.values.nbytes
        counters = dict(self._finished)
        if self.schedule is not None:
            for name in SCHEDULE_COUNTERS:
                counters[name] += getattr(self.schedule, name)
        device = self._device_bytes() if self.schedule is not None else self._decoding_device_bytes
        return {
            "device_bytes": device,
            "host_bytes": host,
            "dense_equivalent_bytes": dense,
            "spec_hits": self.spec_hits,
            "spec_steps": self.spec_steps,
            "seq_length": self.get_seq_length(),
            "requests": self.requests,
            **counters,
            "overlap_ratio": overlap_ratio(counters),
            "drift_repairs": self.drift_repairs,
            "tp_rank": self.shard.rank,
            "tp_size": self.shard.size,
            "kv_heads": self.kv_heads,
        }

    @property
    def held_device_bytes(self) -> int:
        """Device bytes this cache holds now, in bytes: while a request runs, its tiers, selection pool and sliding
        windows; between requests only the sliding-window layers' windows (full-attention layers hold none)."""
        return self._device_bytes()

    def _device_bytes(self) -> int:
        """Device bytes held now: full layers' tiers (and Quest metadata), the selection pool, sliding windows."""
        device = 0 if self.schedule is None else self.schedule.device_bytes
        for layer in self.layers:
            if isinstance(layer, DualLayer):
                device += layer.device_bytes
            elif layer.is_initialized and layer.keys is not None:
                device += layer.keys.nbytes + layer.values.nbytes
        return device

    def timeline(self) -> list[dict]:
        """Per-(step, layer) pipeline records of every request (needs `record_timeline=True`); see
        `TransferSchedule.timeline`."""
        running = [] if self.schedule is None else self.schedule.timeline()
        return [dict(record) for record in self._timeline] + running

    def dump_timeline(self, path: str) -> None:
        """Write `{"stats": stats(), "timeline": timeline()}` as JSON to `path`."""
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"stats": self.stats(), "timeline": self.timeline()}, handle, indent=1)

    # --- lifecycle -------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether `close()` was called (the host stores are freed; the cache cannot take requests)."""
        return self._final_stats is not None

    @property
    def request_running(self) -> bool:
        """Whether a request is running on the cache (between `begin_request` and `end_request`)."""
        return self.schedule is not None

    def close(self) -> None:
        """End any running request and free the host stores and indexes (pinned or registered memory included).
        Idempotent; `stats()`, `timeline()` and `get_seq_length()` stay readable."""
        if self._final_stats is not None:
            return
        try:
            self.end_request()
        finally:
            self._final_stats = self.stats()
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
        if self._final_stats is None and self.get_seq_length() > 0:
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
