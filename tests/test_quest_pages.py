"""Host-side selection against brute-force references on random inputs."""

import pytest
import torch

from dual_cache.eval.selection import torch_exact
from dual_cache.host.memory import live_host_bytes
from dual_cache.host.store import HostKVStore
from dual_cache.selection import quest_pages


def _inputs(seed, batch=2, q_heads=6, kv_heads=2, n=97, dim=16):
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, q_heads, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, n, dim, generator=gen)
    candidates = torch.rand(batch, n, generator=gen) > 0.2
    return query, keys, candidates


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_group_mass_matches_per_head_softmax(seed):
    query, keys, candidates = _inputs(seed)
    mass = torch_exact.group_attention_mass(query, keys, candidates, scaling=0.25)
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
    indices, valid = torch_exact.select(query, keys, candidates, budget, scaling=0.25)
    mass = torch_exact.group_attention_mass(query, keys, candidates, scaling=0.25)
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


def test_host_store_appends_gathers_crops_and_grows_in_chunks():
    gen = torch.Generator().manual_seed(8)
    before = live_host_bytes()
    store = HostKVStore(2, 3, 4, torch.float32, chunk_tokens=3)
    pieces = [torch.randn(2, 3, n, 4, generator=gen) for n in (5, 1, 4)]
    first_chunk = None
    for piece in pieces:
        store.append(piece, -piece)
        first_chunk = first_chunk if first_chunk is not None else store.key_chunks(3)[0].data_ptr()
    full = torch.cat(pieces, dim=2)
    assert store.length == 10 and store.capacity == 11  # chunks of 5 (the first append), then 3 and 3 tokens
    assert store.key_chunks(3)[0].data_ptr() == first_chunk  # growing never moved stored tokens
    torch.testing.assert_close(torch.cat(store.key_chunks(10), dim=2), full)
    keys, values = store.read(2, 9)
    torch.testing.assert_close(keys, full[:, :, 2:9])
    torch.testing.assert_close(values, -full[:, :, 2:9])
    index = torch.randint(0, 10, (2, 3, 5), generator=gen)
    keys, values = store.gather(index)
    torch.testing.assert_close(keys, torch.gather(full, 2, index[..., None].expand(2, 3, 5, 4)))
    torch.testing.assert_close(values, -keys)
    assert live_host_bytes() - before == store.nbytes == 2 * (2 * 3 * 11 * 4) * 4  # K,V × elements × fp32 bytes
    assert store.chunk_spans() == [(0, 5), (5, 3), (8, 3)]
    store.crop(2)
    assert store.length == 8
    with pytest.raises(ValueError, match="Cannot crop"):
        store.crop(9)
    store.free()
    assert live_host_bytes() == before and store.nbytes == 0
    store.free()  # idempotent


def test_host_store_refuses_allocation_through_on_alloc():
    def refuse(nbytes):
        raise MemoryError(f"no room for {nbytes}")

    before = live_host_bytes()
    store = HostKVStore(1, 1, 4, torch.float32, chunk_tokens=4, on_alloc=refuse)
    with pytest.raises(MemoryError, match="no room for 128"):
        store.append(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    assert live_host_bytes() == before and store.length == 0


@pytest.mark.parametrize("seed", [4, 5])
def test_chunked_keys_give_the_same_mass(seed):
    query, keys, candidates = _inputs(seed)
    whole = torch_exact.group_attention_mass(query, keys, candidates, scaling=0.25)
    chunked = torch_exact.group_attention_mass(query, list(keys.split(40, dim=2)), candidates, scaling=0.25)
    torch.testing.assert_close(chunked, whole)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [8, 9])
