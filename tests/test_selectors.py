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
    assert set(SELECTORS) == {"clusters", "exact", "lowbit", "block", "shortlist", "oracle", "quest"}
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


TWO_LEVELS = {"cluster_fanout": 2, "cluster_node_factor": 1}  # 4 of a sequence's 24 or 32 nodes at budget 8


@pytest.mark.parametrize("levels", [{}, TWO_LEVELS])
@pytest.mark.parametrize("seed", [7, 8])
def test_incremental_index_equals_a_rebuild_and_follows_crops(seed, levels):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, 260, 8, generator=g)
    starts = torch.tensor([0, 45])
    query = torch.randn(2, 4, 8, generator=g)
    store = _store(keys, piece=260, reserve=300)
    grown = _clusters(store, **levels)
    for length in (1, 30, 31, 77, 150, 151, 260):  # token by token would be the same calls, only more of them
        grown.extend(length, starts)
    rebuilt = _clusters(store, **levels)
    rebuilt.extend(260, starts)
    assert torch.equal(grown.segments, rebuilt.segments) and grown.segments.tolist() == [8, 6]
    used = int(grown.segments.max()) * 8
    for name in ("means", "variances", "members"):
        for row in range(2):
            clusters = int(grown.segments[row]) * 8
            assert torch.equal(grown.parts[name][row, :, :clusters], rebuilt.parts[name][row, :, :clusters])
    assert used <= grown._capacity
    # what the cache checks against its host-memory limit before allocating: the index for the store's capacity
    assert grown.host_bytes == 2 * ClusterSelector.host_bytes_for(grown.config, store.capacity, 2, 8, 4)
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
    again = _clusters(_store(keys), **levels)
    again.extend(260, starts)
    assert set(again.parts) == {"means", "variances", "members", *(("node_means", "node_variances") if levels else ())}
    for row in range(2):
        clusters = int(grown.segments[row]) * 8
        for name in again.parts:
            length = clusters // (2 if name.startswith("node") else 1)
            assert torch.equal(grown.parts[name][row, :, :length], again.parts[name][row, :, :length])


@pytest.mark.parametrize("levels", [{}, TWO_LEVELS])
@pytest.mark.parametrize("seed", [9, 10])
def test_one_sequence_selects_as_in_the_whole_batch_and_padding_never_moves_its_clusters(seed, levels):
    g = torch.Generator().manual_seed(seed)
    alone = torch.randn(1, 2, 200, 8, generator=g)
    pad = 37
    padded = torch.cat([torch.randn(1, 2, pad, 8, generator=g), alone], dim=2)[:, :, :200]  # left-padded row
    other = torch.randn(1, 2, 200, 8, generator=g)
    keys = torch.cat([other, padded])
    starts = torch.tensor([0, pad])
    query = torch.randn(2, 4, 8, generator=g)
    store = _store(keys)
    selector = _clusters(store, budget=8, **levels)
    hi = 190
    mask = torch.arange(hi)[None, :] >= starts[:, None] + 2
    whole = selector.select(query, Candidates(mask, starts), 0.3)
    for row in range(2):
        one = selector.select(query[row : row + 1], Candidates(mask, starts).row(row), 0.3)
        assert torch.equal(one[1], whole[1][row : row + 1])
        assert torch.equal(one[0][one[1]], whole[0][row : row + 1][one[1]])
    # the padded row's selection equals that of the same tokens alone, shifted by the padding
    solo_store = _store(alone)
    solo = _clusters(solo_store, budget=8, **levels)
    solo_mask = torch.arange(hi - pad)[None, :] >= 2
    expected = solo.select(query[1:], Candidates(solo_mask, torch.tensor([0])), 0.3)
    assert torch.equal(expected[1], whole[1][1:])
    assert torch.equal(expected[0][expected[1]] + pad, whole[0][1:][expected[1]])


