"""Re-ranking on the device (docs/design.md §2, misses): the speculated token's query fetched `fetch_factor × budget`
candidate entries per KV head a step early; the real token's query picks the `budget` it attends to among them, on
the device, with no host round trip. Where the speculated token hit, the two queries agree and the pick is the
speculated top-`budget`; where it missed (and on a request's first step, whose entries the prompt's last query
chose), the real query still chooses from a wider set, so a miss never makes the step wait for the host.

The score is the attention mass of the GQA group over the fetched entries: each query head's softmax over the valid
fetched entries, summed over the heads of a KV head (the exact stage's criterion, `engine/reference.py`, normalised
over what the device holds). Plain torch on device tensors: no host synchronization (`torch.topk` and `scatter`).
"""

from __future__ import annotations

import torch


def rerank_valid(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, budget: int, scaling: float,
                 softcap: float | None = None) -> torch.Tensor:
    """Which fetched entries the real query attends to: the `budget` valid entries of most group mass.

    Args:
        query: `(B, H_q, D)` the real token's query at this layer (after RoPE; any float dtype).
        keys: `(B, H_kv, F, D)` the fetched candidates' keys (`H_q` a multiple of `H_kv`).
        valid: `(B, H_kv, F)` bool, the fetched slots that hold a candidate.
        budget: entries kept per (sequence, KV head); `budget >= F` keeps every valid entry.
        scaling: the layer's softmax scale. softcap: the model's attention logit soft-cap (Gemma 2), or None.

    Returns:
        `(B, H_kv, F)` bool on the keys' device: `valid` restricted to the chosen entries (at most `budget` per row;
        ties broken as `torch.topk` breaks them).
    """
    fetched = keys.shape[2]
    if budget >= fetched:
        return valid
    batch, kv_heads, _, dim = keys.shape
    grouped = query.reshape(batch, kv_heads, -1, dim).to(keys.dtype)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # (B, H_kv, G, F)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    mass = torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=2)  # (B, H_kv, F); a row without entries: 0
    mass = mass.masked_fill_(~valid, -1.0)  # invalid slots are never preferred to a valid one
    chosen = torch.topk(mass, budget, dim=-1).indices
    return torch.zeros_like(valid).scatter_(2, chosen, True) & valid
