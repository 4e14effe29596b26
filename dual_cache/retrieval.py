"""Host-side scoring and top-k selection of critical KV entries (docs/design.md §2, step 3).

Pure torch on host tensors; knows nothing of transformers, caches or devices.
"""

from __future__ import annotations

from typing import Sequence

import torch

Keys = torch.Tensor | Sequence[torch.Tensor]


def products(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`rows @ keysᵀ` in the keys' dtype: `(..., m, D)` × `(..., n, D)` → `(..., m, n)`, possibly a transposed view.

    For bfloat16 keys it is computed as `(keys @ rowsᵀ)ᵀ`: with a few query rows against many keys, the CPU's
    bfloat16 matrix product runs faster with the key matrix as the left operand (the same products, rounded to
    bfloat16 alike; `results/bench/matmul-order-*.md` timed both orders). Other dtypes keep `rows @ keysᵀ`, the faster order
    for them."""
    if keys.dtype == torch.bfloat16:
        return torch.matmul(keys, rows.transpose(-1, -2)).transpose(-1, -2)
    return torch.matmul(rows, keys.transpose(-1, -2))


def _logits(query: torch.Tensor, keys: Keys) -> torch.Tensor:
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
    logits = _logits(query, keys).mul_(scaling)  # (B, H_kv, G, n)
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


def pad_selection(indices: torch.Tensor, valid: torch.Tensor, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Widen `(B, H_kv, k)` `indices` / `valid` to `budget` slots with invalid entries at position 0."""
    short = budget - indices.shape[-1]
    if short <= 0:
        return indices, valid
    batch, kv_heads = indices.shape[:2]
    return (torch.cat([indices, indices.new_zeros(batch, kv_heads, short)], dim=-1),
            torch.cat([valid, valid.new_zeros(batch, kv_heads, short)], dim=-1))


def _top_blocks(
    block_score: torch.Tensor, candidates: torch.Tensor, budget: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token positions of the `budget // block_size` best blocks of `block_score` `(B, H_kv, n_blocks)`, block `j`
    covering `[j·block_size, (j+1)·block_size)`."""
    batch, kv_heads, n_blocks = block_score.shape
    n = candidates.shape[1]
    k_blocks = min(budget // block_size, n_blocks)
    top = torch.topk(block_score, k_blocks, dim=-1, sorted=False).indices
    blocks, _ = torch.sort(top, dim=-1)
    offsets = torch.arange(block_size, device=block_score.device)
    indices = (blocks[..., None] * block_size + offsets).flatten(2)
    in_range = indices < n
    indices = torch.where(in_range, indices, torch.zeros_like(indices))
    valid = in_range & torch.gather(candidates[:, None, :].expand(batch, kv_heads, n), 2, indices)
    return pad_selection(indices, valid, budget)


def page_bounds(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise minimum and maximum key of each page of `page_size` consecutive positions (Quest, §3.2).

    Args:
        keys: `(B, H_kv, n, D)`; the last page may be partial.

    Returns:
        `(page_min, page_max)`, each `(B, H_kv, ceil(n / page_size), D)` in `keys.dtype`.
    """
    batch, kv_heads, n, dim = keys.shape
    n_pages = -(-n // page_size)
    pad = n_pages * page_size - n
    if pad:  # repeat the last key: it changes neither bound
        keys = torch.cat([keys, keys[:, :, -1:].expand(batch, kv_heads, pad, dim)], dim=2)
    paged = keys.view(batch, kv_heads, n_pages, page_size, dim)
    return paged.amin(dim=3), paged.amax(dim=3)


def select_pages(
    query: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    candidates: torch.Tensor,
    budget: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quest-style page selection (Tang et al., 2024, "Quest", §3.2): rank pages by an upper bound of q·k.

    The bound of a page is `Σ_d max(q_d · min_d, q_d · max_d)`, summed over the query heads of each GQA group;
    the top `budget // page_size` pages among those holding a candidate are returned as token positions.

    Args:
        query: `(B, H_q, D)`; page_min, page_max: `(B, H_kv, P, D)` from `page_bounds` over positions `[0, n)`.
        candidates: `(B, n)` bool selectable positions; budget: tokens per KV head (multiple of page_size).

    Returns:
        `(indices, valid)` as `select_topk` (positions past `n` or outside the candidates are invalid).
    """
    batch, q_heads, dim = query.shape
    kv_heads, n_pages = page_min.shape[1], page_min.shape[2]
    n = candidates.shape[1]
    grouped = query.reshape(batch, kv_heads, q_heads // kv_heads, 1, dim).float()
    bound = torch.maximum(grouped * page_min[:, :, None].float(), grouped * page_max[:, :, None].float())
    score = bound.sum(-1).sum(2)  # (B, H_kv, P)
    padded = torch.nn.functional.pad(candidates, (0, n_pages * page_size - n))
    has_candidate = padded.view(batch, n_pages, page_size).any(-1)
    score = score.masked_fill(~has_candidate[:, None, :], float("-inf"))
    return _top_blocks(score, candidates, budget, page_size)


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
