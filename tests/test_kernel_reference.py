"""The torch sparse decode attention reference against dense attention written out by hand."""

import pytest
import torch

from dual_cache.kernels import sparse_decode_attention_reference


@pytest.mark.parametrize("seed, q_heads, kv_heads, q_len", [(1, 8, 2, 2), (2, 4, 4, 1), (3, 6, 1, 2)])
def test_matches_explicit_softmax(seed, q_heads, kv_heads, q_len):
    gen = torch.Generator().manual_seed(seed)
    batch, slots, dim = 2, 13, 8
    query = torch.randn(batch, q_heads, q_len, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, slots, dim, generator=gen)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen)
    allowed = torch.rand(batch, kv_heads, q_len, slots, generator=gen) > 0.3
    allowed[..., 0] = True
    out = sparse_decode_attention_reference(query, keys, values, allowed, scaling=0.3)
    groups = q_heads // kv_heads
    for h in range(q_heads):
        logits = query[:, h] @ keys[:, h // groups].transpose(-1, -2) * 0.3
        logits = logits.masked_fill(~allowed[:, h // groups], float("-inf"))
        expected = torch.softmax(logits, -1) @ values[:, h // groups]
        torch.testing.assert_close(out[:, h], expected, atol=1e-5, rtol=1e-5)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="Shapes do not match"):
        sparse_decode_attention_reference(
            torch.randn(1, 3, 1, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4),
            torch.ones(1, 2, 1, 5, dtype=torch.bool), 1.0,
        )