def _two_level_reference(selector, query, mask, starts, scaling):
    """The two-level selection written out per (sequence, KV head) with loops, from the index's stored summaries."""
    config, fanout, size = selector.config, selector.fanout, selector.cluster_size
    batch, q_heads, dim = query.shape
    kv_heads = selector.store.shape_prefix[1]
    group, end = q_heads // kv_heads, mask.shape[1]
    keys = torch.cat(selector.store.key_chunks(end), dim=2).float()
    per_segment = config.cluster_segment // size
    chosen = []
    for b in range(batch):
        segments = min(int(selector.segments[b]), (end - int(starts[b])) // config.cluster_segment)
        tail = torch.arange(int(starts[b]) + segments * config.cluster_segment, end)
        for h in range(kv_heads):
            q = query[b, h * group : (h + 1) * group].float() * scaling  # (G, D)

            def score(means, variances):  # (n,) per-head shares combined over the group
                raw = q @ means.float().T + 2 * (q.square() @ variances.float().T).clamp(min=0).sqrt()
                return torch.logsumexp(raw - torch.logsumexp(raw, dim=-1, keepdim=True), dim=0)

            parts = {name: part[b, h] for name, part in selector.parts.items()}
            nodes = segments * per_segment // fanout
            node_score = score(parts["node_means"][:nodes], parts["node_variances"][:nodes])
            kept = torch.topk(node_score, selector.keep_nodes).indices
            clusters = (kept[:, None] * fanout + torch.arange(fanout)).flatten()
            cluster_score = score(parts["means"][clusters], parts["variances"][clusters])
            best = clusters[torch.topk(cluster_score, selector.keep_clusters).indices]
            shortlist = torch.cat([parts["members"][best].flatten().long(), tail])
            shortlist = shortlist[mask[b, shortlist]]
            logits = (q @ keys[b, h, shortlist].T).softmax(dim=-1).sum(dim=0)
            top = shortlist[torch.topk(logits, min(selector.budget, len(shortlist))).indices]
            chosen.append(set(top.tolist()))
    return chosen


@pytest.mark.parametrize("fanout, node_factor", [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("seed", [21, 22])
def test_two_levels_select_what_a_loop_reference_selects(seed, fanout, node_factor):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 2, 420, 16, generator=g) + 0.5 * torch.randn(2, 2, 1, 16, generator=g)
    starts = torch.tensor([0, 29])
    query = torch.randn(2, 6, 16, generator=g)
    store = _store(keys)
    selector = _clusters(store, budget=8, cluster_fanout=fanout, cluster_node_factor=node_factor)
    mask = torch.arange(400)[None, :] >= starts[:, None] + 2
    assert selector.keep_nodes * fanout < 12 * 8  # the two-level path: fewer nodes kept than the 12 segments hold
    got = selector.select(query, Candidates(mask, starts), 0.25)
    expected = _two_level_reference(selector, query, mask, starts, 0.25)
    for b in range(2):
        for h in range(2):
            assert set(got[0][b, h][got[1][b, h]].tolist()) == expected[b * 2 + h]
    selector.free()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_levels_select_for_any_run_of_sequences_as_for_the_whole_batch(dtype):
    g = torch.Generator().manual_seed(24)
    keys = torch.randn(4, 2, 420, 16, generator=g).to(dtype)
    starts = torch.tensor([0, 29, 70, 130])  # left padding: each row's segments start at its first real token
    query = torch.randn(4, 4, 16, generator=g)
    selector = _clusters(_store(keys), budget=8, **TWO_LEVELS)
    mask = torch.arange(400)[None, :] >= starts[:, None] + 2
    whole = selector.select(query, Candidates(mask, starts), 0.25)
    for first, count in ((1, 3), (2, 2), (3, 1)):
        rows = slice(first, first + count)
        part = selector.select(query[rows], Candidates(mask[rows], starts[rows], first), 0.25)
        assert torch.equal(part[1], whole[1][rows])
        assert torch.equal(part[0][part[1]], whole[0][rows][part[1]])


@pytest.mark.parametrize("levels", [{}, TWO_LEVELS])
def test_a_shared_prefix_selects_what_each_sequence_with_its_own_copy_selects(levels):
    g = torch.Generator().manual_seed(23)
    prefix = torch.randn(1, 2, 256, 8, generator=g)  # 8 segments of 32: the own segments start where it ends
    own = torch.randn(3, 2, 100, 8, generator=g)
    query = torch.randn(3, 4, 8, generator=g)
    shared_store = _store(prefix)
    shared = _clusters(shared_store, **levels)
    shared.extend(256, torch.zeros(1, dtype=torch.long))
    shared_store.share(3)
    shared.share()
    shared_store.append(own, -own)
    copies = _clusters(_store(torch.cat([prefix.expand(3, -1, -1, -1), own], dim=2)), **levels)
    mask = torch.arange(340)[None, :].expand(3, -1) >= 2
    starts = torch.zeros(3, dtype=torch.long)
    a, b = (selector.select(query, Candidates(mask, starts), 0.3) for selector in (shared, copies))
    assert torch.equal(a[1], b[1])
    for row in range(3):
        for h in range(2):
            assert set(a[0][row, h][a[1][row, h]].tolist()) == set(b[0][row, h][b[1][row, h]].tolist())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cluster_size": 0}, "cluster_size"),
        ({"cluster_segment": 48, "cluster_size": 16}, "power of two"),
        ({"cluster_segment": 8, "cluster_size": 16}, "power of two"),
        ({"cluster_factor": 0}, "cluster_factor"),
        ({"cluster_size": 1.5}, "cluster_size"),
        ({"cluster_fanout": 3}, "cluster_fanout"),
        ({"cluster_fanout": 128, "cluster_size": 16, "cluster_segment": 1024}, "cluster_fanout"),
        ({"cluster_fanout": 0}, "cluster_fanout"),
        ({"cluster_node_factor": 0}, "cluster_node_factor"),
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


@pytest.mark.parametrize("levels", [{}, TWO_LEVELS])
def test_generate_with_the_index_full_budget_threads_and_host_bytes(levels):
    model = six_layer_llama(seed=12)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(13))
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    index = {"selector": "clusters", "cluster_size": 4, "cluster_segment": 32, "cluster_factor": 2,
             "cluster_min_context": 0, **levels}  # two levels: 3 of 32+ nodes kept
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
