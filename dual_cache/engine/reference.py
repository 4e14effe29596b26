"""Pure-torch reference of the native selection engine: the same selections, defined step by step.

It is what `selection_engine.cpp` is tested against on random inputs and what runs when the engine cannot be built.
Per (sequence, KV head), with the GQA group's `G` query heads `q_h` (float32, after RoPE) and softmax scale `s`:

1. **Scan** (only with an index, `codes.py`; `scan_scores`): the codes of `quads` channel quads are read, chosen per
   KV head by `Σ_h |q_h| ×` the channel's step summed over every 16th group; the other channels enter at each
   group's midpoint `min + 1.5 · step`. Per group `g` and head `h`, int8 weights `w8 = round(q_h ⊙ step_g / σ)`
   over the chosen channels give an approximate logit `l_h = fma(A, w8 · c, C)` (the dot product an exact integer;
   `A`, `C` per group and head). A position's score is the largest over the group of `l_h − LZ_h`, with `LZ_h` head
   `h`'s log-sum-exp over the sampled groups: its approximate log-probability. The `shortlist` best-scoring
   candidates, plus every candidate the index does not cover (before the first group, after the last complete
   one), go to the exact stage.
2. **Exact stage**: float32 logits `s · (q_h · k)` of those positions, each head's softmax over them, summed over
   the group (the attention mass of `dual_cache.eval.selection.torch_exact.group_attention_mass`, normalised over
   the rescored positions); the `budget` best.

Ties (equal scores) go to the lower position, in both stages. The engine computes the scan's integers and
float32 steps identically; its `exp` is a polynomial and its exact logits sum products in another order, so `LZ_h`
and the masses differ from these in the last bits (a selection can differ only where two scores agree to that
precision).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .codes import GROUP, padded_dim, unpack


LANES = 16


def lane_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a · b` over the last axis as the engine sums it: 16 float32 lanes, lane `j` accumulating channels `j, j + 16,
    …` with fused multiply-adds (emulated in float64), then a pairwise tree (lanes `j` and `j + 8`, …).

    Args:
        a, b: `(..., n)` float32, broadcastable; `n` is zero-padded to a multiple of 16.
    """
    n = a.shape[-1]
    pad = -n % LANES
    a = torch.nn.functional.pad(a, (0, pad)).double()
    b = torch.nn.functional.pad(b, (0, pad)).double()
    acc = torch.zeros(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]) + (LANES,), dtype=torch.float32)
    for start in range(0, n + pad, LANES):
        acc = (a[..., start:start + LANES] * b[..., start:start + LANES] + acc.double()).float()
    width = LANES // 2
    while width:
        acc = acc[..., :width] + acc[..., width:2 * width]
        width //= 2
    return acc[..., 0]


