"""Two-stage `"shortlist"` selection: approximate scores over a few key channels, exact top-k among the shortlist.

References: the keys themselves (channel-major copy), `retrieval.select` (every position shortlisted), and a
per-(sequence, KV head) loop of the SparQ-style approximation followed by the exact criterion."""

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig, retrieval
from dual_cache.host_store import HostKVStore, live_host_bytes
from dual_cache.selectors import Candidates
from dual_cache.selectors.shortlist import ShortlistSelector
from tests.conftest import record_selections, six_layer_llama


def _store(seed: int, batch: int, kv_heads: int, n: int, dim: int, dtype=torch.float32, chunk: int = 40):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, n, dim, generator=g).to(dtype)
    store = HostKVStore(batch, kv_heads, dim, dtype, chunk_tokens=chunk)
    for lo in range(0, n, 37):  # uneven appends across chunk edges
        store.append(keys[:, :, lo : lo + 37], -keys[:, :, lo : lo + 37])
    return store, keys, g


def _candidates(starts: torch.Tensor, hi: int, n_sink: int = 2) -> torch.Tensor:
    return torch.arange(hi)[None, :] >= starts[:, None] + n_sink


def _selector(store: HostKVStore, budget: int, channels: int, keep: int) -> ShortlistSelector:
    """A shortlist selector keeping exactly `keep` positions (`keep` need not be a multiple of the budget)."""
    selector = ShortlistSelector(DualDecoderConfig(selector="shortlist", shortlist_channels=channels), budget,
                                 store, "cpu")
    selector.keep = keep
    return selector


def select_shortlisted(query, store, candidates, hi, budget, channels, keep, scaling, first_sequence=0):
    """The shortlist selector's choice for `query` over the rows `first_sequence, …` of `store`."""
    starts = torch.zeros(candidates.shape[0], dtype=torch.long)
    return _selector(store, budget, channels, keep).select(
        query, Candidates(candidates[:, :hi], starts, first_sequence), scaling)


@pytest.mark.parametrize("seed", [21, 22])
def test_channel_products_follow_appends_crops_and_count_their_bytes(seed):
    baseline = live_host_bytes()
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(-8, 8, (3, 2, 150, 8), generator=g).float()  # small integers: products are exact
    store = HostKVStore(3, 2, 8, torch.float32, chunk_tokens=40)
    for lo in range(0, 150, 37):
        store.append(keys[:, :, lo : lo + 37], keys[:, :, lo : lo + 37])
    selector = _selector(store, 4, channels=3, keep=8)
    channels = torch.randint(0, 8, (3, 2, 3), generator=g)
    left = torch.randint(-4, 4, (3, 2, 5, 3), generator=g).float()

    def expected(k, hi):
        return left @ torch.gather(k[:, :, :hi], 3, channels[:, :, None, :].expand(3, 2, hi, 3)).transpose(-1, -2)

    starts = torch.zeros(3, dtype=torch.long)
    for hi in (5, 61, 150):  # lazily extended
        selector.extend(hi, starts)
        assert torch.equal(selector.channel_products(left, channels, hi), expected(keys, hi))
    assert selector.host_bytes == store.nbytes // 2  # the channel-major copy: one more copy of the keys
    store.crop(30)
    selector.truncate(store.length)
    fresh = torch.randint(-8, 8, (3, 2, 30, 8), generator=g).float()
    store.append(fresh, fresh)  # overwrites positions 120..149: the copy must follow
    keys[:, :, 120:] = fresh
    selector.extend(150, starts)
    assert torch.equal(selector.channel_products(left, channels, 150), expected(keys, 150))
    selector.free(), store.free()
    assert live_host_bytes() == baseline


