"""Selectors as classes (`dual_cache.selectors`) and the host index (`selector="clusters"`).

References: `retrieval.select` (exact top-k over every position) whenever the index's shortlist covers every
position; a rebuild from scratch for incremental extension; the whole batch for a subset of sequences."""

import importlib
import inspect

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig, retrieval
from dual_cache.host_store import HostKVStore, live_host_bytes
from dual_cache.selectors import SELECTORS, Candidates, Selector
from dual_cache.selectors.clusters import ClusterSelector, balanced_clusters
from tests.conftest import record_selections, six_layer_llama


def test_every_selector_is_a_class_in_its_own_file_and_the_default_is_registered():
    assert set(SELECTORS) == {"clusters", "exact", "block", "shortlist", "oracle", "quest"}
    assert DualDecoderConfig().selector in SELECTORS
    files = set()
    for name, cls in SELECTORS.items():
        assert issubclass(cls, Selector) and cls.name == name
        files.add(inspect.getsourcefile(cls))
        assert importlib.import_module(cls.__module__).__name__.endswith(f".{name}")
    assert len(files) == len(SELECTORS)
    assert {name for name, cls in SELECTORS.items() if not cls.prefetched} == {"oracle", "quest"}


def _store(keys: torch.Tensor, piece: int = 37, reserve: int = 0) -> HostKVStore:
    batch, kv_heads, n, dim = keys.shape
    store = HostKVStore(batch, kv_heads, dim, keys.dtype, chunk_tokens=64)
    store.reserve(reserve)
    for lo in range(0, n, piece):  # uneven appends across chunk edges
        store.append(keys[:, :, lo : lo + piece], -keys[:, :, lo : lo + piece])
    return store


def _clusters(store, budget=8, **options):
    config = DualDecoderConfig(selector="clusters", **{"cluster_size": 4, "cluster_segment": 32,
                                                       "cluster_min_context": 0, **options})
    return ClusterSelector(config, budget, store, "cpu")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_balanced_clusters_is_a_permutation_that_separates_distinct_groups(seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(8, 16, generator=g) * 10
    labels = torch.randperm(64, generator=g) % 8  # 8 well separated groups of 8 keys, shuffled
    keys = centers[labels] + 0.01 * torch.randn(64, 16, generator=g)
    order = balanced_clusters(keys[None], 8)[0]
    assert sorted(order.tolist()) == list(range(64))
    for cluster in order.view(8, 8):
        assert len(set(labels[cluster].tolist())) == 1  # each cluster holds one group
    with_batch = balanced_clusters(torch.stack([keys, keys.flip(0)]), 8)
    assert torch.equal(with_batch[0], order)  # groups are clustered independently


@pytest.mark.parametrize("seed", [4, 5, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_selects_exactly_the_exact_top_k_when_its_shortlist_covers_every_position(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, 200, 16, generator=g).to(dtype)
    store = _store(keys)
    starts = torch.tensor([0, 21, 60])
    query = torch.randn(3, 6, 16, generator=g)
    for hi, factor in ((150, 16), (110, 12), (190, 20)):
        mask = torch.arange(hi)[None, :] >= starts[:, None] + 2
        selector = _clusters(store, cluster_factor=factor)  # 8 × factor / 4 clusters: every complete one
        assert selector.keep_clusters * 4 < hi  # the two-stage path, not the exact shortcut
        got = selector.select(query, Candidates(mask, starts), 0.25)
        exact = retrieval.select(query, store.key_chunks(hi), mask, 8, 0.25)
        for b in range(3):
            for h in range(2):
                assert torch.equal(exact[0][b, h][exact[1][b, h]], got[0][b, h][got[1][b, h]])
        assert torch.all(got[0][..., 1:][got[1][..., 1:]] >= got[0][..., :-1][got[1][..., 1:]])  # ascending
        selector.free()


@pytest.mark.parametrize("seed", [7, 8])
def test_incremental_index_equals_a_rebuild_and_follows_crops(seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, 260, 8, generator=g)
    starts = torch.tensor([0, 45])
    query = torch.randn(2, 4, 8, generator=g)
    store = _store(keys, piece=260, reserve=300)
    grown = _clusters(store)
    for length in (1, 30, 31, 77, 150, 151, 260):  # token by token would be the same calls, only more of them
        grown.extend(length, starts)
    rebuilt = _clusters(store)
    rebuilt.extend(260, starts)
    assert torch.equal(grown.segments, rebuilt.segments) and grown.segments.tolist() == [8, 6]
    used = int(grown.segments.max()) * 8
    for name in ("means", "variances", "members"):
        for row in range(2):
            clusters = int(grown.segments[row]) * 8
            assert torch.equal(getattr(grown, name)[row, :, :clusters], getattr(rebuilt, name)[row, :, :clusters])
    assert used <= grown._capacity
    mask = torch.arange(250)[None, :] >= starts[:, None] + 2
    for selector in (grown, rebuilt):
        assert selector.host_bytes > 0
    a, b = (s.select(query, Candidates(mask, starts), 0.3) for s in (grown, rebuilt))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # a crop forgets the segments that reach past it; new keys there are clustered when committed again
    store.crop(100)
    grown.truncate(store.length)
    assert grown.segments.tolist() == [5, 3]
    fresh = torch.randn(2, 2, 100, 8, generator=g)
    store.append(fresh, -fresh)
    grown.extend(260, starts)
    keys[:, :, 160:] = fresh
    again = _clusters(_store(keys))
    again.extend(260, starts)
    for row in range(2):
        clusters = int(grown.segments[row]) * 8
        assert torch.equal(grown.members[row, :, :clusters], again.members[row, :, :clusters])
        assert torch.equal(grown.means[row, :, :clusters], again.means[row, :, :clusters])


@pytest.mark.parametrize("seed", [9, 10])
def test_one_sequence_selects_as_in_the_whole_batch_and_padding_never_moves_its_clusters(seed):
    g = torch.Generator().manual_seed(seed)
    alone = torch.randn(1, 2, 200, 8, generator=g)
    pad = 37
    padded = torch.cat([torch.randn(1, 2, pad, 8, generator=g), alone], dim=2)[:, :, :200]  # left-padded row
    other = torch.randn(1, 2, 200, 8, generator=g)
    keys = torch.cat([other, padded])
    starts = torch.tensor([0, pad])
    query = torch.randn(2, 4, 8, generator=g)
    store = _store(keys)
    selector = _clusters(store, budget=8)
    hi = 190
    mask = torch.arange(hi)[None, :] >= starts[:, None] + 2
    whole = selector.select(query, Candidates(mask, starts), 0.3)
    for row in range(2):
        one = selector.select(query[row : row + 1], Candidates(mask, starts).row(row), 0.3)
        assert torch.equal(one[1], whole[1][row : row + 1])
        assert torch.equal(one[0][one[1]], whole[0][row : row + 1][one[1]])
    # the padded row's selection equals that of the same tokens alone, shifted by the padding
    solo_store = _store(alone)
    solo = _clusters(solo_store, budget=8)
    solo_mask = torch.arange(hi - pad)[None, :] >= 2
    expected = solo.select(query[1:], Candidates(solo_mask, torch.tensor([0])), 0.3)
    assert torch.equal(expected[1], whole[1][1:])
    assert torch.equal(expected[0][expected[1]] + pad, whole[0][1:][expected[1]])


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cluster_size": 0}, "cluster_size"),
        ({"cluster_segment": 48, "cluster_size": 16}, "power of two"),
        ({"cluster_segment": 8, "cluster_size": 16}, "power of two"),
        ({"cluster_factor": 0}, "cluster_factor"),
        ({"cluster_size": 1.5}, "cluster_size"),
    ],
)
def test_bad_index_options_are_refused_before_any_work(options, message):
    with pytest.raises(ValueError, match=message):
        DualDecoderConfig(selector="clusters", **options)
    model = six_layer_llama(seed=11)
    before = live_host_bytes()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.randint(3, 90, (1, 40)), max_new_tokens=2, cache_implementation="dual",
                       cache_config={"selector": "clusters", **options})
    assert live_host_bytes() == before


