"""The checks made before any work: refuse what the dual cache cannot serve, with what to change, before anything
is allocated.

- `check_model_layout`: a cache was built for a model of these layers, KV head shape and attention layout (and, under
  tensor parallelism, which KV heads this rank holds); `DualDecoderCache.check_model`.
- `check_model_serves_dual`: the model reaches every served layer's attention through both channels. The dual cache
  reaches a layer's attention through the cache object (`cache.update()`, called by the attention module) and the
  `dual_cache` keyword argument of `model(...)`, which transformers passes down to the attention function
  (`layer/routing.py`). Some models drop one of them on the way (e.g. a decoder layer that calls its attention module
  without `**kwargs`), and would then silently attend densely, or fail mid-generation. So the first dual `generate()`
  on a model runs a one-token probe forward (uncompiled, with a throwaway `DynamicCache`, the model's own attention)
  and checks that every layer the dual cache serves received both; the verdict is remembered per model and attention
  implementation.
- `check_continuation`, `check_batch_continues`: a request continues the sequences a cache holds.
- `check_layer_budgets`, `check_kv_heads`: a cache's per-layer budgets name the model's layers; a layer's keys have
  the KV heads the cache was sized for.

The refusals of `generate()`'s own inputs are `runtime/refusals.py`'s table.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ..layer.layer import DualLayer
from ..layer.routing import SUPPORTED_IMPLEMENTATIONS, AttentionProbe
from ..layer.sequences import SequenceState
from ..model.layer_types import resolve_layer_types
from ..model.tensor_parallel import TensorShard, head_dim_of, shard_of_model_or_config
from ..runtime.refusals import refuse
from ..selection.selectors import SELECTORS


def check_layer_budgets(config: Any, layers: int) -> None:
    """Raise `ValueError` when `config.layer_budgets` (a `DualDecoderConfig`'s) names a layer a model of `layers`
    layers does not have."""
    for layer_idx in config.layer_budgets:
        if layer_idx >= layers:
            raise ValueError(
                f"`layer_budgets` names layer {layer_idx}, but the model has {layers} layers (0..{layers - 1})."
            )


def check_model_layout(model: Any, text_config: Any, layers: int, shard: TensorShard,
                       head_dim: int) -> TensorShard | None:
    """Raise `ValueError` unless a cache built from `text_config` (`layers` layers, the KV heads of `shard`, `head_dim`)
    serves `model`; given the model itself (not its config), return the shard of KV heads this rank holds under
    tensor parallelism (else None).

    Args:
        model: the model (a transformers `PreTrainedModel`, loaded with or without a `tp_plan`), or its config.

    Raises:
        ValueError: a model of other layers / KV heads / head dim, or of other layer types or `sliding_window`
            (`layer_types.resolve_layer_types`); a tensor-parallel plan that cannot split the heads evenly over its
            ranks (`tensor_parallel.shard_of`).
    """
    is_model = isinstance(model, torch.nn.Module) and hasattr(model, "config")
    found = shard_of_model_or_config(model)
    config = model.config if is_model else model
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_head_dim = head_dim_of(text)
    mine = (layers, shard.model_kv_heads, head_dim)
    theirs = (text.num_hidden_layers, found.model_kv_heads, model_head_dim)
    if mine != theirs:
        raise ValueError(
            f"This DualDecoderCache was built for (layers, KV heads, head_dim) = {mine}, but the model has "
            f"{theirs}. Build it from the model's own config: DualDecoderCache(model.config, ...)."
        )
    # the attention layout too: a layer's sliding window decides what it keeps (same shapes are not enough)
    mine = (resolve_layer_types(text_config, None), getattr(text_config, "sliding_window", None))
    theirs = (resolve_layer_types(text, None), getattr(text, "sliding_window", None))
    if mine != theirs:
        raise ValueError(
            f"This DualDecoderCache was built for layer types {mine[0]} with sliding_window={mine[1]}, but the "
            f"model has {theirs[0]} with sliding_window={theirs[1]}. Build it from the model's own config: "
            "DualDecoderCache(model.config, ...)."
        )
    return found if is_model else None


def check_continuation(input_ids: torch.Tensor | None, input_tokens: int, attention_mask: torch.Tensor | None,
                       stored: int, token_ids: torch.Tensor | None, sequences: SequenceState) -> None:
    """Raise `ValueError` unless a request's `input_ids` `(B, input_tokens)` extend the `stored` tokens a cache holds
    (`token_ids`, `(B or 1, stored)` int64 host, None when it was filled from embeddings) by at least one token, and
    its attention mask keeps each sequence's leading pads and sink tokens as they were stored (`sequences`; fixed by
    the first request). Other held positions may be marked as padding (transformers infers a mask from
    `pad_token_id`, which a generated token may equal): they are then excluded from selection and the window, as the
    default cache masks them.

    Args:
        input_ids: the request's token ids, or None when its input is given as embeddings.
        input_tokens: positions of the request's input.
        attention_mask: the request's `(B, input_tokens)` 0/1 mask, or None (every position real).
    """
    if input_ids is None:
        raise ValueError(
            f"This DualDecoderCache holds {stored} tokens; a request continuing it must give input_ids (the "
            "held tokens followed by new ones), not inputs_embeds. Pass a fresh cache to prefill from embeddings."
        )
    if token_ids is None:
        raise ValueError(
            "This DualDecoderCache was filled from inputs_embeds, so a continuation cannot be checked against "
            "its tokens. Pass a fresh cache."
        )
    held = token_ids.shape[0]
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
    held_ids = token_ids.expand(given.shape[0], -1)
    if not torch.equal(given, held_ids):
        row, position = (given != held_ids).nonzero()[0].tolist()
        raise ValueError(
            f"input_ids do not extend the sequences this DualDecoderCache holds: sequence {row} has token "
            f"{int(given[row, position])} at position {position}, where the cache holds "
            f"{int(held_ids[row, position])}. Pass the previous output (sequences) followed by the new "
            "tokens, or a fresh cache."
        )
    sink_last = sequences.sink_last.expand(given.shape[0])  # (B,) last fixed position of each sequence
    positions = torch.arange(min(int(sink_last.max()) + 1, stored))[None, :].expand(given.shape[0], -1)
    real = sequences.is_real(positions)
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


def check_batch_continues(held: int, batch_size: int, selector: str) -> None:
    """Raise `ValueError` unless a request of `batch_size` sequences may continue the `held` sequences a cache stores:
    the same batch, or one stored sequence that `selector` (a `DualDecoderConfig.selector` name) can share."""
    if held != batch_size and (held != 1 or not SELECTORS[selector].shares_prefix):
        raise ValueError(
            f"This DualDecoderCache holds {held} sequence(s); a request continuing them must have the same "
            f"batch size, got {batch_size}"
            + ("." if held != 1 else f": selector={selector!r} cannot share one stored "
               f"sequence across a batch (use one of {[n for n, c in SELECTORS.items() if c.shares_prefix]}).")
        )


def check_kv_heads(layer: Any, layer_idx: int, heads: int, kv_heads: int, shard: TensorShard) -> None:
    """Raise `ValueError` when a full-attention layer's first keys have `heads` KV heads and a cache sized for
    `kv_heads` (`shard`'s) cannot hold them: a rank's share given to a cache sized for the whole model, or another
    share than this rank's (unsharded, more heads than the config states is served as computed: GPT-NeoX ignores
    `num_key_value_heads`)."""
    if isinstance(layer, DualLayer) and not layer.is_initialized and (
            heads < kv_heads or (shard.sharded and heads != kv_heads)):
        raise ValueError(
            f"Layer {layer_idx} gave {heads} KV heads; this DualDecoderCache was sized for "
            f"{kv_heads} ({shard.describe()}). Under tensor parallelism pass the model itself to "
            "cache.check_model(model) (generate() does) so the cache holds this rank's heads."
        )


_verified: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
_verified_lock = threading.Lock()


class _UpdateRecorder(DynamicCache):
    """A `DynamicCache` that records which layers called `update()`."""

    def __init__(self, config) -> None:
        super().__init__(config=config)
        self.updated: set[int] = set()

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.updated.add(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def check_model_serves_dual(model, cache: Cache, cache_arg: str, probe_input: dict) -> None:
    """Raise `ValueError` unless `model` passes the cache and the `dual_cache` keyword to the attention of every
    layer `cache` serves, with attention options the dual cache implements.

    Args:
        model: a transformers causal LM.
        cache: the request's `DualDecoderCache` (its layers' types decide which layers must be reached).
        cache_arg: the forward argument that takes the cache (`"cache"` or `"past_key_values"`).
        probe_input: `{"input_ids": (1, 1) int64}` or `{"inputs_embeds": (1, 1, hidden)}`: one real input position
            of the request, for the probe forward.

    Raises:
        ValueError: for an attention implementation other than `SUPPORTED_IMPLEMENTATIONS`, a probe forward that
            fails, layers the cache or the keyword does not reach, or attention dropout / sinks.
    """
    implementation = model.config._attn_implementation
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise refuse("attention implementations other than sdpa and eager",
                     f"This model uses attn_implementation={implementation!r}")
    served = [i for i, layer in enumerate(cache.layers) if isinstance(layer, DualLayer)]
    key = (implementation, tuple(served))
    with _verified_lock:
        if key in _verified.get(model, ()):
            return
    probe, recorder = AttentionProbe(), _UpdateRecorder(model.config)
    first = next(iter(probe_input.values()))
    ones = torch.ones(1, 1, dtype=torch.long, device=first.device)
    # the uncompiled forward: `model.compile()` acts in `__call__`, a compiled forward keeps the original
    forward = getattr(model.forward, "_torchdynamo_orig_callable", model.forward)
    try:
        with torch.no_grad():
            forward(**probe_input, attention_mask=ones, position_ids=ones - 1, use_cache=True, logits_to_keep=1,
                  dual_cache=probe, **{cache_arg: recorder})
    except Exception as error:
        raise ValueError(
            f"A one-token forward of {type(model).__name__} with generate()'s arguments and the default cache "
            f"failed before the dual cache did any work ({type(error).__name__}: {error}). Fix the model call "
            "with the default cache first."
        ) from error
    name = type(model).__name__
    no_cache = [i for i in served if i not in recorder.updated]
    if no_cache:
        raise refuse("decoder layers that do not hand the cache to attention",
                     f"{name} does not hand the cache to the attention of layers {no_cache}")
    no_kwarg = [i for i in served if i not in probe.layers]
    if no_kwarg:
        raise refuse("decoder layers that do not pass generate()'s keyword arguments to attention",
                     f"{name}'s decoder layers {no_kwarg} do not pass generate()'s keyword arguments on to the "
                     "attention function")
    refused = {i: options for i, options in probe.unsupported.items() if i in served}
    if refused:
        raise refuse("attention dropout or attention sinks",
                     f"{name} asks its attention for options the dual cache does not implement ({refused})")
    with _verified_lock:
        _verified.setdefault(model, set()).add(key)