def top_by_score(score: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the `count` largest entries of each row of `score` `(..., n)`, ties to the lower index, ascending."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :count]
    return torch.sort(order, dim=-1).values


def group_mass(query: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """`(H_kv, n)` float32 attention mass of each key: each query head's softmax over the `n` keys, summed over the
    group. query: `(H_kv, G, D)` float32; keys: `(H_kv, n, D)`."""
    logits = torch.matmul(query, keys.float().transpose(-1, -2)) * torch.tensor(scaling, dtype=torch.float32)
    return torch.softmax(logits, dim=-1).sum(dim=1)


def exact_stage(query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, budget: int,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The `budget` positions of highest group mass among `positions`.

    Args:
        query: `(H_kv, G, D)` float32; keys: `(H_kv, n, D)` the keys at `positions` `(H_kv, n)` int64 ascending.

    Returns:
        `(indices, valid)`: `(H_kv, budget)` int64 ascending (0 in invalid slots) and bool.
    """
    kv_heads, n = positions.shape
    indices = torch.zeros(kv_heads, budget, dtype=torch.long)
    valid = torch.zeros(kv_heads, budget, dtype=torch.bool)
    if n == 0:
        return indices, valid
    mass = group_mass(query, keys, scaling)
    take = min(budget, n)
    chosen = top_by_score(mass, take)
    indices[:, :take] = torch.gather(positions, 1, chosen)
    valid[:, :take] = True
    return indices, valid


SAMPLE_EVERY = 16  # groups 0, 16, 32, ... estimate each head's softmax normalizer


def lane_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of a float32 vector `(n,)` as the engine's `sum_lanes` adds it: lane `j` accumulates `x[j], x[j + 16],
    …` in order (zero-padded), then the pairwise tree of `lane_dot`."""
    x = torch.nn.functional.pad(x, (0, -x.shape[0] % LANES)).view(-1, LANES)
    acc = torch.zeros(LANES, dtype=torch.float32)
    for row in x:
        acc = acc + row
    width = LANES // 2
    while width:
        acc = acc[:width] + acc[width:2 * width]
        width //= 2
    return acc[0]


def choose_quads(query: torch.Tensor, steps: torch.Tensor, quads: int) -> torch.Tensor:
    """The channel quads the scan reads for one KV head.

    Args:
        query: `(G, D_q)` float32 (zero-padded); steps: `(n_groups, D_q)` float32 per-group steps; quads: how many.

    Returns:
        `(quads,)` int64 ascending: the quads of largest `Σ_{c ∈ quad} (Σ_h |q_hc|) · (Σ_{sampled g} step_gc)`
        (sampled groups: every `SAMPLE_EVERY`-th; sums in order), ties to the lower quad.
    """
    total = torch.zeros(steps.shape[1], dtype=torch.float32)
    for row in steps[::SAMPLE_EVERY]:
        total = total + row
    weight = torch.zeros(query.shape[1], dtype=torch.float32)
    for row in query:
        weight = weight + row.abs()
    b = weight * total
    importance = ((b[0::4] + b[1::4]) + b[2::4]) + b[3::4]
    chosen = torch.sort(importance, descending=True, stable=True).indices[:quads]
    return torch.sort(chosen).values


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 `a · b + c` with one rounding (emulated in float64, as `lane_dot`)."""
    return (a.double() * b.double() + c.double()).float()


def scan_scores(query: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, scaling: float, quads: int,
                usable: torch.Tensor) -> torch.Tensor:
    """The scan's score of every indexed token of one KV head (`selection_engine.cpp`, "2-bit index scan").

    Per group `g` and query head `h`, over the chosen quads' channels `S` (`choose_quads`): `w = q_h ⊙ step_g[S]`,
    `σ = max|w| / 127`, `w8 = round(w · (1 / σ))` (int8; 0 when σ = 0), `A = s · σ`,
    `C = s · (q_h · mid_g − (1.5 σ) · Σ w8)` with `mid = min + 1.5 · step` and the dot summed as `lane_dot`; the
    approximate logit of token `t` is `l = fma(A, Σ_S w8 · code_t, C)` (the sum an exact integer). `LZ_h`: the
    log-sum-exp of head `h`'s `l` over the usable tokens of every `SAMPLE_EVERY`-th group (0 when there is none);
    the score is `max_h fma(A, Σ_S w8 · code_t, C − LZ_h)`, `-inf` where not usable.

    Args:
        query: `(G, D)` float32; packed: `(n_groups, 16 · D_q)` uint8; params: `(n_groups, 2, D_q)` bfloat16
            (`codes.quantize`); scaling: the softmax scale `s`; quads: channel quads read; usable: `(n_groups · 64,)`
            bool.

    Returns:
        `(n_groups · GROUP,)` float32.
    """
    group, dim = query.shape
    n_groups = packed.shape[0]
    dim_q = padded_dim(dim)
    q = torch.nn.functional.pad(query, (0, dim_q - dim))  # (G, Dq)
    low, step = params[:, 0].float(), params[:, 1].float()  # (n, Dq)
    chosen = choose_quads(q, step, quads)
    channels = (chosen[:, None] * 4 + torch.arange(4)).flatten()
    codes = unpack(packed).long()[:, :, channels]  # (n, 64, 4R)
    mid = low + torch.tensor(1.5) * step
    dmid = lane_dot(q[None], mid[:, None])  # (n, G)
    w = q[None, :, channels] * step[:, None, channels]  # (n, G, 4R)
    sigma = w.abs().amax(dim=-1) / 127  # (n, G)
    inverse = 1 / torch.where(sigma > 0, sigma, torch.ones(()))
    w8 = torch.where(sigma[..., None] > 0, torch.round(w * inverse[..., None]), torch.zeros(())).long()
    dots = torch.einsum("ntc,ngc->ngt", codes, w8)  # (n, G, 64) exact integers
    scale = torch.tensor(scaling, dtype=torch.float32)
    a = scale * sigma
    c = scale * (dmid - (torch.tensor(1.5) * sigma) * w8.sum(-1).float())
    keep = usable.view(n_groups, 1, GROUP)
    ninf = torch.tensor(float("-inf"))
    sampled = torch.where(keep, fma(a[..., None], dots.float(), c[..., None]), ninf)[::SAMPLE_EVERY]  # (ns, G, 64)
    offset = torch.zeros(group, dtype=torch.float32)
    for h in range(group):
        values = sampled[:, h].flatten()
        peak = values.max()
        if peak > float("-inf"):
            total = lane_sum(torch.exp(values - peak))
            offset[h] = peak + torch.log(total.double()).float()
    score = fma(a[..., None], dots.float(), (c - offset)[..., None]).amax(dim=1)  # (n, 64)
    return torch.where(keep[:, 0], score, ninf).flatten()


def gather(chunks: Sequence[torch.Tensor], indices: torch.Tensor, out: torch.Tensor) -> None:
    """`out[b, h, i] = row indices[b, h, i]` of the chunks (keys or values) laid end to end, as the engine's gather.

    Args:
        chunks: `(b or 1, H_kv, n_i, D)` each (a chunk of batch 1 serves every sequence); indices: `(b, H_kv, k)`
            int64 positions; out: `(b, H_kv, k, D)`, written in place.
    """
    batch = indices.shape[0]
    rows = torch.cat([chunk.expand(batch, -1, -1, -1) for chunk in chunks], dim=2)
    out.copy_(torch.gather(rows, 2, indices[..., None].expand(-1, -1, -1, rows.shape[-1])))


def select(query: torch.Tensor, mask: torch.Tensor, keys: Sequence[torch.Tensor], budget: int, scaling: float,
           index: tuple | None = None, shortlist: int = 0, quads: int | None = None,
           carried: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `dual_cache.engine.select` (same arguments and results; see there).

    `carried`: `(pool, rows)`, the store's `engine.CarriedPool` (updated in place) and the store row of each query
    row; or None. Before any selection, per (query row, KV head) `t` with pool row `a` (`plan_pools`): `t` rescores
    its pool when `counts[a] > 0`, `due[a] > 0`, `fresh_from[a] <= end` and (unless `cosine` is None) the cosine of
    its GQA group's query to `query[a]` (float64) is at least `cosine`; then `due[a]` counts down. Otherwise it
    scans: `due[a]` becomes `interval - 1` (`(phase + KV head) % interval` when `counts[a]` was 0), `fresh_from[a]`
    the end and `query[a]` its query. A pooled task's candidates are its pool's first `counts[a]` positions below
    `fresh_from[a]` that are candidates, then every candidate from `fresh_from[a]` on; a scanning task writes the
    `P` of highest mass among the positions its exact stage rescored (`top_by_score`, ascending) into its pool.
    """
    batch, q_heads, dim = query.shape
    end = mask.shape[1]
    kv_heads = keys[0].shape[1]
    group = q_heads // kv_heads
    quads = padded_dim(dim) // 4 if quads is None else quads
    indices = torch.zeros(batch, kv_heads, budget, dtype=torch.long)
    valid = torch.zeros(batch, kv_heads, budget, dtype=torch.bool)
    plans = None if carried is None else plan_pools(query, end, carried[0], carried[1])
    for b in range(batch):
        rows = torch.cat([chunk[b if chunk.shape[0] > 1 else 0] for chunk in keys], dim=1)[:, :end]  # (H, end, D)
        q = query[b].float().view(kv_heads, group, dim)
        candidates = mask[b].nonzero().flatten()
        groups = 0
        if index is not None:
            packed, params, group_first, n_groups = index
            first, groups = int(group_first[b]), int(n_groups[b])
        if groups > 0:
            covered = torch.arange(first, first + groups * GROUP)
            usable = mask[b, covered]
            picked = []
            for h in range(kv_heads):
                lines = packed[b, h, :groups].reshape(groups, -1)  # (groups, 16 · D_q), codes.py's group layout
                score = scan_scores(q[h], lines, params[b, h, :groups], scaling, quads, usable)
                picked.append(covered[usable][top_by_score(score[usable], min(shortlist, int(usable.sum())))])
            picked = torch.stack(picked)  # (H, m)
            before = candidates[candidates < first].expand(kv_heads, -1)
            after = candidates[candidates >= first + groups * GROUP].expand(kv_heads, -1)
            positions = torch.cat([before, picked, after], dim=1)
        else:
            positions = candidates.expand(kv_heads, -1)
        if carried is None:
            gathered = torch.gather(rows, 1, positions[..., None].expand(-1, -1, dim))
            indices[b], valid[b] = exact_stage(q, gathered, positions, budget, scaling)
            continue
        for h in range(kv_heads):
            indices[b, h], valid[b, h] = _carried_task(q[h:h + 1], rows[h:h + 1], candidates, positions[h:h + 1],
                                                       budget, scaling, carried, plans[b][h], b, h)
    return indices, valid


def plan_pools(query: torch.Tensor, end: int, pool, rows: Sequence[int]) -> list[list[bool]]:
    """Whether each (query row, KV head) rescores its pool this call, and the schedule's update (`select`'s
    `carried`). query: `(b, H_q, D)` float32."""
    kv_heads = pool.positions.shape[1]
    grouped = query.reshape(query.shape[0], kv_heads, -1)
    plans = []
    for b, row in enumerate(rows):
        plans.append([])
        for h in range(kv_heads):
            q, last = grouped[b, h].double(), pool.query[row, h].double()
            pooled = bool(pool.counts[row, h] > 0 and pool.due[row, h] > 0 and pool.fresh_from[row, h] <= end)
            if pooled and pool.cosine is not None:
                qq, ll = float((q * q).sum()), float((last * last).sum())
                pooled = qq > 0 and ll > 0 and float((q * last).sum()) / (qq * ll) ** 0.5 >= pool.cosine
            if pooled:
                pool.due[row, h] -= 1
                pool.tally[row, h, 1] += 1
            else:
                first = int(pool.counts[row, h]) == 0
                pool.due[row, h] = (pool.phase + h) % pool.interval if first else pool.interval - 1
                pool.fresh_from[row, h] = end
                pool.query[row, h] = grouped[b, h]
                pool.tally[row, h, 0] += 1
            plans[b].append(pooled)
    return plans


def _carried_task(query, rows, candidates, scanned, budget, scaling, carried, pooled, b, h):
    """One (query row `b`, KV head `h`) of `select` with carried pools: its `(budget,)` indices and valid flags."""
    pool, store_rows = carried
    row = store_rows[b]
    slots = pool.positions[row, h]
    if pooled:
        fresh = max(int(pool.fresh_from[row, h]), 0)
        kept = slots[:int(pool.counts[row, h])]
        selectable = torch.zeros(rows.shape[1], dtype=torch.bool)
        selectable[candidates] = True
        kept = kept[kept < min(fresh, rows.shape[1])]
        kept = kept[selectable[kept]]
        positions = torch.cat([kept, candidates[candidates >= fresh]])[None]
    else:
        positions = scanned
    gathered = torch.gather(rows, 1, positions[..., None].expand(-1, -1, rows.shape[-1]))
    indices, valid = exact_stage(query, gathered, positions, budget, scaling)
    if not pooled:
        take = min(slots.shape[0], positions.shape[1])
        if take:
            slots[:take] = positions[0, top_by_score(group_mass(query, gathered, scaling)[0], take)]
        pool.counts[row, h] = take
    return indices[0], valid[0]
