"""Host-side selection against brute-force references on random inputs."""

import pytest
import torch

from dual_cache import retrieval
from dual_cache.host_store import HostKVStore


def _inputs(seed, batch=2, q_heads=6, kv_heads=2, n=97, dim=16):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, n, dim, generator=gen)
    candidates = torch.rand(batch, n, generator=gen) > 0.2
    return query, keys, candidates


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_group_mass_matches_per_head_softmax(seed):
    query, keys, candidates = _inputs(seed)
    mass = retrieval.group_attention_mass(query, keys, candidates, scaling=0.25)
    groups = query.shape[1] // keys.shape[1]
    for b in range(query.shape[0]):
        for h in range(query.shape[1]):
            logits = (keys[b, h // groups] @ query[b, h]) * 0.25
            logits[~candidates[b]] = float("-inf")
            probs = torch.softmax(logits, -1)
            if h % groups == 0:
                expected = probs.clone()
            else:
                expected += probs
            if h % groups == groups - 1:
                torch.testing.assert_close(mass[b, h // groups], expected)


@pytest.mark.parametrize("seed", [4, 5])
@pytest.mark.parametrize("budget", [1, 10, 96, 200])
def test_topk_selects_the_highest_mass_candidates(seed, budget):
    query, keys, candidates = _inputs(seed)
    indices, valid = retrieval.select(query, keys, candidates, budget, scaling=0.25)
    mass = retrieval.group_attention_mass(query, keys, candidates, scaling=0.25)
    assert indices.shape == valid.shape == (2, 2, budget)
    for b in range(2):
        for h in range(2):
            chosen = indices[b, h][valid[b, h]]
            assert torch.all(chosen[1:] > chosen[:-1]), "sorted, no duplicates"
            assert candidates[b, chosen].all()
            n_cand = int(candidates[b].sum())
            assert len(chosen) == min(budget, n_cand)
            expected = torch.topk(mass[b, h], min(budget, n_cand)).values.sum()
            torch.testing.assert_close(mass[b, h, chosen].sum(), expected)


@pytest.mark.parametrize("seed", [6, 7])
def test_block_selection_takes_whole_blocks_of_highest_mass(seed):
    query, keys, candidates = _inputs(seed, n=100)
    block = 8
    indices, valid = retrieval.select(query, keys, candidates, 32, scaling=0.25, block_size=block)
    mass = retrieval.group_attention_mass(query, keys, candidates, scaling=0.25)
    for b in range(2):
        for h in range(2):
            blocks = sorted(set((indices[b, h] // block).tolist()))
            assert len(blocks) == 4
            padded = torch.nn.functional.pad(mass[b, h], (0, 4))
            block_mass = padded.view(-1, block).sum(-1)
            torch.testing.assert_close(block_mass[blocks].sum(), torch.topk(block_mass, 4).values.sum())
            assert not valid[b, h][indices[b, h] >= 100].any()


def test_host_store_appends_gathers_crops_and_grows():
    gen = torch.Generator().manual_seed(8)
    store = HostKVStore(2, 3, 4, torch.float32, capacity=5)
    chunks = [torch.randn(2, 3, n, 4, generator=gen) for n in (3, 4, 1)]
    for chunk in chunks:
        store.append(chunk, -chunk)
    full = torch.cat(chunks, dim=2)
    assert store.length == 8 and store.capacity >= 8
    torch.testing.assert_close(store.keys[:, :, :8], full)
    index = torch.randint(0, 8, (2, 3, 5), generator=gen)
    keys, values = store.gather(index)
    torch.testing.assert_close(keys, torch.gather(full, 2, index[..., None].expand(2, 3, 5, 4)))
    torch.testing.assert_close(values, -keys)
    store.crop(2)
    assert store.length == 6
    with pytest.raises(ValueError, match="Cannot crop"):
        store.crop(7)
