"""How a host store's capacity grows: the size of each chunk it adds, and the capacity a request reaches (used by
`HostKVStore` when it grows and by host admission when it plans a request's bytes before allocating them).
"""

from __future__ import annotations

MIN_GROWTH = 16  # tokens: the smallest chunk added when the store grows (unless `chunk_tokens` is smaller)


def next_chunk_tokens(capacity: int, chunk_tokens: int) -> int:
    """Tokens of the chunk a store holding `capacity` tokens adds when it grows (with `chunk_tokens` the cap)."""
    return min(chunk_tokens, max(MIN_GROWTH, capacity // 2))


def planned_capacity(reserved: int, tokens: int, chunk_tokens: int) -> int:
    """Capacity (tokens) a store reaches when it reserves `reserved` tokens, then stores `tokens` tokens one
    decode step at a time (`HostKVStore.reserve`, then growth by `next_chunk_tokens`)."""
    capacity = reserved
    while capacity < tokens:
        capacity += next_chunk_tokens(capacity, chunk_tokens)
    return capacity
