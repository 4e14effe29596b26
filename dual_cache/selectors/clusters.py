"""`selector="clusters"`: a host-side index of balanced key clusters; exact top-k among the best clusters' keys.

Exact selection reads every key of every layer at every step. This index lets a step read a small fraction of them
while choosing (nearly) the same entries:

- **Build (prefill, then every `cluster_segment` committed tokens).** Each sequence's keys are cut into segments
  of `cluster_segment` consecutive positions, starting at its first real token (so left padding never changes
  them). Per (segment, KV head), the keys are split in halves along their principal direction (a few power
  iterations from the highest-variance channel), recursively, until clusters of `cluster_size` keys: a balanced
  binary partition in key space, not by position. Each cluster keeps its member positions, its mean key `μ` and
  its per-channel key variance `v`. Completed segments are never rebuilt; positions past the last complete
  segment (fewer than `cluster_segment`) form the *tail* and are scored exactly.
- **Select.** Per (sequence, KV head, query head) every cluster gets the score `s·(q·μ) + 2·s·sqrt(q²·v)` (s: the
  softmax scale): the mean logit plus two standard deviations of the logit within the cluster under a diagonal
  Gaussian model of its keys — an estimate of the cluster's largest logit, in the spirit of Quest's per-page
  upper bound (Tang et al., 2024, §3.2) but over clusters of similar keys. Each query head's scores are normalised
  by their log-sum-exp over the clusters (weighted by size) and combined over the GQA group by log-sum-exp. The
  `cluster_factor × budget / cluster_size` best clusters' members plus the tail are the shortlist; their exact
  attention mass (each head's softmax normalised over the shortlist, summed over the group, as
  `retrieval.select`) picks the `budget` entries.

Top-k runs over clusters and the shortlist, never over every position. Below `cluster_min_context` selectable
positions, or when the shortlist would hold every position, the exact selection is computed directly. Host bytes: `2·D` elements per cluster (μ, v) plus an int32
position per token, e.g. 7% of the K/V for `cluster_size=16`. Nothing lives on the device.
"""

from __future__ import annotations

import torch

from ..host_store import host_tensor
from ..retrieval import products, select
from .base import Candidates, Selector, select_in_shortlist

SPREAD = 2.0  # standard deviations of the within-cluster logit added to its mean (the cluster's score)
POWER_ITERATIONS = 3  # per split, from the highest-variance channel
BUILD_GROUP_ELEMENTS = 1 << 20  # key elements clustered per call: larger calls fall out of the CPU caches (slower)


def balanced_clusters(keys: torch.Tensor, cluster_size: int) -> torch.Tensor:
    """Order of the keys that makes every run of `cluster_size` consecutive entries one cluster.

    Each group (initially all `S` keys) is split at the median of its keys' projection on their principal
    direction (power iteration from the channel of highest variance), recursively, until groups of
    `cluster_size`: a balanced principal-direction tree.

    Args:
        keys: `(N, S, D)` float keys of `N` independent groups (e.g. segments × KV heads); `S / cluster_size` must
            be a power of two.
        cluster_size: keys per cluster (tokens).

    Returns:
        `(N, S)` int64: `order[n, j]` is the index (in `[0, S)`) of the key at slot `j`; cluster `c` of group `n`
        holds `order[n, c·cluster_size : (c+1)·cluster_size]`.
    """
    count, size, dim = keys.shape
    order = torch.arange(size).expand(count, size).contiguous()
    points = keys.float()
    group = size
    while group > cluster_size:
        grouped = points.reshape(-1, group, dim)
        rows = torch.arange(grouped.shape[0])[:, None]
        mean = grouped.mean(dim=1)  # (n, D); the centring is folded into the products below
        variance = grouped.square().mean(dim=1) - mean.square()
        direction = torch.nn.functional.one_hot(variance.argmax(dim=-1), dim).float()
        for _ in range(POWER_ITERATIONS):  # direction ← Xcᵀ Xc direction, normalised (Xc: centred keys)
            weights = (grouped * direction[:, None, :]).sum(-1) - (mean * direction).sum(-1, keepdim=True)
            direction = torch.bmm(weights[:, None, :], grouped)[:, 0] - mean * weights.sum(-1, keepdim=True)
            direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        projection = (grouped * direction[:, None, :]).sum(-1)  # the centring shifts a group uniformly
        halves = torch.argsort(projection, dim=-1, stable=True)
        points = grouped[rows, halves].reshape(count, size, dim)
        order = order.reshape(-1, group)[rows, halves].reshape(count, size)
        group //= 2
    return order