def test_products_in_either_operand_order_equal_the_float_product(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, 301, 64, generator=gen).to(dtype)
    rows = torch.randn(3, 2, 5, 64, generator=gen).to(dtype)
    product = torch_exact.products(rows, keys)
    assert product.shape == (3, 2, 5, 301) and product.dtype == dtype
    reference = rows.double() @ keys.double().transpose(-1, -2)
    # the output's rounding plus the accumulation's, bounded by the product of magnitudes
    step = 2 * torch.finfo(dtype).eps * (rows.double().abs() @ keys.double().abs().transpose(-1, -2)).amax().item()
    torch.testing.assert_close(product.double(), reference, rtol=0, atol=step)


@pytest.mark.parametrize("seed", [10, 11])
def test_bf16_mass_over_a_shared_chunk_equals_the_per_sequence_mass(seed):
    query, keys, candidates = _inputs(seed, batch=3)
    shared = keys[:1].to(torch.bfloat16)
    together = torch_exact.group_attention_mass(query, shared, candidates, scaling=0.25)
    apart = torch.cat([torch_exact.group_attention_mass(query[b : b + 1], shared, candidates[b : b + 1], scaling=0.25)
                       for b in range(3)])
    torch.testing.assert_close(together, apart)


@pytest.mark.parametrize("seed", [6, 7])
def test_quest_pages_match_brute_force_bound(seed):
    query, keys, candidates = _inputs(seed, n=50)
    page, budget = 8, 24
    page_min, page_max = quest_pages.page_bounds(keys, page)
    indices, valid = quest_pages.select_pages(query, page_min, page_max, candidates, budget, page)
    groups = query.shape[1] // keys.shape[1]
    for b in range(query.shape[0]):
        for h in range(keys.shape[1]):
            scores = []
            for p in range(-(-50 // page)):
                block = keys[b, h, p * page : (p + 1) * page]
                if not candidates[b, p * page : (p + 1) * page].any():
                    continue
                bound = sum(
                    torch.maximum(query[b, g] * block.amin(0), query[b, g] * block.amax(0)).sum()
                    for g in range(h * groups, (h + 1) * groups)
                )
                scores.append((float(bound), p))
            best = sorted(p for _, p in sorted(scores, reverse=True)[: budget // page])
            expected = {p * page + i for p in best for i in range(page) if p * page + i < 50}
            expected = {i for i in expected if candidates[b, i]}
            assert set(indices[b, h][valid[b, h]].tolist()) == expected


def test_host_store_reserves_the_prompt_then_grows_geometrically():
    from dual_cache.host.growth import planned_capacity

    before = live_host_bytes()
    store = HostKVStore(1, 2, 4, torch.float32, chunk_tokens=1000)
    store.reserve(57)
    store.append(torch.randn(1, 2, 57, 4), torch.randn(1, 2, 57, 4))
    for _ in range(200):  # decode steps, one token each
        token = torch.randn(1, 2, 1, 4)
        store.append(token, token)
    assert store.chunk_spans() == [(0, 57), (57, 28), (85, 42), (127, 63), (190, 95)]
    assert store.capacity == planned_capacity(57, 257, 1000) == 285
    store.reserve(100)  # already there: no-op
    assert store.capacity == 285
    assert planned_capacity(0, 10_000, 1000) >= 10_000
    store.free()
    assert live_host_bytes() == before


def test_a_shared_prefix_store_grows_by_what_each_sequence_adds():
    """Growth after `share` follows each sequence's own positions, not the shared prefix (which is kept once)."""
    from dual_cache.host.growth import planned_capacity

    store = HostKVStore(1, 2, 4, torch.float32, chunk_tokens=4096)
    store.reserve(8000)
    store.append(torch.randn(1, 2, 8000, 4), torch.randn(1, 2, 8000, 4))
    prefix_bytes = store.nbytes
    store.share(8)
    store.reserve(8000 + 20)  # the questions' prompt tokens
    store.append(torch.randn(8, 2, 20, 4), torch.randn(8, 2, 20, 4))
    for _ in range(24):  # decode steps
        token = torch.randn(8, 2, 1, 4)
        store.append(token, token)
    assert store.capacity - 8000 == planned_capacity(20, 44, 4096)
    assert store.nbytes <= 1.3 * prefix_bytes
    store.free()
