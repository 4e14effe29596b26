"""The torch sparse decode attention reference against attention written out by hand, per query head."""

import pytest
import torch

from dual_cache.kernels import KVSegment, sparse_decode_attention_reference


def _segments(gen, batch, kv_heads, dim, lengths, max_pos):
    segments = []
    for length in lengths:
        segments.append(KVSegment(
            torch.randn(batch, kv_heads, length, dim, generator=gen),
            torch.randn(batch, kv_heads, length, dim, generator=gen),
            torch.randint(0, max_pos, (batch, kv_heads, length), generator=gen),
            torch.rand(batch, kv_heads, length, generator=gen) > 0.3,
        ))
    return segments


@pytest.mark.parametrize("seed, q_heads, kv_heads, q_len, softcap", [
    (1, 8, 2, 2, None), (2, 4, 4, 1, None), (3, 6, 1, 2, None), (4, 8, 2, 2, 0.7),
])
def test_matches_explicit_softmax(seed, q_heads, kv_heads, q_len, softcap):
    gen = torch.Generator().manual_seed(seed)
    batch, dim, max_pos = 2, 8, 40
    query = torch.randn(batch, q_heads, q_len, dim, generator=gen)
    segments = _segments(gen, batch, kv_heads, dim, [3, 7, 5], max_pos)
    qpos = torch.tensor([[max_pos - q_len + i for i in range(q_len)], [max_pos // 2 + i for i in range(q_len)]])
    out = sparse_decode_attention_reference(query, segments, qpos, scaling=0.3, softcap=softcap)
    keys = torch.cat([s.keys for s in segments], 2)
    values = torch.cat([s.values for s in segments], 2)
    positions = torch.cat([s.positions for s in segments], 2)
    valid = torch.cat([s.valid for s in segments], 2)
    groups = q_heads // kv_heads
    for b in range(batch):
        for h in range(q_heads):
            kv = h // groups
            for i in range(q_len):
                ok = valid[b, kv] & (positions[b, kv] <= qpos[b, i])
                logits = (keys[b, kv] @ query[b, h, i]) * 0.3
                if softcap is not None:  # Gemma 2's logit soft-capping
                    logits = softcap * torch.tanh(logits / softcap)
                probs = torch.softmax(logits.masked_fill(~ok, float("-inf")), -1).nan_to_num(0.0)
                torch.testing.assert_close(out[b, h, i], probs @ values[b, kv], atol=1e-5, rtol=1e-5)


def test_broadcast_positions_and_valid():
    gen = torch.Generator().manual_seed(7)
    batch, kv_heads, dim, length = 3, 2, 4, 6
    keys = torch.randn(batch, kv_heads, length, dim, generator=gen)
    values = torch.randn(batch, kv_heads, length, dim, generator=gen)
    positions = torch.arange(length)
    valid = torch.rand(batch, 1, length, generator=gen) > 0.2
    query = torch.randn(batch, 4, 2, dim, generator=gen)
    qpos = torch.tensor([length - 2, length - 1])
    full = KVSegment(keys, values, positions.expand(batch, kv_heads, length), valid.expand(batch, kv_heads, length))
    short = KVSegment(keys, values, positions[None, None], valid)
    torch.testing.assert_close(
        sparse_decode_attention_reference(query, [short], qpos, 0.5),
        sparse_decode_attention_reference(query, [full], qpos, 0.5),
    )


def test_bad_shapes_raise():
    seg = KVSegment(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), torch.arange(5), torch.ones(5, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sparse_decode_attention_reference(torch.randn(1, 3, 1, 4), [seg], torch.tensor([4]), 1.0)
    with pytest.raises(ValueError, match="query_positions"):
        sparse_decode_attention_reference(torch.randn(1, 4, 1, 4), [seg], torch.tensor([[1, 2, 3]]), 1.0)
