"""Host admission: the host memory a request will take, planned and checked before anything is allocated.

`plan_request` decides what every full-attention layer of a cache reserves for a request (its store and its
selector's host state) and the total; `HostPlan.check` raises the request's `HostMemoryError` when the total does not
fit the cache's allowance (`host.memory.HostMemory`). `host_bytes_needed` is the same arithmetic for a batch the
serving scheduler or `regroup` plans before any cache holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import DualDecoderConfig
from ..host.growth import planned_capacity
from ..host.memory import HostMemory
from ..host.store import HostKVStore
from ..layer.layer import DualLayer
from ..selection.selectors import SELECTORS


@dataclass(frozen=True)
class HostPlan:
    """What a request takes in host memory, decided before anything is allocated (`plan_request`).

    Attributes:
        reserve: tokens per sequence each full-attention layer's store holds at once when the request starts.
        store_bytes: bytes one full-attention layer's store adds for the request (keys + values, every sequence).
        index_bytes: bytes one retrieving layer's selector adds on the host (every sequence).
        layers, retrieving: full-attention layers, and those of them that retrieve (budget > 0).
        shared_index_bytes: bytes of the per-sequence copies of a shared prefix's index (`Selector.share`), 0 when
            no stored sequence is shared.
        request: what needs the bytes, for the error message.
    """

    reserve: int
    store_bytes: int
    index_bytes: int
    layers: int
    retrieving: int
    shared_index_bytes: int
    request: str

    @property
    def needed(self) -> int:
        """Bytes the request adds in all."""
        return self.layers * self.store_bytes + self.retrieving * self.index_bytes + self.shared_index_bytes

    def check(self, host_memory: HostMemory) -> None:
        """Raise `HostMemoryError` (naming the bytes needed, the bytes allowed and the knobs to turn) unless the plan
        fits in `host_memory`; nothing is claimed."""
        host_memory.check(self.needed, self.request)


def layer_host_bytes(config: DualDecoderConfig, batch_size: int, tokens: int, dtype: torch.dtype, kv_heads: int,
                     head_dim: int, prompt_tokens: int = 0) -> tuple[int, int]:
    """Host bytes of one full-attention layer's store and of one retrieving layer's selector host state for `tokens`
    tokens of `batch_size` sequences, when the first `prompt_tokens` are reserved at once and the rest arrive a decode
    step at a time (`host.growth.planned_capacity`)."""
    capacity = planned_capacity(prompt_tokens, tokens, config.host_chunk_tokens)
    store = HostKVStore.chunk_nbytes(batch_size, kv_heads, head_dim, dtype, capacity)
    selector = SELECTORS[config.selector].host_bytes_for(
        config, capacity, kv_heads, head_dim, torch.empty((), dtype=dtype).element_size()
    )
    return store, batch_size * selector


def host_bytes_needed(config: DualDecoderConfig, layers: Sequence[DualLayer], batch_size: int, tokens: int,
                      dtype: torch.dtype, kv_heads: int, head_dim: int, prompt_tokens: int = 0) -> int:
    """Host bytes the stores of the full-attention `layers` (and their selectors' host state) take for `tokens`
    tokens of `batch_size` sequences (`layer_host_bytes`)."""
    store, index = layer_host_bytes(config, batch_size, tokens, dtype, kv_heads, head_dim, prompt_tokens)
    return len(layers) * store + sum(1 for layer in layers if layer.budget > 0) * index


def plan_request(config: DualDecoderConfig, layers: Sequence[DualLayer], batch_size: int, tokens: int, stored: int,
                 input_tokens: int, held: int, dtype: torch.dtype, kv_heads: int, head_dim: int) -> HostPlan:
    """The host plan of a request of `batch_size` sequences holding at most `tokens` tokens each (`input_tokens` of
    them its input) on a cache whose full-attention `layers` store `stored` tokens of `held` sequences.

    A first request's length is known (prompt + max new tokens): its stores are sized to it at once. A continuing
    conversation reserves its input and grows geometrically (`host.growth.next_chunk_tokens`); only the new positions
    are each sequence's own (the stored ones are kept, shared when one stored sequence is continued by a batch, whose
    index is then copied per sequence)."""
    if stored == 0:
        reserve, new_tokens, prompt = tokens, tokens, tokens
    else:
        reserve, new_tokens, prompt = input_tokens, tokens - stored, input_tokens - stored
    store, index = layer_host_bytes(config, batch_size, new_tokens, dtype, kv_heads, head_dim, prompt)
    shared = 0
    if stored and held != batch_size:  # a per-sequence index of the shared prefix is copied per sequence (`share`)
        shared = (batch_size - 1) * sum(layer.selector.host_bytes for layer in layers if layer.selector is not None)
    return HostPlan(reserve, store, index, len(layers), sum(1 for layer in layers if layer.budget > 0), shared,
                    f"{batch_size} sequence(s) of {tokens} tokens ({len(layers)} full-attention layers)")