@pytest.mark.parametrize("seed", [23, 24, 25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_position_shortlisted_equals_exact_selection(seed, dtype):
    store, _, g = _store(seed, batch=3, kv_heads=2, n=260, dim=16, dtype=dtype)
    starts = torch.tensor([0, 37, 120])
    query = torch.randn(3, 6, 16, generator=g)
    for hi, budget in ((250, 24), (130, 64), (30, 8)):
        candidates = _candidates(starts, hi)
        exact = retrieval.select(query, store.key_chunks(hi), candidates, budget, 0.25)
        # keep = hi - 2: both stages run, and every candidate is kept (each row has >= 2 non-candidates, score -inf)
        got = select_shortlisted(query, store, candidates, hi, budget, channels=2, keep=hi - 2, scaling=0.25)
        for b in range(3):
            for h in range(2):
                assert torch.equal(exact[0][b, h][exact[1][b, h]], got[0][b, h][got[1][b, h]])
        assert torch.all(got[0][..., 1:] >= got[0][..., :-1])  # ascending
        shortcut = select_shortlisted(query, store, candidates, hi, budget, channels=2, keep=hi, scaling=0.25)
        assert all(torch.equal(a, b) for a, b in zip(shortcut, exact))


def _reference(query, keys, candidates, hi, budget, channels, keep, scaling):
    """Loop reference: per (b, h), channels by |q| summed over the group, the group's mean tempered partial query
    scores every candidate, the `keep` best positions, then exact softmax mass over those; returns the positions."""
    batch, kv_heads = keys.shape[:2]
    group = query.shape[1] // kv_heads
    chosen = {}
    for b in range(batch):
        for h in range(kv_heads):
            q = query[b, h * group : (h + 1) * group]  # (G, D)
            k = keys[b, h, :hi]  # (hi, D)
            picked = torch.topk(q.abs().sum(0), channels).indices
            mean = sum(q[g, picked] * (q[g].abs().sum() / q[g, picked].abs().sum()).sqrt() for g in range(group)) / group
            score = k[:, picked] @ mean
            score[~candidates[b, :hi]] = float("-inf")
            order = sorted(range(hi), key=lambda p: -float(score[p]))[:keep]
            positions = [p for p in order if candidates[b, p]]
            if not positions:
                chosen[b, h] = set()
                continue
            mass = torch.softmax((q @ k[positions].T) * scaling, dim=-1).sum(0)
            top = torch.topk(mass, min(budget, len(positions))).indices
            chosen[b, h] = {positions[i] for i in top.tolist()}
    return chosen


@pytest.mark.parametrize("seed", [26, 27, 28])
def test_partial_shortlist_matches_loop_reference(seed):
    store, keys, g = _store(seed, batch=2, kv_heads=3, n=300, dim=16)
    starts = torch.tensor([5, 64])
    query = torch.randn(2, 6, 16, generator=g)
    for hi, budget, channels, keep in ((290, 16, 4, 64), (291, 40, 2, 80), (200, 8, 16, 20)):
        candidates = _candidates(starts, hi)
        indices, valid = select_shortlisted(query, store, candidates, hi, budget, channels, keep, 0.25)
        expected = _reference(query, keys, candidates, hi, budget, channels, keep, 0.25)
        for (b, h), positions in expected.items():
            assert set(indices[b, h][valid[b, h]].tolist()) == positions


@pytest.mark.parametrize("seed", [29, 30])
def test_one_sequence_of_the_store_selects_as_in_the_whole_batch(seed):
    """`first_sequence`: a repair scores one sequence of the store alone, with the batch's result for that row."""
    store, keys, g = _store(seed, batch=3, kv_heads=2, n=260, dim=16)
    starts = torch.tensor([0, 40, 7])
    query = torch.randn(3, 4, 16, generator=g)
    for hi, keep in ((250, 48), (60, 80)):  # a partial shortlist, and every position shortlisted (exact shortcut)
        candidates = _candidates(starts, hi)
        batch_indices, batch_valid = select_shortlisted(query, store, candidates, hi, 12, 4, keep, 0.25)
        for row in range(3):
            one = slice(row, row + 1)
            indices, valid = select_shortlisted(query[one], store, candidates[one], hi, 12, 4, keep, 0.25, row)
            assert torch.equal(valid, batch_valid[one]) and torch.equal(indices[valid], batch_indices[one][valid])
    positions = torch.tensor([[[5, 9]], [[0, 259]]]).expand(2, 2, 2)  # sequences 1 and 2 of the store
    expected = torch.stack([keys[1][:, [5, 9]], keys[2][:, [0, 259]]])
    assert torch.equal(store.gather_keys(positions, 1), expected)
    with pytest.raises(ValueError, match="outside this store's batch"):
        store.gather_keys(torch.zeros(2, 2, 1, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="outside this store's batch"):
        _selector(store, 4, 4, 8).channel_products(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 4, dtype=torch.long),
                                                    10, 3)
    for keep in (8, 500):  # a partial shortlist and the exact shortcut both check the rows
        for bad in (-1, 3, 5):
            with pytest.raises(ValueError, match="outside this store's batch"):
                select_shortlisted(query[:1], store, _candidates(starts[:1], 60), 60, 4, 2, keep, 0.25, bad)


def test_generate_shortlist_pipeline_full_budget_repair_and_exact_limit():
    model = six_layer_llama(seed=30)
    ids = torch.randint(3, 90, (2, 260), generator=torch.Generator().manual_seed(31))
    kwargs = dict(max_new_tokens=12, do_sample=False)
    dense = model.generate(ids, **kwargs)
    full = model.generate(ids, cache_implementation="dual", cache_config={
        "budget": 4096, "window": 8, "selector": "shortlist"}, **kwargs)
    assert torch.equal(dense, full)
    base = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 20}
    runs = {}
    for name, options in (
        ("sync", {"selector": "shortlist", "shortlist_factor": 2, "retrieval_threads": 0}),
        ("pipelined", {"selector": "shortlist", "shortlist_factor": 2, "retrieval_threads": 1}),
        ("everything", {"selector": "shortlist", "shortlist_factor": 100}),  # keeps ≥ 1,200 ≥ every position
        ("exact", {"selector": "exact"}),
    ):
        cache = DualDecoderCache(model.config, **base, **options)
        recorded = record_selections(cache, at="release")
        runs[name] = (model.generate(ids, cache=cache, **kwargs), recorded, cache.stats())
    for a, b in (("sync", "pipelined"), ("everything", "exact")):
        assert torch.equal(runs[a][0], runs[b][0])
        assert len(runs[a][1]) == len(runs[b][1]) == 11 * 6
        for (layer_a, idx_a, ok_a, _), (layer_b, idx_b, ok_b, _) in zip(runs[a][1], runs[b][1]):
            assert layer_a == layer_b and torch.equal(idx_a[ok_a], idx_b[ok_b])
    assert runs["sync"][2]["host_bytes"] == runs["exact"][2]["host_bytes"] * 3 // 2  # channel-major keys counted
    # miss repair also goes through the shortlist (random weights: the speculated token misses often)
    assert runs["everything"][2]["repairs"] == runs["exact"][2]["repairs"] > 0


def test_selection_recall_tool_records_every_layer_and_scores_the_exact_limit_as_one():
    from dual_cache.eval.selection_recall import layer_recalls, record_prefill

    model = six_layer_llama(seed=32)
    before = model.config._attn_implementation
    ids = torch.randint(3, 90, (1, 300), generator=torch.Generator().manual_seed(33))
    layers = record_prefill(model, ids, queries=2, chunk=128)  # chunked: the causal mask must reach every chunk
    assert model.config._attn_implementation == before
    assert sorted(layers) == list(range(6))
    queries, keys, scaling = layers[3]
    assert queries.shape == (1, 4, 2, 16) and keys.shape == (1, 2, 300, 16)
    configs = [("shortlist", {"shortlist_channels": 2, "shortlist_factor": 100}),
               ("shortlist", {"shortlist_channels": 2, "shortlist_factor": 1})]
    recalls = layer_recalls(queries, keys, scaling, budget=16, configs=configs, n_sink=4, window=8)
    assert torch.allclose(recalls[0]["recall"], torch.ones(4))  # every position shortlisted: the exact selection
    assert torch.all(recalls[1]["recall"] <= 1 + 1e-6) and torch.all(recalls[1]["recall"] > 0)
