"""The layers a `DualDecoderCache` is made of, one per model layer: a `DualLayer` (`layer/layer.py`) for each layer
served as full attention, a `SlidingWindowLayer` for each sliding-window one (e.g. Gemma 3's local layers); building
them for a request's length, turning a full-attention-served sliding layer into a sliding one once a conversation passes
its window (docs/design.md §2), and sharing a stored prefix across a batch.

A sliding-window layer keeps its own window on the device, as transformers' `DynamicSlidingWindowLayer` does; the
dual cache's also keeps the step's speculated token until `crop(-1)` removes it, and refuses between requests a crop
its window cannot serve.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicSlidingWindowLayer

from ..config import DualDecoderConfig
from ..host.memory import HostMemory
from ..layer.layer import DualLayer
from ..layer.sequences import SequenceState
from ..model.layer_types import SLIDING_ATTENTION
from .stats import layer_host_bytes


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' `DynamicSlidingWindowLayer` recording its past (it keeps the speculated token until `crop(-1)`
    removes it), with the dual cache's crop refusals (`check_crop`).

    Args:
        sliding_window: the layer's window (tokens).
        sequences: the cache's `SequenceState` (the sink and leading pads a crop must keep), read-only here.

    Attributes:
        request_running: True from `begin_request` to `end_request` (crops then remove a step's speculated token
            and are not refused).
    """

    def __init__(self, sliding_window: int, sequences: SequenceState) -> None:
        super().__init__(sliding_window=sliding_window)
        self.activate_past_recording()  # keeps the speculated token until crop(-1) removes it
        self.sequences = sequences
        self.request_running = False

    def begin_request(self, schedule: Any, tokens: int, reserve: int) -> None:
        """A request starts (`DualLayer.begin_request`'s arguments; a sliding layer needs none of them)."""
        self.request_running = True

    def end_request(self) -> None:
        """The request ended: crops between requests are checked again (`check_crop`)."""
        self.request_running = False

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise `ValueError` for a crop this layer refuses; nothing is changed: those of `SequenceState.check_crop`,
        and between requests any crop once the layer has passed its window (it keeps only the last
        `sliding_window - 1` tokens, so the tokens its window would need again are gone)."""
        stored = self.get_seq_length()
        self.sequences.check_crop(tokens_to_remove, stored, not self.request_running)
        if tokens_to_remove < 0 and not self.request_running and stored >= self.sliding_window:
            raise ValueError(
                f"crop({tokens_to_remove}): a sliding-window layer past its window ({self.sliding_window} tokens) "
                "keeps only the tokens that window needs, so it cannot continue from an earlier point; use a fresh "
                "cache."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop, after `check_crop`."""
        self.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)


def slide(layer: DualLayer, sliding_window: int, sequences: SequenceState,
          host_memory: HostMemory) -> SlidingWindowLayer:
    """A sliding-window layer holding what `layer` (a full-attention-served sliding layer, between requests) stored
    that its window keeps: the last `sliding_window - 1` positions, on the layer's device. Frees `layer`'s host store
    and index and returns their bytes to `host_memory`, the cache's host-memory allowance."""
    sliding = SlidingWindowLayer(sliding_window, sequences)
    if layer.host is not None and layer.host.length:
        stored = layer.host.length
        first = max(0, stored - (sliding_window - 1))
        batch, kv_heads = layer.host.shape_prefix
        keys = torch.empty(batch, kv_heads, stored - first, layer.host.head_dim, dtype=layer.host.dtype,
                           device=layer.device)
        values = torch.empty_like(keys)
        layer.host.read_into(first, stored, keys, values)
        sliding.lazy_initialization(keys[:, :, :0], values[:, :, :0])
        sliding.keys, sliding.values, sliding.cumulative_length = keys, values, stored
    freed = layer_host_bytes(layer)
    layer.free()
    host_memory.release(freed)
    return sliding


def build_layers(layer_types: list[str], sliding_window: int | None, config: DualDecoderConfig,
                 sequences: SequenceState, host_memory: HostMemory) -> list[CacheLayerMixin]:
    """One fresh, empty layer per model layer of `layer_types` (`layer_types.resolve_layer_types`): a
    `SlidingWindowLayer` of `sliding_window` tokens for a sliding one, else a `DualLayer` of the layer's budget
    (`DualDecoderConfig.budget_for_layer`), sharing the cache's `sequences` and `host_memory` allowance."""
    layers: list[CacheLayerMixin] = []
    for layer_idx, layer_type in enumerate(layer_types):
        if layer_type == SLIDING_ATTENTION:
            layer = SlidingWindowLayer(sliding_window, sequences)
        else:
            layer = DualLayer(layer_idx, config, config.budget_for_layer(layer_idx), sequences, host_memory)
        layers.append(layer)
    return layers


def slide_layers(layers: list[CacheLayerMixin], layer_types: list[str], wanted: list[str],
                 sliding_window: int | None, sequences: SequenceState, host_memory: HostMemory) -> None:
    """Make every layer that `wanted` (the layer types for the next request's length) has sliding, and that is
    still a `DualLayer` holding tokens, a sliding-window layer (`slide`); `layers` and `layer_types` change in
    place. A layer already sliding stays sliding (it is exact at any length)."""
    for layer_idx, layer_type in enumerate(wanted):
        layer = layers[layer_idx]
        if layer_type == SLIDING_ATTENTION and isinstance(layer, DualLayer):
            layers[layer_idx] = slide(layer, sliding_window, sequences, host_memory)
            layer_types[layer_idx] = SLIDING_ATTENTION


def share_layers(layers: list[CacheLayerMixin], batch_size: int) -> None:
    """The one stored sequence becomes a prefix that `batch_size` sequences continue: full-attention layers keep it
    once on the host (`DualLayer.share`), sliding-window layers copy their window per sequence."""
    for layer in layers:
        if isinstance(layer, DualLayer):
            layer.share(batch_size)
        elif layer.is_initialized:
            layer.batch_repeat_interleave(batch_size)
