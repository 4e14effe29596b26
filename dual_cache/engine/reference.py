"""Pure-torch reference of the native selection engine: the same selections, defined step by step.

It is what `selection_engine.cpp` is tested against on random inputs and what runs when the engine cannot be built.
Per (sequence, KV head), with the GQA group's `G` query heads `q_h` (float32, after RoPE) and softmax scale `s`:

1. **Scan** (only with an index, `codes.py`): for each indexed group `g` and head `h`, `w = q_h ⊙ step_g` (float32),
   `σ = max|w| / 127`, `w8 = round(w · (1 / σ))` (int8), `bias = q_h · min_g` (`lane_dot`); the
   approximate logit of a token with codes `c` is `s · (bias + σ · (w8 · c))`, the dot product an exact integer.
   A position's score is the largest over the group of its approximate logit minus that head's largest among the
   candidates. The `shortlist` best-scoring candidates, plus every candidate the index does not cover (before the
   first group, after the last complete one), go to the exact stage.
2. **Exact stage**: float32 logits `s · (q_h · k)` of those positions, each head's softmax over them, summed over
   the group (the attention mass of `retrieval.group_attention_mass`, normalised over the rescored positions); the
   `budget` best.

Ties (equal scores) go to the lower position, in both stages. The engine computes the scan's integers and
float32 steps identically; its exact logits sum products in another order and its `exp` is a polynomial, so its
masses differ from these in the last bits (a selection can differ only where two masses agree to that precision).
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
    logits = torch.matmul(query, keys.float().transpose(-1, -2)) * torch.tensor(scaling, dtype=torch.float32)
    mass = torch.softmax(logits, dim=-1).sum(dim=1)  # (H_kv, n)
    take = min(budget, n)
    chosen = top_by_score(mass, take)
    indices[:, :take] = torch.gather(positions, 1, chosen)
    valid[:, :take] = True
    return indices, valid


def scan_scores(query: torch.Tensor, packed: torch.Tensor, params: torch.Tensor, scaling: float) -> torch.Tensor:
    """Approximate scaled logits of every indexed token.

    Args:
        query: `(H_kv, G, D)` float32; packed: `(H_kv, n_groups, 16 · D_q)` uint8; params: `(H_kv, n_groups, 2, D_q)`
            bfloat16 (`codes.quantize`).

    Returns:
        `(H_kv, G, n_groups · GROUP)` float32.
    """
    kv_heads, group, dim = query.shape
    n_groups = packed.shape[1]
    dim_q = padded_dim(dim)
    q = torch.nn.functional.pad(query, (0, dim_q - dim))  # (H, G, Dq)
    codes = unpack(packed.reshape(-1, 16 * dim_q)).view(kv_heads, n_groups, GROUP, dim_q).double()
    low, step = params[:, :, 0].float(), params[:, :, 1].float()  # (H, n, Dq)
    w = q[:, None] * step[:, :, None]  # (H, n, G, Dq)
    sigma = w.abs().amax(dim=-1) / 127  # (H, n, G)
    inverse = 1 / torch.where(sigma > 0, sigma, torch.ones(()))
    w8 = torch.where(sigma[..., None] > 0, torch.round(w * inverse[..., None]), torch.zeros(()))
    dots = torch.matmul(codes, w8.double().transpose(-1, -2)).float()  # (H, n, 64, G), exact integers
    bias = lane_dot(q[:, None], low[:, :, None])  # (H, n, G)
    approx = bias[:, :, None, :] + sigma[:, :, None, :] * dots
    approx = torch.tensor(scaling, dtype=torch.float32) * approx
    return approx.permute(0, 3, 1, 2).reshape(kv_heads, group, n_groups * GROUP)


def select(query: torch.Tensor, mask: torch.Tensor, keys: Sequence[torch.Tensor], budget: int, scaling: float,
           index: tuple | None = None, shortlist: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `dual_cache.engine.select` (same arguments and results; see there)."""
    batch, q_heads, dim = query.shape
    end = mask.shape[1]
    kv_heads = keys[0].shape[1]
    group = q_heads // kv_heads
    indices = torch.zeros(batch, kv_heads, budget, dtype=torch.long)
    valid = torch.zeros(batch, kv_heads, budget, dtype=torch.bool)
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
            approx = scan_scores(q, packed[b, :, :groups], params[b, :, :groups], scaling)  # (H, G, covered)
            approx = approx[:, :, usable]
            score = (approx - approx.amax(dim=-1, keepdim=True)).amax(dim=1)  # (H, usable)
            picked = covered[usable][top_by_score(score, min(shortlist, score.shape[-1]))]  # (H, m)
            before = candidates[candidates < first].expand(kv_heads, -1)
            after = candidates[candidates >= first + groups * GROUP].expand(kv_heads, -1)
            positions = torch.cat([before, picked, after], dim=1)
        else:
            positions = candidates.expand(kv_heads, -1)
        gathered = torch.gather(rows, 1, positions[..., None].expand(-1, -1, dim))
        indices[b], valid[b] = exact_stage(q, gathered, positions, budget, scaling)
    return indices, valid