def test_generate_with_the_index_full_budget_threads_and_host_bytes():
    model = six_layer_llama(seed=12)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(13))
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    index = {"selector": "clusters", "cluster_size": 4, "cluster_segment": 32, "cluster_factor": 2,
             "cluster_min_context": 0}
    dense = model.generate(ids, **kwargs)
    full = model.generate(ids, cache_implementation="dual", cache_config={**index, "budget": 4096, "window": 8},
                          **kwargs)
    assert torch.equal(dense, full)
    base = {**index, "budget": 12, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 20}
    runs = {}
    for threads in (0, 1, 3):
        cache = DualDecoderCache(model.config, **base, retrieval_threads=threads)
        recorded = record_selections(cache, at="release")
        runs[threads] = (model.generate(ids, cache=cache, **kwargs), recorded, cache.stats())
    for threads in (1, 3):
        assert torch.equal(runs[0][0], runs[threads][0])
        assert len(runs[0][1]) == len(runs[threads][1]) == 11 * 6
        for (layer_a, idx_a, ok_a, _), (layer_b, idx_b, ok_b, _) in zip(runs[0][1], runs[threads][1]):
            assert layer_a == layer_b and torch.equal(ok_a, ok_b) and torch.equal(idx_a[ok_a], idx_b[ok_b])
    stats = runs[0][2]
    exact = DualDecoderCache(model.config, **{**base, "selector": "exact"})
    model.generate(ids, cache=exact, **kwargs)
    index_bytes = stats["host_bytes"] - exact.stats()["host_bytes"]
    assert 0 < index_bytes <= 0.5 * exact.stats()["host_bytes"]  # the index: summaries + positions
    assert stats["repairs"] > 0  # miss repair selects through the index too (random weights miss often)