class ClusterSelector(Selector):
    """The host index described in this module's docstring (`selector="clusters"`).

    Options (`DualDecoderConfig`): `cluster_size` (keys per cluster), `cluster_segment` (positions clustered
    together; a power-of-two multiple of `cluster_size`), `cluster_factor` (shortlist = factor × budget positions
    from the best clusters, plus the tail).
    """

    name = "clusters"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_size = self.config.cluster_size
        self.segment = self.config.cluster_segment
        batch, kv_heads = self.store.shape_prefix
        self.segments = torch.zeros(batch, dtype=torch.long)  # complete segments indexed, per sequence
        self.origin = torch.zeros(batch, dtype=torch.long)  # where each sequence's first segment starts
        self._capacity = 0  # clusters per (sequence, KV head) allocated
        self.means: torch.Tensor | None = None  # (B, H_kv, capacity, D) mean key of each cluster
        self.variances: torch.Tensor | None = None  # (B, H_kv, capacity, D) per-channel key variance of each cluster
        self.members: torch.Tensor | None = None  # (B, H_kv, capacity, cluster_size) int32 positions
        # a prefix every sequence shares (`share`): its clusters (batch 1) and where they end
        self.shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.shared_origin = 0  # where the shared prefix's first segment starts

    @property
    def keep_clusters(self) -> int:
        """Clusters shortlisted per (sequence, KV head): `cluster_factor × budget` positions."""
        return max(1, self.config.cluster_factor * self.budget // self.cluster_size)

    @classmethod
    def check_config(cls, config) -> None:
        size, segment = config.cluster_size, config.cluster_segment
        ratio = segment // size if size > 0 else 0
        if segment % size or ratio < 1 or ratio & (ratio - 1):
            raise ValueError(
                f"`cluster_segment` ({segment}) must be `cluster_size` ({size}) times a power of two, e.g. "
                f"{size * 64}; change one of them."
            )

    @classmethod
    def host_bytes_for(cls, config, tokens: int, kv_heads: int, head_dim: int, element_size: int) -> int:
        if tokens < config.cluster_min_context:  # never built: exact selection below it
            return 0
        clusters = -(-tokens // config.cluster_size)
        return kv_heads * clusters * (2 * head_dim * element_size + 4 * config.cluster_size)

    # --- index ---------------------------------------------------------------------------------------
    def _grow(self, clusters: int) -> None:
        """Make room for `clusters` clusters per (sequence, KV head), and for as many as the store's capacity can
        hold (so the index grows when the store does; contents are copied, never recomputed)."""
        if clusters <= self._capacity:
            return
        own = self.store.capacity - self.store.shared_length  # positions each sequence holds on its own
        capacity = max(clusters, -(-own // self.cluster_size))
        batch, kv_heads = self.store.shape_prefix
        dim = self.store.head_dim
        self.claim_host(batch * kv_heads * (capacity - self._capacity)
                        * (2 * dim * self.store.element_size + 4 * self.cluster_size))
        grown = [host_tensor((batch, kv_heads, capacity, dim), self.store.dtype) for _ in range(2)]
        grown.append(host_tensor((batch, kv_heads, capacity, self.cluster_size), torch.int32))
        if self._capacity:
            for new, old in zip(grown, (self.means, self.variances, self.members)):
                new[:, :, : self._capacity] = old
        self.means, self.variances, self.members = grown
        self._capacity = capacity

    def share(self) -> None:
        """The store's one sequence is now a prefix every sequence shares: its clusters are kept once (batch 1)
        and scored for every sequence's query in one product; each sequence clusters what follows on its own."""
        if self.means is not None and int(self.segments[0]):
            used = int(self.segments[0]) * (self.segment // self.cluster_size)
            parts = (self.means[:, :, :used], self.variances[:, :, :used], self.members[:, :, :used])
            self.claim_host(sum(part.numel() * part.element_size() for part in parts))
            self.shared = tuple(host_tensor(part.shape, part.dtype).copy_(part) for part in parts)  # contiguous
            self.shared_origin = int(self.origin[0])
        batch = self.store.shape_prefix[0]
        self.segments = torch.zeros(batch, dtype=torch.long)
        self.origin = torch.zeros(batch, dtype=torch.long)
        self.means = self.variances = self.members = None
        self._capacity = 0

    def _own_first_real(self, candidates: Candidates) -> torch.Tensor:
        """`(b,)` where each sequence's own segments start: its first real token, past a shared prefix (its first
        candidate there: the sink lies in the prefix)."""
        start = self.store.shared_length
        if not start:
            return candidates.first_real
        own = candidates.mask[:, start:]
        if own.shape[1] == 0:  # nothing selectable past the prefix yet
            return torch.full((own.shape[0],), start, dtype=torch.long)
        return torch.where(own, torch.arange(own.shape[1]), own.shape[1]).amin(dim=1) + start

    def extend(self, length: int, first_real: torch.Tensor, first_sequence: int = 0) -> None:
        """Cluster every segment that `length` committed tokens complete and that is not indexed yet, for the
        sequences `first_sequence, …` whose first real positions (past a shared prefix) are `first_real` `(b,)`."""
        if length < self.config.cluster_min_context:
            return  # selections take the exact path below it: build the index once it is reached
        rows = slice(first_sequence, first_sequence + len(first_real))
        self.origin[rows] = first_real  # fixed once a sequence has a real token: pads are all on the left
        done = self.segments[rows]
        complete = ((length - first_real).clamp(min=0) // self.segment).clamp(min=done)
        if bool((complete == done).all()):
            return
        per_segment = self.segment // self.cluster_size
        self._grow(int(complete.max()) * per_segment)
        self.store.wait_written()
        todo = [(first_sequence + i, index) for i in range(len(complete))
                for index in range(int(done[i]), int(complete[i]))]
        starts = torch.tensor([int(self.origin[row]) + index * self.segment for row, index in todo])
        kv_heads, dim = self.store.shape_prefix[1], self.store.head_dim
        per_call = max(1, BUILD_GROUP_ELEMENTS // (kv_heads * self.segment * dim))  # segments clustered together
        for first in range(0, len(todo), per_call):
            self._build(todo[first : first + per_call], starts[first : first + per_call])
        self.segments[rows] = complete

    def _build(self, todo: list[tuple[int, int]], starts: torch.Tensor) -> None:
        """Cluster the segments `todo` (`(sequence, segment index)` pairs starting at positions `starts`)."""
        kv_heads, dim = self.store.shape_prefix[1], self.store.head_dim
        per_segment = self.segment // self.cluster_size
        keys = torch.stack([self.store.read(int(start), int(start) + self.segment)[0][row]
                            for (row, _), start in zip(todo, starts)])  # (n, H_kv, S, D)
        flat = keys.reshape(-1, self.segment, dim)
        order = balanced_clusters(flat, self.cluster_size)
        clustered = torch.gather(flat.float(), 1, order[..., None].expand(-1, -1, dim))
        clustered = clustered.view(len(todo), kv_heads, per_segment, self.cluster_size, dim)
        means = clustered.mean(dim=3).to(self.store.dtype)
        variances = clustered.var(dim=3, unbiased=False).to(self.store.dtype)
        positions = (order.view(len(todo), kv_heads, per_segment, self.cluster_size)
                     + starts.view(-1, 1, 1, 1)).to(torch.int32)
        for i, (row, index) in enumerate(todo):
            span = slice(index * per_segment, (index + 1) * per_segment)
            self.means[row, :, span], self.variances[row, :, span] = means[i], variances[i]
            self.members[row, :, span] = positions[i]

    def truncate(self, length: int) -> None:
        """Forget the segments that reach past `length` (they are built again once tokens are committed)."""
        fits = ((length - self.origin) // self.segment).clamp(min=0)
        self.segments = torch.minimum(self.segments, fits)

    # --- selection -----------------------------------------------------------------------------------
    def key_bytes_read(self, end: int) -> tuple[int, int]:
        """Every cluster's mean and variance, then the keys of the best clusters and of the unclustered tail
        (for a sequence whose segments start at position 0)."""
        if end < self.config.cluster_min_context or self.keep_clusters * self.cluster_size >= end:
            return super().key_bytes_read(end)
        row = self.store.shape_prefix[1] * self.store.head_dim * self.store.element_size
        clustered = end // self.segment * self.segment
        summaries = clustered // self.cluster_size * 2  # a mean and a variance per cluster
        return row * summaries, row * (self.keep_clusters * self.cluster_size + end - clustered)

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
        self.store.first_row(candidates.first_sequence, query.shape[0])  # ValueError for rows outside the batch
        end = candidates.end
        if end < self.config.cluster_min_context or self.keep_clusters * self.cluster_size >= end:
            # a short context (exact costs less), or the shortlist would hold every position
            keys = self.store.key_chunks(end, candidates.rows)
            return select(query, keys, candidates.mask, self.budget, scaling)
        self.extend(end, self._own_first_real(candidates), candidates.first_sequence)
        positions, usable = self.shortlist(query, candidates, scaling)
        return select_in_shortlist(self.store, query, positions, usable, candidates.first_sequence, self.budget,
                                   scaling)

    def shortlist(self, query: torch.Tensor, candidates: Candidates, scaling: float):
        """Stage 1: `positions` `(b, H_kv, m)` int64 (members of the best clusters, then the unclustered tail) and
        `usable` `(b, H_kv, m)` bool (a selectable candidate, counted once)."""
        end, rows = candidates.end, candidates.rows
        batch, q_heads, dim = query.shape
        kv_heads = self.store.shape_prefix[1]
        group = q_heads // kv_heads
        per_segment = self.segment // self.cluster_size
        origin = self.origin[rows]
        usable_segments = ((end - origin).clamp(min=0) // self.segment).clamp(max=self.segments[rows])
        own_clusters = int(usable_segments.max()) * per_segment
        # the shared segments that end before `end` (the last ones may reach into the local window)
        shared_segments = 0 if self.shared is None else min(self.shared[0].shape[2] // per_segment,
                                                             max(0, (end - self.shared_origin) // self.segment))
        shared_clusters = shared_segments * per_segment
        shared_end = self.shared_origin + shared_segments * self.segment
        # the tail: positions past the shared clusters (to the shared prefix's end) and past each own segment
        tail_start = origin + usable_segments * self.segment  # (b,)
        tail_from = int(tail_start.min()) if own_clusters or shared_clusters else 0
        shared_tail = torch.arange(shared_end, max(shared_end, min(self.store.shared_length, end, tail_from)))
        tail = torch.cat([shared_tail, torch.arange(min(tail_from, end), end)])
        tail_usable = candidates.mask[:, tail] & ((tail[None, :] >= tail_start[:, None]) |
                                                 (tail[None, :] < self.store.shared_length))
        if own_clusters + shared_clusters == 0:
            positions = tail.expand(batch, kv_heads, -1)
            return positions, tail_usable[:, None, :].expand(batch, kv_heads, -1)
        scaled = query.reshape(batch, kv_heads, group, dim) * scaling
        scores, members, exists = [], [], []
        if shared_clusters:  # every sequence's queries against the shared clusters: one product
            means, variances, shared_members = self.shared
            if shared_clusters < means.shape[2]:  # (a prefix view would be copied whole by the batched product)
                means, variances, shared_members = (part[:, :, :shared_clusters].contiguous() for part in self.shared)
            stacked = scaled.transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
            score = self._cluster_scores(stacked, means, variances)[0]
            scores.append(score.view(kv_heads, batch, group, -1).transpose(0, 1))
            members.append(shared_members.expand(batch, -1, -1, -1))
            exists.append(torch.ones(batch, shared_clusters, dtype=torch.bool))
        if own_clusters:
            scores.append(self._cluster_scores(scaled, self.means[rows], self.variances[rows]))
            members.append(self.members[rows])
            exists.append(torch.arange(self._capacity)[None, :] < (usable_segments * per_segment)[:, None])
        score, exists = torch.cat(scores, dim=-1), torch.cat(exists, dim=-1)  # (b, H_kv, G, clusters), (b, clusters)
        score.masked_fill_(~exists[:, None, None, :], float("-inf"))
        score -= torch.logsumexp(score, dim=-1, keepdim=True)  # each head's share (cluster sizes are equal)
        score = torch.logsumexp(score, dim=2)  # (b, H_kv, clusters): combined over the GQA group
        top = torch.topk(score, min(self.keep_clusters, own_clusters + shared_clusters), dim=-1, sorted=False).indices
        chosen = torch.gather(exists[:, None, :].expand(batch, kv_heads, -1), 2, top)  # (b, H_kv, m)
        members = members[0] if len(members) == 1 else torch.cat(members, dim=2)
        picked = torch.gather(members, 2, top[..., None].expand(-1, -1, -1, self.cluster_size))
        picked = torch.where(chosen[..., None], picked, 0).flatten(2).long()
        picked_usable = chosen.repeat_interleave(self.cluster_size, dim=-1) & torch.gather(
            candidates.mask[:, None, :].expand(batch, kv_heads, end), 2, picked)
        positions = torch.cat([picked, tail.expand(batch, kv_heads, -1)], dim=-1)
        usable = torch.cat([picked_usable, tail_usable[:, None, :].expand(batch, kv_heads, -1)], dim=-1)
        return positions, usable

    @staticmethod
    def _cluster_scores(scaled: torch.Tensor, means: torch.Tensor, variances: torch.Tensor) -> torch.Tensor:
        """`(b, H_kv, G, clusters)` float32 `s·(q·μ) + SPREAD·sqrt(s²·(q²·v))` for scaled queries `(b, H_kv, G, D)`
        against contiguous `(b, H_kv, clusters, D)` means and variances."""
        center = products(scaled.to(means.dtype), means)
        spread = products(scaled.square().to(means.dtype), variances)
        return spread.float().clamp_(min=0).sqrt_().mul_(SPREAD).add_(center)

    @property
    def host_bytes(self) -> int:
        parts = [] if self.shared is None else [*self.shared]
        parts += [] if self.means is None else [self.means, self.variances, self.members]
        return sum(part.nbytes for part in parts)

    def free(self) -> None:
        self.means = self.variances = self.members = self.shared = None
        self._capacity = 0
        self.segments = torch.zeros_like(self.segments)
