"""`selector="shortlist"`: a few key channels shortlist positions, exact top-k among the shortlist (SparQ-style).

Per (sequence, KV head):

1. approximate: the `r` channels where the query is largest (|q| summed over the GQA group) give an approximate
   score `q̄_r · k_r` for every candidate, read from a channel-major copy of the keys (`r / D` of the key bytes);
   `q̄_r` is the group's mean partial query, each head scaled by the softmax temperature correction
   `sqrt(‖q‖₁ / ‖q_r‖₁)` of SparQ attention (Ribar et al., 2023, §3); the `keep = shortlist_factor × budget`
   best-scoring positions are the shortlist;
2. exact: the criterion of `retrieval.select` — softmax attention mass summed over the group — with exact logits,
   over the shortlisted positions only, top-`budget`. Each query head's softmax is normalised over the shortlist,
   not over every candidate; with GQA (G > 1) the ranking can therefore differ from the exact top-k even when the
   shortlist holds all of it.

When `keep` covers every scored position, the result is the exact selection (`retrieval.select` is called
directly). The approximate stage still runs a top-k over every position: this selector reads fewer bytes than
`"exact"`, not fewer positions.
"""

from __future__ import annotations

import torch

from ..host_store import host_tensor
from ..retrieval import select
from .base import Candidates, Selector, select_in_shortlist


class ShortlistSelector(Selector):
    """Two-stage selection over a channel-major copy of the keys (kept on the host, `(B, H_kv, D, chunk)` per store
    chunk, filled lazily up to the selectable range; +50% host bytes over the store's K/V)."""

    name = "shortlist"
    shares_prefix = False  # its channel-major copy is per sequence

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.channels = self.config.shortlist_channels_for(self.store.head_dim)
        self.keep = None  # positions shortlisted per (sequence, KV head); None: shortlist_factor × budget
        self._chunks: list[torch.Tensor] = []  # channel-major keys, one per store chunk
        self.length = 0  # positions copied so far

    @property
    def shortlisted(self) -> int:
        """Positions shortlisted per (sequence, KV head) for the exact stage."""
        return self.keep if self.keep is not None else self.config.shortlist_factor * self.budget

    @classmethod
    def host_bytes_for(cls, config, tokens: int, kv_heads: int, head_dim: int, element_size: int) -> int:
        return tokens * kv_heads * head_dim * element_size  # one more copy of the keys

    def extend(self, length: int, first_real: torch.Tensor, first_sequence: int = 0) -> None:
        """Copy the keys of positions `[self.length, length)` into the channel-major layout, one chunk per store
        chunk (every sequence of the store at once)."""
        store = self.store
        spans = store.chunk_spans()
        while len(self._chunks) < len(spans) and spans[len(self._chunks)][0] < length:
            shape = (*store.shape_prefix, store.head_dim, spans[len(self._chunks)][1])
            self.claim_host(torch.Size(shape).numel() * store.element_size)
            self._chunks.append(host_tensor(shape, store.dtype))
        views = store.key_chunks(length)
        for (start, size), keys, copy in zip(spans, views, self._chunks):
            lo = max(self.length, start)
            if lo < start + keys.shape[2]:
                copy[:, :, :, lo - start : keys.shape[2]].copy_(keys[:, :, lo - start :].transpose(-1, -2))
        self.length = max(self.length, length)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def channel_products(self, left: torch.Tensor, channels: torch.Tensor, end: int, first_sequence: int = 0):
        """`left @ keys[..., channels]ᵀ` over positions `[0, end)`, reading only those channels of the keys.

        Args:
            left: `(b, H_kv, G, r)` in the store's dtype.
            channels: `(b, H_kv, r)` int64 channel indices in `[0, D)`, per sequence and KV head.
            end: positions read (`<= self.length`; call `extend` first).
            first_sequence: the `b` rows are the store's sequences `first_sequence, …`.

        Returns:
            `(b, H_kv, G, end)` float32 (products computed in the store's dtype).
        """
        store = self.store
        batch, kv_heads, r = channels.shape
        first = store.first_row(first_sequence, batch)
        rows = ((first + torch.arange(batch * kv_heads)).view(batch, kv_heads, 1) * store.head_dim + channels).flatten()
        out = torch.empty(*left.shape[:-1], end, dtype=torch.float32)
        for (start, size), copy in zip(store.chunk_spans(), self._chunks):
            if start >= end:
                break
            width = min(size, end - start)
            part = copy.view(-1, size).index_select(0, rows).view(batch, kv_heads, r, size)[..., :width]
            out[..., start : start + width].copy_(torch.matmul(left, part))
        return out

    def shortlist(self, query: torch.Tensor, candidates: Candidates) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 1: `positions` `(b, H_kv, m)` int64 of highest approximate score and `usable` `(b, H_kv, m)` bool
        (False at non-candidates), `m = min(keep, end)`. With bf16 keys the scores are bf16 products (ties at the
        shortlist's edge are broken arbitrarily)."""
        end = candidates.end
        self.extend(end, candidates.first_real, candidates.first_sequence)
        batch, q_heads, dim = query.shape
        kv_heads = self.store.shape_prefix[1]
        grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, dim)
        r = min(self.channels, dim)
        chosen = torch.topk(grouped.abs().sum(dim=2), r, dim=-1).indices  # (b, H_kv, r)
        partial = torch.gather(grouped, 3, chosen[:, :, None, :].expand(-1, -1, grouped.shape[2], -1))
        temperature = (grouped.abs().sum(-1, keepdim=True) / partial.abs().sum(-1, keepdim=True).clamp(min=1e-30)).sqrt()
        mean = (partial * temperature).mean(dim=2, keepdim=True).to(self.store.dtype)  # (b, H_kv, 1, r)
        score = self.channel_products(mean, chosen, end, candidates.first_sequence)[:, :, 0]
        bias = torch.zeros(candidates.mask.shape, dtype=score.dtype).masked_fill_(~candidates.mask, float("-inf"))
        score += bias[:, None, :]
        positions = torch.topk(score, min(self.shortlisted, end), dim=-1, sorted=False).indices
        usable = torch.gather(candidates.mask[:, None, :].expand(batch, kv_heads, end), 2, positions)
        return positions, usable

    def key_bytes_read(self, end: int) -> tuple[int, int]:
        """`shortlist_channels` channels of every key, then the whole keys of the shortlist."""
        if self.shortlisted >= end:
            return super().key_bytes_read(end)
        row = self.store.shape_prefix[1] * self.store.element_size
        return row * end * min(self.channels, self.store.head_dim), row * self.shortlisted * self.store.head_dim

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.store.first_row(candidates.first_sequence, query.shape[0])  # ValueError for rows outside the batch
        if self.shortlisted >= candidates.end:  # every position would be shortlisted: the exact selection
            keys = self.store.key_chunks(candidates.end, candidates.rows)
            return select(query, keys, candidates.mask, self.budget, scaling)
        positions, usable = self.shortlist(query, candidates)
        return select_in_shortlist(self.store, query, positions, usable, candidates.first_sequence, self.budget,
                                   scaling)

    @property
    def host_bytes(self) -> int:
        return sum(chunk.nbytes for chunk in self._chunks)

    def free(self) -> None:
        self._chunks.clear()
        self.length = 0

