"""The prefix cache: prefilled prompt prefixes, found again by block hashes, so a prompt that starts like an earlier
one copies that prefix's stored K/V instead of prefilling it again.

Each prompt is cut into blocks of `block` tokens. A block's hash chains the hash of the block before it with the
block's own tokens, so equal hashes at block `i` mean equal prompts up to the end of block `i` (up to hash
collisions, which `PrefixCache.start` rules out by comparing the tokens). This is the chained per-block hash of
vLLM's automatic prefix caching (docs: design/prefix_caching). Unlike vLLM's, a hit saves the prefill, not the
memory: each request continues its own copy of the prefix (`regroup`), since rows of the running batch are
regrouped into new caches as they come and go.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..cache.cache import DualDecoderCache
from ..cache.regroup import regroup


def block_hashes(ids: torch.Tensor, block: int) -> list[int]:
    """Chained hashes of the whole blocks of `ids`.

    Args:
        ids: `(P,)` int64 token ids; block: tokens per block, >= 1.

    Returns:
        `P // block` ints; entry `i` depends on tokens `[0, (i + 1) · block)` only.

    Raises:
        ValueError: if `block < 1` or `ids` is not 1-D.
    """
    if block < 1 or ids.dim() != 1:
        raise ValueError(f"block_hashes needs block >= 1 and (P,) ids, got block={block}, ids {tuple(ids.shape)}.")
    hashes, parent = [], None
    for start in range(0, ids.numel() - block + 1, block):
        parent = hash((parent, tuple(ids[start:start + block].tolist())))
        hashes.append(parent)
    return hashes


@dataclass
class CachedPrefix:
    """One prefilled prefix: its token ids `(L,)` (L a multiple of the block) and a one-sequence cache holding them
    (between requests: host memory only)."""

    ids: torch.Tensor
    cache: DualDecoderCache

    @property
    def host_bytes(self) -> int:
        return int(self.cache.stats()["host_bytes"])


class PrefixCache:
    """Prefilled prefixes by the chained hash of their last whole block, least recently used first out.

    A request without a stored cache either finds the longest cached prefix its prompt starts with (leaving at least
    one token of its own) and starts from a copy of it, or is prefilled up to its last whole block first, where its
    prefix is copied into the cache (`add`), then prefilled to its end.

    Args:
        block: tokens per block (0: off; every method is then a no-op). max_entries: prefixes kept at most.
    """

    def __init__(self, block: int, max_entries: int = 16) -> None:
        self.block, self.max_entries = block, max_entries
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def host_bytes(self) -> int:
        return sum(entry.host_bytes for entry in self._entries.values())

    def start(self, row, others: list[torch.Tensor]) -> int:
        """Give `row` (a `rows.Row` without a cache) a copy of the longest cached prefix of its prompt, and mark where
        its prefill pauses to add a longer one (`row.prefix_end`): the most whole blocks its prompt shares with a
        queued prompt or a cached prefix, else all its whole blocks (a later turn of the same conversation, a
        repeated prompt). Returns the prompt tokens the copy holds.

        Args:
            row: the admitted request.
            others: `(P_i,)` token ids of the requests still queued.
        """
        if not self.block:
            return 0
        prompt = row.handle.prompt
        whole = (prompt.numel() - 1) // self.block  # blocks that leave at least one token to prefill
        hashes = block_hashes(prompt[:whole * self.block], self.block)
        if not hashes:
            return 0
        hit = 0
        for count in range(len(hashes), 0, -1):
            entry = self._entries.get(hashes[count - 1])
            if entry is not None and torch.equal(entry.ids, prompt[:count * self.block]):
                self._entries.move_to_end(hashes[count - 1])
                row.cache = regroup([(entry.cache, 0)])
                hit = count * self.block
                break
        shared = [self._common(prompt, hashes, other) for other in others]
        shared += [self._common(prompt, hashes, entry.ids) for entry in self._entries.values()]
        end = max(shared, default=0) or len(hashes) * self.block
        if end > hit and block_hashes(prompt[:end], self.block)[-1] not in self._entries:
            row.prefix_end = end
        return hit

    def _common(self, prompt: torch.Tensor, hashes: list[int], other: torch.Tensor) -> int:
        """Tokens of the whole blocks `prompt` (whose block hashes are `hashes`) starts with, as `other` does."""
        count = 0
        for mine, theirs in zip(hashes, block_hashes(other[:len(hashes) * self.block], self.block)):
            if mine != theirs:
                break
            count += 1
        while count and not torch.equal(prompt[:count * self.block], other[:count * self.block]):
            count -= 1  # a hash collision
        return count * self.block

    def add(self, ids: torch.Tensor, cache: DualDecoderCache) -> None:
        """Keep a copy of `cache` (one sequence between requests, holding exactly `ids`, a whole number of
        blocks) as a cached prefix; the least recently used past `max_entries` are closed."""
        key = block_hashes(ids, self.block)[-1]
        if key in self._entries:
            return
        self._entries[key] = CachedPrefix(ids.clone(), regroup([(cache, 0)]))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)[1].cache.close()

    def make_room(self, nbytes: int) -> int:
        """Close cached prefixes, least recently used first, until `nbytes` host bytes are freed (or none is
        left); returns the bytes freed."""
        freed = 0
        while freed < nbytes and self._entries:
            entry = self._entries.popitem(last=False)[1]
            freed += entry.host_bytes
            entry.cache.close()
        return freed

    def close(self) -> None:
        """Close every cached prefix."""
        while self._entries:
            self._entries.popitem(last=False)[1].cache.close()
