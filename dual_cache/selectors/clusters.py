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
- **Two levels (`cluster_fanout` > 1).** Consecutive runs of `cluster_fanout` clusters of a segment are subtrees of
  its partition (nodes of `cluster_fanout × cluster_size` similar keys); each node keeps the mean and per-channel
  variance of its keys too. A step scores every node the same way, keeps the `cluster_node_factor × (clusters
  kept) / cluster_fanout` best, and scores only their clusters: stage 1 reads about `1 / cluster_fanout` of the
  cluster summaries at long contexts. When every node would be kept, the one-level path runs (the same choice).

Top-k runs over clusters and the shortlist, never over every position. Below `cluster_min_context` selectable
positions, or when the shortlist would hold every position, the exact selection is computed directly. Host
bytes: `2·D` elements per cluster (μ, v) and per node, plus an int32 position per token, e.g. 7% of the K/V for
`cluster_size=16`. Nothing lives on the device.
"""

from __future__ import annotations

import math

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
    from the best clusters, plus the tail), `cluster_fanout` (clusters per node of a second level; 1: one level)
    and `cluster_node_factor` (nodes kept = factor × clusters kept / fanout).
    """

    name = "clusters"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cluster_size = self.config.cluster_size
        self.segment = self.config.cluster_segment
        self.fanout = self.config.cluster_fanout
        batch, kv_heads = self.store.shape_prefix
        self.segments = torch.zeros(batch, dtype=torch.long)  # complete segments indexed, per sequence
        self.origin = torch.zeros(batch, dtype=torch.long)  # where each sequence's first segment starts
        self._capacity = 0  # clusters per (sequence, KV head) allocated (a multiple of the fanout)
        # (B, H_kv, capacity, D) mean key and per-channel key variance of each cluster, (B, H_kv, capacity,
        # cluster_size) int32 member positions, and with two levels (B, H_kv, capacity / fanout, D) the mean and
        # variance of each node; None until built
        self.parts: dict[str, torch.Tensor] | None = None
        # a prefix every sequence shares (`share`): its parts (batch 1, as many clusters as it has), and where it starts
        self.shared: dict[str, torch.Tensor] | None = None
        self.shared_origin = 0

    @property
    def keep_clusters(self) -> int:
        """Clusters shortlisted per (sequence, KV head): `cluster_factor × budget` positions."""
        return max(1, self.config.cluster_factor * self.budget // self.cluster_size)

    @property
    def keep_nodes(self) -> int:
        """Nodes whose clusters are scored per (sequence, KV head) with two levels: `ceil(cluster_node_factor ×
        keep_clusters / cluster_fanout)`."""
        return max(1, -(-self.config.cluster_node_factor * self.keep_clusters // self.fanout))

    def _two_levels(self, clusters: int) -> bool:
        """Whether a selection among `clusters` clusters goes through the nodes (it keeps only some of them)."""
        return self.fanout > 1 and self.keep_nodes < clusters // self.fanout

    @classmethod
    def check_config(cls, config) -> None:
        size, segment, fanout = config.cluster_size, config.cluster_segment, config.cluster_fanout
        ratio = segment // size if size > 0 else 0
        if segment % size or ratio < 1 or ratio & (ratio - 1):
            raise ValueError(
                f"`cluster_segment` ({segment}) must be `cluster_size` ({size}) times a power of two, e.g. "
                f"{size * 64}; change one of them."
            )
        if fanout & (fanout - 1) or fanout > ratio:
            raise ValueError(
                f"`cluster_fanout` ({fanout}) must be a power of two no larger than the clusters per segment "
                f"(`cluster_segment / cluster_size` = {ratio}); change it, or use 1 for one level."
            )

    @classmethod
    def host_bytes_for(cls, config, tokens: int, kv_heads: int, head_dim: int, element_size: int) -> int:
        if tokens < config.cluster_min_context:  # never built: exact selection below it
            return 0
        clusters = -(-tokens // (config.cluster_size * config.cluster_fanout)) * config.cluster_fanout
        return int(kv_heads * cls._bytes_per_cluster(config, head_dim, element_size) * clusters)

    @staticmethod
    def _bytes_per_cluster(config, head_dim: int, element_size: int) -> float:
        """Host bytes per cluster and KV head: its mean, variance and member positions, and its share of a node's
        mean and variance with two levels."""
        nodes = 0 if config.cluster_fanout == 1 else 1 / config.cluster_fanout  # nodes per cluster
        return 2 * head_dim * element_size * (1 + nodes) + 4 * config.cluster_size

    # --- index ---------------------------------------------------------------------------------------
    def _shapes(self, batch: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        kv_heads, dim, dtype = self.store.shape_prefix[1], self.store.head_dim, self.store.dtype
        shapes = {"means": ((batch, kv_heads, capacity, dim), dtype),
                  "variances": ((batch, kv_heads, capacity, dim), dtype),
                  "members": ((batch, kv_heads, capacity, self.cluster_size), torch.int32)}
        if self.fanout > 1:
            shapes["node_means"] = shapes["node_variances"] = ((batch, kv_heads, capacity // self.fanout, dim),
                                                               dtype)
        return shapes

    def _grow(self, clusters: int) -> None:
        """Make room for `clusters` clusters per (sequence, KV head), and for as many as the store's capacity can
        hold (so the index grows when the store does; contents are copied, never recomputed)."""
        if clusters <= self._capacity:
            return
        own = self.store.capacity - self.store.shared_length  # positions each sequence holds on its own
        capacity = max(clusters, -(-own // self.cluster_size))
        capacity = -(-capacity // self.fanout) * self.fanout
        batch = self.store.shape_prefix[0]
        shapes = self._shapes(batch, capacity)
        old_shapes = self._shapes(batch, self._capacity)
        self.claim_host(sum((math.prod(shape) - math.prod(old_shapes[name][0])) * dtype.itemsize
                            for name, (shape, dtype) in shapes.items()))
        grown = {name: host_tensor(shape, dtype) for name, (shape, dtype) in shapes.items()}
        if self.parts is not None:
            for name, old in self.parts.items():
                grown[name][:, :, : old.shape[2]] = old
        self.parts = grown
        self._capacity = capacity

    def share(self) -> None:
        """The store's one sequence is now a prefix every sequence shares: its clusters are kept once (batch 1)
        and scored for every sequence's query in one product; each sequence clusters what follows on its own."""
        if self.parts is not None and int(self.segments[0]):
            used = int(self.segments[0]) * (self.segment // self.cluster_size)
            parts = {name: part[:, :, : used // self.fanout if name.startswith("node") else used]
                     for name, part in self.parts.items()}
            self.claim_host(sum(part.numel() * part.element_size() for part in parts.values()))
            self.shared = {name: host_tensor(part.shape, part.dtype).copy_(part)  # contiguous
                           for name, part in parts.items()}
            self.shared_origin = int(self.origin[0])
        batch = self.store.shape_prefix[0]
        self.segments = torch.zeros(batch, dtype=torch.long)
        self.origin = torch.zeros(batch, dtype=torch.long)
        self.parts = None
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
        groups = {"": clustered.view(len(todo), kv_heads, per_segment, self.cluster_size, dim)}  # (n, H, c, C, D)
        if self.fanout > 1:  # a node: `fanout` consecutive clusters, a subtree of the partition
            groups["node_"] = clustered.view(len(todo), kv_heads, per_segment // self.fanout, -1, dim)
        built = {"members": (order.view(len(todo), kv_heads, per_segment, self.cluster_size)
                             + starts.view(-1, 1, 1, 1)).to(torch.int32)}
        for prefix, grouped in groups.items():
            built[prefix + "means"] = grouped.mean(dim=3).to(self.store.dtype)
            built[prefix + "variances"] = grouped.var(dim=3, unbiased=False).to(self.store.dtype)
        for i, (row, index) in enumerate(todo):
            for name, values in built.items():
                width = values.shape[2]
                self.parts[name][row, :, index * width : (index + 1) * width] = values[i]

    def truncate(self, length: int) -> None:
        """Forget the segments that reach past `length` (they are built again once tokens are committed)."""
        fits = ((length - self.origin) // self.segment).clamp(min=0)
        self.segments = torch.minimum(self.segments, fits)

    # --- selection -----------------------------------------------------------------------------------
    def key_bytes_read(self, end: int) -> tuple[int, int]:
        """The summaries scored (every cluster's mean and variance; with two levels every node's, then the kept
        nodes' clusters'), then the keys of the best clusters and of the unclustered tail (for a sequence whose
        segments start at position 0)."""
        if end < self.config.cluster_min_context or self.keep_clusters * self.cluster_size >= end:
            return super().key_bytes_read(end)
        row = self.store.shape_prefix[1] * self.store.head_dim * self.store.element_size
        clustered = end // self.segment * self.segment
        clusters = clustered // self.cluster_size
        keys = self.keep_clusters * self.cluster_size + end - clustered
        if self._two_levels(clusters):  # a mean and a variance per node, then per cluster of the kept nodes
            return row * 2 * (clusters // self.fanout), row * (2 * self.keep_nodes * self.fanout + keys)
        return row * 2 * clusters, row * keys

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
        shared_segments = 0 if self.shared is None else min(self.shared["means"].shape[2] // per_segment,
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
        # the sources of clusters, in order: the shared prefix's (batch 1), then each sequence's own
        sources = []  # (parts, clusters used, (b, clusters used) bool: built and selectable)
        if shared_clusters:
            sources.append((self.shared, shared_clusters, torch.ones(batch, shared_clusters, dtype=torch.bool)))
        if own_clusters:  # every allocated cluster (a contiguous product); those not built yet do not exist
            own = {name: part[rows] for name, part in self.parts.items()}
            built = torch.arange(self._capacity)[None, :] < (usable_segments * per_segment)[:, None]
            sources.append((own, self._capacity, built))
        if self._two_levels(own_clusters + shared_clusters):
            summaries, exists, members = self._clusters_of_best_nodes(scaled, sources)
        else:
            summaries = [(parts["means"][:, :, :used], parts["variances"][:, :, :used]) for parts, used, _ in sources]
            exists = _joined([built for _, _, built in sources], dim=-1)[:, None, :].expand(batch, kv_heads, -1)
            members = _joined([parts["members"][:, :, :used].expand(batch, -1, -1, -1)
                               for parts, used, _ in sources], dim=2)
        score = self._combined_scores(scaled, summaries, exists)  # (b, H_kv, clusters)
        top = torch.topk(score, min(self.keep_clusters, score.shape[-1]), dim=-1, sorted=False).indices
        chosen = torch.gather(exists, 2, top)  # (b, H_kv, m)
        picked = torch.gather(members, 2, top[..., None].expand(-1, -1, -1, self.cluster_size))
        picked = torch.where(chosen[..., None], picked, 0).flatten(2).long()
        picked_usable = chosen.repeat_interleave(self.cluster_size, dim=-1) & torch.gather(
            candidates.mask[:, None, :].expand(batch, kv_heads, end), 2, picked)
        positions = torch.cat([picked, tail.expand(batch, kv_heads, -1)], dim=-1)
        usable = torch.cat([picked_usable, tail_usable[:, None, :].expand(batch, kv_heads, -1)], dim=-1)
        return positions, usable

    def _clusters_of_best_nodes(self, scaled: torch.Tensor, sources: list) -> tuple[list, torch.Tensor, torch.Tensor]:
        """Two levels: score every node of `sources`, keep the `keep_nodes` best per (sequence, KV head), and return
        their clusters' `[(means, variances)]` `(b, H_kv, keep_nodes × fanout, D)` in the store's dtype, whether each
        exists `(b, H_kv, keep_nodes × fanout)` bool, and their members `(b, H_kv, keep_nodes × fanout,
        cluster_size)` int32 positions."""
        batch, kv_heads = scaled.shape[:2]
        fanout = self.fanout
        nodes = [(parts["node_means"][:, :, : used // fanout], parts["node_variances"][:, :, : used // fanout])
                 for parts, used, _ in sources]
        node_exists = _joined([built[:, ::fanout] for _, _, built in sources], dim=-1)
        node_exists = node_exists[:, None, :].expand(batch, kv_heads, -1)
        node_score = self._combined_scores(scaled, nodes, node_exists)
        top = torch.topk(node_score, self.keep_nodes, dim=-1, sorted=False).indices  # (b, H_kv, n)
        exists = torch.gather(node_exists, 2, top).repeat_interleave(fanout, dim=-1)
        # each kept node's clusters, as rows of `fanout` consecutive clusters from the source that holds it
        gathered = {}
        first = 0
        for parts, used, _ in sources:
            total = parts["means"].shape[2] // fanout  # nodes per (sequence, KV head) in this source's tensors
            local = (top - first).clamp(0, used // fanout - 1)
            row = torch.arange(batch)[:, None, None] if parts["means"].shape[0] > 1 else 0
            flat = ((row * kv_heads + torch.arange(kv_heads)[None, :, None]) * total + local).flatten()
            inside = ((top >= first) & (top < first + used // fanout))[..., None, None]
            for name in ("means", "variances", "members"):
                part = parts[name]
                rows_of_nodes = part.reshape(-1, fanout * part.shape[-1]).index_select(0, flat)
                rows_of_nodes = rows_of_nodes.view(batch, kv_heads, -1, fanout, part.shape[-1])
                previous = gathered.get(name)
                gathered[name] = rows_of_nodes if previous is None else torch.where(inside, rows_of_nodes, previous)
            first += used // fanout
        flat_clusters = {name: value.flatten(2, 3) for name, value in gathered.items()}
        return [(flat_clusters["means"], flat_clusters["variances"])], exists, flat_clusters["members"]

    def _combined_scores(self, scaled: torch.Tensor, summaries: list, exists: torch.Tensor) -> torch.Tensor:
        """`(b, H_kv, n)` float32 score of each summarised group (cluster or node) for the queries `scaled` `(b,
        H_kv, G, D)`: each query head's `_cluster_scores`, normalised by their log-sum-exp over the groups (their
        sizes are equal), combined over the GQA group by log-sum-exp; -inf where `exists` `(b, H_kv, n)` is False.

        `summaries` lists `(means, variances)` pairs concatenated along the groups; a pair of batch 1 is shared by
        every sequence (one product for all their queries)."""
        batch, kv_heads, group, dim = scaled.shape
        scores = []
        for means, variances in summaries:
            if means.shape[0] == 1 and batch > 1:  # every sequence's queries against shared summaries: one product
                stacked = scaled.transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
                score = self._cluster_scores(stacked, means, variances)[0]
                scores.append(score.view(kv_heads, batch, group, -1).transpose(0, 1))
            else:
                scores.append(self._cluster_scores(scaled, means, variances))
        score = _joined(scores, dim=-1).masked_fill_(~exists[:, :, None, :], float("-inf"))  # a fresh tensor
        score -= torch.logsumexp(score, dim=-1, keepdim=True)  # each head's share
        return torch.logsumexp(score, dim=2)

    @staticmethod
    def _cluster_scores(scaled: torch.Tensor, means: torch.Tensor, variances: torch.Tensor) -> torch.Tensor:
        """`(b, H_kv, G, clusters)` float32 `s·(q·μ) + SPREAD·sqrt(s²·(q²·v))` for scaled queries `(b, H_kv, G, D)`
        against `(b, H_kv, clusters, D)` means and variances."""
        means, variances = means.contiguous(), variances.contiguous()  # (a batched product of a view copies it)
        center = products(scaled.to(means.dtype), means)
        spread = products(scaled.square().to(means.dtype), variances)
        return spread.float().clamp_(min=0).sqrt_().mul_(SPREAD).add_(center)

    @property
    def host_bytes(self) -> int:
        parts = [*(self.shared or {}).values(), *(self.parts or {}).values()]
        return sum(part.nbytes for part in parts)

    def free(self) -> None:
        self.parts = self.shared = None
        self._capacity = 0
        self.segments = torch.zeros_like(self.segments)


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """`torch.cat(parts, dim)`, or the one part itself (a view, no copy: the decode step's sources are usually one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
