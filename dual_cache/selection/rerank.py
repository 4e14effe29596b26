"""Re-ranking on the device (docs/design.md §2, misses): the speculated token's query chose the entries a step early;
the real token's query picks the `budget` of most mass among what the device holds (its resident set), on the device,
with no host round trip — to attend to (`resident_attention="rerank"`) or to name what it attended (the next step's
`fetch_next` positions and the resident set's LRU order). Where the speculated token hit, the two queries agree and the
pick is the speculated top-`budget`; where it missed (and on a request's first step, whose entries the prompt's last
query chose), the real query still chooses from the wider set the device holds, so a miss never makes the step wait
for the host.

The score is the attention mass of the GQA group over the held entries: each query head's softmax over the valid
entries, summed over the heads of a KV head (the exact stage's criterion, `engine/reference.py`, normalised
over what the device holds). Plain torch on device tensors: no host synchronization (`torch.topk` and `scatter`).
"""

from __future__ import annotations

import torch


def top_entries(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, budget: int, scaling: float,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `budget` valid entries of most GQA-group mass of the real query, per (sequence, KV head).

    Args:
        query: `(B, H_q, D)` the real token's query at this layer (after RoPE; any float dtype).
        keys: `(B, H_kv, F, D)` the entries' keys (`H_q` a multiple of `H_kv`).
        valid: `(B, H_kv, F)` bool, the slots that hold an entry.
        budget: entries kept per (sequence, KV head), `1 <= budget`; more than `F` keeps `F`.
        scaling: the layer's softmax scale. softcap: the model's attention logit soft-cap (Gemma 2), or None.

    Returns:
        `(slots, chosen)`, both `(B, H_kv, min(budget, F))` on the keys' device: the slots of the entries of most
        mass (ties broken as `torch.topk` breaks them), and whether each is a valid entry (False where a row holds
        fewer valid entries than the budget).
    """
    batch, kv_heads, fetched, dim = keys.shape
    grouped = query.reshape(batch, kv_heads, -1, dim).to(keys.dtype)
    logits = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scaling  # (B, H_kv, G, F)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    mass = torch.softmax(logits, dim=-1).nan_to_num_(0.0).sum(dim=2)  # (B, H_kv, F); a row without entries: 0
    mass = mass.masked_fill_(~valid, -1.0)  # invalid slots are never preferred to a valid one
    slots = torch.topk(mass, min(budget, fetched), dim=-1).indices
    return slots, torch.gather(valid, 2, slots)


def rerank_valid(query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, budget: int, scaling: float,
                 softcap: float | None = None) -> torch.Tensor:
    """Which entries the real query attends to: `valid` restricted to its `budget` valid entries of most group mass
    (`top_entries`; arguments as there). Returns `(B, H_kv, F)` bool on the keys' device."""
    if budget >= keys.shape[2]:
        return valid
    slots, _ = top_entries(query, keys, valid, budget, scaling, softcap)
    return torch.zeros_like(valid).scatter_(2, slots, True) & valid
