"""Exact selection in pure torch: each candidate key's attention mass summed over its GQA group, and the token-level
top-k of it (docs/design.md §2, step 3). The eval tools' reference: recall is measured against it
(`selection_recall`, `miss_candidates`) and `bench_retrieval` times it as `torch-exact` beside the native engine,
whose exact selector computes the same top-k. Pure torch on host tensors.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...selection.quest_pages import pad_selection

Keys = torch.Tensor | Sequence[torch.Tensor]


def products(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`rows @ keysᵀ` in the keys' dtype: `(..., m, D)` × `(..., n, D)` → `(..., m, n)`, possibly a transposed view.

    For bfloat16 keys it is computed as `(keys @ rowsᵀ)ᵀ`: with a few query rows against many keys, the CPU's
    bfloat16 matrix product runs faster with the key matrix as the left operand (the same products, rounded to
    bfloat16 alike; `results/bench/matmul-order-*.md` timed both orders). Other dtypes keep `rows @ keysᵀ`, the
    faster order for them."""
    if keys.dtype == torch.bfloat16:
        return torch.matmul(keys, rows.transpose(-1, -2)).transpose(-1, -2)
    return torch.matmul(rows, keys.transpose(-1, -2))


def query_key_logits(query: torch.Tensor, keys: Keys) -> torch.Tensor:
    """`(B, H_kv, G, n)` float32 query·key products, keys given whole or as chunks along the position axis.

    Each chunk's product is written into its slice of one float32 tensor (`torch.cat` of bf16 parts followed by
    `.float()` is several times slower on CPU). A chunk of batch 1 with several queries holds keys
    the sequences share (`HostKVStore.share`): all their queries are multiplied in one product. A chunk that is a
    prefix view of a larger store chunk (its batch stride is not that of a contiguous tensor) is multiplied one
    `(sequence, KV head)` matrix at a time: a batched product of such a view copies the whole view first on CPU."""
    chunks = [keys] if isinstance(keys, torch.Tensor) else list(keys)
    batch, q_heads, dim = query.shape
    kv_heads = chunks[0].shape[1]
    group = q_heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group, dim).to(chunks[0].dtype)
    out = torch.empty(batch, kv_heads, group, sum(c.shape[2] for c in chunks), dtype=torch.float32)
    if len(chunks) == 1 and chunks[0].shape[0] == 1 and batch > 1 and chunks[0].is_contiguous():
        # one shared chunk: the product's `(H_kv, B, G, n)` layout, viewed as `(B, H_kv, G, n)` without a copy
        stacked = grouped.transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
        product = products(stacked, chunks[0])[0].view(kv_heads, batch, group, -1).transpose(0, 1)
        if product.dtype == torch.float32 and product.stride(-1) == 1:
            return product  # a view of the product: no copy
        return out.copy_(product)
    start = 0
    for chunk in chunks:
        end = start + chunk.shape[2]
        if chunk.shape[0] == 1 and batch > 1:  # keys every sequence shares: one product for all their queries
            stacked = grouped.transpose(0, 1).reshape(1, kv_heads, batch * group, dim)
            if chunk.is_contiguous():
                product = products(stacked, chunk)[0]
            else:
                product = torch.stack([products(stacked[0, h], chunk[0, h]) for h in range(kv_heads)])
            out[..., start:end].copy_(product.view(kv_heads, batch, group, -1).transpose(0, 1))
        elif chunk.is_contiguous():
            out[..., start:end].copy_(products(grouped, chunk))
        else:
            for b in range(batch):
                for h in range(kv_heads):
                    out[b, h, :, start:end].copy_(products(grouped[b, h], chunk[b, h]))
        start = end
    return out


def group_attention_mass(query: torch.Tensor, keys: Keys, candidates: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention probability of each candidate key, summed over the query heads of each GQA group.

    Args:
        query: `(B, H_q, D)` float queries (after RoPE) of the token whose attention is predicted.
        keys: `(B, H_kv, n, D)` host keys of positions `[0, n)`, or a list of such tensors that concatenate along
            the position axis to it (the host store's chunks; a chunk of batch 1 is shared by every sequence);
            `H_q` must be a multiple of `H_kv`.
        candidates: `(B, n)` bool, True where a position may be selected.
        scaling: softmax scale (usually `D ** -0.5`).

    Returns:
        `(B, H_kv, n)` float32 mass in `[0, G]` (G = H_q / H_kv); 0 at non-candidates.
    """
    # softmax in place on the one float32 logits tensor: at long contexts it is the largest host allocation of a
    # step, and a fresh one per elementwise op costs more than the arithmetic
    logits = query_key_logits(query, keys).mul_(scaling)  # (B, H_kv, G, n)
    bias = torch.zeros(candidates.shape, dtype=logits.dtype).masked_fill_(~candidates, float("-inf"))
    logits += bias[:, None, None, :]  # cheaper than masked_fill
    peak = logits.amax(dim=-1, keepdim=True).nan_to_num_(0.0, neginf=0.0)  # rows without candidates: 0
    probs = logits.sub_(peak).exp_()
    probs.mul_(probs.sum(dim=-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny).reciprocal_())
    return probs.sum(dim=2)


def select_topk(mass: torch.Tensor, candidates: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level top-k of `mass` (B, H_kv, n), returned sorted by position.

    Returns:
        `indices` (B, H_kv, budget) int64 positions in ascending order and `valid` (B, H_kv, budget) bool; slots
        beyond the number of candidates are marked invalid (their index is an arbitrary in-range position).
    """
    batch, kv_heads, n = mass.shape
    top = torch.topk(mass, min(budget, n), dim=-1, sorted=False).indices
    indices, _ = torch.sort(top, dim=-1)
    valid = torch.gather(candidates[:, None, :].expand(batch, kv_heads, n), 2, indices)
    return pad_selection(indices, valid, budget)


def select(
    query: torch.Tensor, keys: Keys, candidates: torch.Tensor, budget: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the `budget` entries per (sequence, KV head) that `query` attends to most: token-level top-k of
    `group_attention_mass`, in pure torch (the exact selection without the native engine).

    Args:
        query: `(B, H_q, D)`; keys: `(B, H_kv, n, D)` or its chunks; candidates: `(B, n)` bool (see
            `group_attention_mass`); budget: entries per KV head (tokens); scaling: softmax scale.

    Returns:
        `(indices, valid)`, both `(B, H_kv, budget)`: int64 positions sorted ascending, and bool validity.
    """
    return select_topk(group_attention_mass(query, keys, candidates, scaling), candidates, budget)
