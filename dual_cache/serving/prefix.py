"""Shared prefixes by block hashes: the longest run of whole token blocks that every prompt of a batch starts with.

Each prompt is cut into blocks of `block` tokens. A block's hash chains the hash of the block before it with the
block's own tokens, so equal hashes at block `i` mean equal prompts up to the end of block `i` (up to hash
collisions, which `shared_prefix_length` rules out by comparing the tokens). This is the chained per-block hash of
vLLM's automatic prefix caching (docs: design/prefix_caching). A batch whose prompts share such a prefix stores it
once on the host (`DualDecoderCache` continuing one stored sequence).
"""

from __future__ import annotations

from typing import Sequence

import torch


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


def shared_prefix_length(prompts: Sequence[torch.Tensor], block: int) -> int:
    """Tokens, a multiple of `block`, that every prompt starts with, keeping at least one token of each prompt
    after it (a request continuing the shared prefix has something of its own to prefill); 0 for fewer than two
    prompts or no shared whole block.

    Args:
        prompts: `(P_i,)` int64 token ids each; block: tokens per block, >= 1.

    Raises:
        ValueError: if `block < 1` or a prompt is not 1-D.
    """
    if len(prompts) < 2:
        return 0
    chains = [block_hashes(p, block) for p in prompts]
    blocks = 0
    for column in zip(*chains):
        if any(h != column[0] for h in column[1:]):
            break
        blocks += 1
    blocks = min(blocks, *((p.numel() - 1) // block for p in prompts))
    length = blocks * block
    first = prompts[0][:length]
    while length and not all(torch.equal(p[:length], first) for p in prompts[1:]):  # a hash collision
        length -= block
        first = first[:length]
    return length
