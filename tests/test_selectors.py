"""Selectors as classes (`dual_cache.selection.selectors`), and what a host selector must do whatever its index.

References: the whole batch for a subset of sequences and the same tokens without left padding (exact and the 2-bit
index, `selector="lowbit"`); the host bytes the cache checks before allocating (every selector); each sequence's own
copy of a shared prefix (the selectors that share one); dense `generate()` at full budget and thread count 0 for the
index in decoding. The index against its reference and exact selection: tests/test_engine.py."""

import importlib
import inspect

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig
from dual_cache.host.memory import live_host_bytes
from dual_cache.host.store import HostKVStore
from dual_cache.selection.candidates import Candidates
from dual_cache.selection.selectors import SELECTORS, Selector
from tests.conftest import record_selections, six_layer_llama


def test_every_selector_is_a_class_in_its_own_file_and_the_default_is_registered():
    assert set(SELECTORS) == {"carried", "exact", "lowbit", "oracle", "quest"}
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


BUDGET = 8  # entries per (sequence, KV head) the tests' selections choose


def _selector(name: str, store: HostKVStore) -> Selector:
    """`name`'s selector over `store`; the 2-bit index rescores 2 × budget positions, so its scan decides."""
    return SELECTORS[name](DualDecoderConfig(selector=name, lowbit_factor=2), store, "cpu")


@pytest.mark.parametrize("seed", [21, 22])
def test_a_job_selects_its_exact_rows_as_the_exact_selector_and_the_others_by_its_own_index(seed):
    """Drift repairs (`Selector.job(exact=...)`): those rows get exact selection's positions, the others the
    index's, alone or mixed in one job (a job of some rows returns one row per listed sequence)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(3, 2, 300, 8, generator=g)
    query = torch.randn(3, 4, 8, generator=g)
    store = _store(keys)
    lowbit, exact = _selector("lowbit", store), _selector("exact", store)
    candidates = Candidates(torch.arange(280)[None, :].expand(3, 280) >= 2, torch.zeros(3, dtype=torch.long))

    def run(selector, rows=None, exact_rows=frozenset()):
        return selector.job(query, None, candidates, 0.35, BUDGET, BUDGET, rows, frozenset(exact_rows))()

    by_index, by_exact = run(lowbit), run(exact)
    assert not torch.equal(by_index.positions, by_exact.positions)  # the index's scan decides something here
    for rows, exact_rows in ((None, {0, 1, 2}), (None, {1}), ([0, 2], {2})):
        got = run(lowbit, rows, exact_rows)
        for i, row in enumerate(rows or range(3)):
            want = by_exact if row in exact_rows else by_index
            for field in ("positions", "valid"):
                assert torch.equal(getattr(got, field)[i], getattr(want, field)[row]), (rows, exact_rows, row)


@pytest.mark.parametrize("name", ["exact", "lowbit"])  # carried: stateful, held to lowbit in its own tests
@pytest.mark.parametrize("seed", [9, 10])
def test_one_sequence_selects_as_in_the_whole_batch_and_padding_never_moves_its_groups(seed, name):
    g = torch.Generator().manual_seed(seed)
    alone = torch.randn(1, 2, 200, 8, generator=g)
    pad = 37
    padded = torch.cat([torch.randn(1, 2, pad, 8, generator=g), alone], dim=2)[:, :, :200]  # left-padded row
    other = torch.randn(1, 2, 200, 8, generator=g)
    keys = torch.cat([other, padded])
    starts = torch.tensor([0, pad])
    query = torch.randn(2, 4, 8, generator=g)
    store = _store(keys)
    selector = _selector(name, store)
    hi = 190  # two complete 64-token groups in every row, counted from its first real token
    mask = torch.arange(hi)[None, :] >= starts[:, None] + 2
    whole = selector.select(query, Candidates(mask, starts), 0.3, BUDGET)
    for row in range(2):
        one = selector.select(query[row : row + 1], Candidates(mask, starts).subset([row]), 0.3, BUDGET)
        assert torch.equal(one[1], whole[1][row : row + 1])
        assert torch.equal(one[0][one[1]], whole[0][row : row + 1][one[1]])
    # the padded row's selection equals that of the same tokens alone, shifted by the padding
    solo_store = _store(alone)
    solo = _selector(name, solo_store)
    solo_mask = torch.arange(hi - pad)[None, :] >= 2
    expected = solo.select(query[1:], Candidates(solo_mask, torch.tensor([0])), 0.3, BUDGET)
    assert torch.equal(expected[1], whole[1][1:])
    assert torch.equal(expected[0][expected[1]] + pad, whole[0][1:][expected[1]])


@pytest.mark.parametrize("name", list(SELECTORS))
def test_what_the_cache_checks_before_allocating_covers_what_a_selector_allocates_on_the_host(name):
    g = torch.Generator().manual_seed(25)
    store = _store(torch.randn(2, 2, 260, 8, generator=g), reserve=300)
    selector = _selector(name, store)
    starts = torch.tensor([0, 45])
    selector.extend(260, starts)
    mask = torch.arange(250)[None, :] >= starts[:, None] + 2
    selector.select(torch.randn(2, 4, 8, generator=g), Candidates(mask, starts), 0.3, BUDGET)
    allowed = 2 * SELECTORS[name].host_bytes_for(selector.config, store.capacity, 2, 8, store.element_size)
    assert selector.host_bytes <= allowed
    assert (selector.host_bytes > 0) == (name in ("lowbit", "carried"))  # the 2-bit index (and the pools)
    selector.free()
    assert selector.host_bytes == 0


@pytest.mark.parametrize("name", [name for name, cls in SELECTORS.items() if cls.shares_prefix])
def test_a_shared_prefix_selects_what_each_sequence_with_its_own_copy_selects(name):
    g = torch.Generator().manual_seed(23)
    prefix = torch.randn(1, 2, 256, 8, generator=g)
    own = torch.randn(3, 2, 100, 8, generator=g)
    query = torch.randn(3, 4, 8, generator=g)
    shared_store = _store(prefix)
    shared = _selector(name, shared_store)
    shared.extend(256, torch.zeros(1, dtype=torch.long))
    shared_store.share(3)
    shared.share()
    shared_store.append(own, -own)
    copies = _selector(name, _store(torch.cat([prefix.expand(3, -1, -1, -1), own], dim=2)))
    mask = torch.arange(340)[None, :].expand(3, -1) >= 2
    starts = torch.zeros(3, dtype=torch.long)
    for selector in (shared, copies):  # index maintenance is the caller's (a decode step's job), apart from select
        selector.extend(340, starts)
    a, b = (selector.select(query, Candidates(mask, starts), 0.3, BUDGET) for selector in (shared, copies))
    assert torch.equal(a[1], b[1])
    for row in range(3):
        for h in range(2):
            assert set(a[0][row, h][a[1][row, h]].tolist()) == set(b[0][row, h][b[1][row, h]].tolist())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"selector": "lowbit", "lowbit_factor": 0}, "lowbit_factor"),
        ({"selector": "lowbit", "lowbit_channels": 1.5}, "lowbit_channels"),
        ({"rescan_interval": 0}, "rescan_interval"),
        ({"rescan_cosine": 1.5}, "rescan_cosine"),
        ({"carried_factor": 0.5}, "carried_factor"),
        ({"selector": "quest", "block_size": 16, "budget": 24}, "multiple of `block_size`"),
        ({"selector": "clusters"}, "`selector` must be one of"),
        ({"cluster_size": 16}, "Unknown dual cache option"),
    ],
)
def test_bad_selector_options_are_refused_before_any_work(options, message):
    with pytest.raises(ValueError, match=message):
        DualDecoderConfig.from_dict(options)
    model = six_layer_llama(seed=11)
    before = live_host_bytes()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.randint(3, 90, (1, 40)), max_new_tokens=2, cache_implementation="dual",
                       cache_config=options)
    assert live_host_bytes() == before


def test_generate_with_the_index_full_budget_threads_and_host_bytes():
    model = six_layer_llama(seed=12)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(13))
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    index = {"selector": "lowbit", "lowbit_factor": 2}  # 2 × 12 positions rescored of up to ~230 candidates
    dense = model.generate(ids, **kwargs)
    full = model.generate(ids, cache_implementation="dual", cache_config={**index, "budget": 4096, "window": 8},
                          **kwargs)
    assert torch.equal(dense, full)
    base = {**index, "budget": 12, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 20,
            "miss_repair": True}  # the synchronous repair path selects through the index too
    runs = {}
    for threads in (0, 1, 3):
        cache = DualDecoderCache(model.config, **base, retrieval_threads=threads)
        recorded = record_selections(cache)
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
    assert 0 < index_bytes <= 0.1 * exact.stats()["host_bytes"]  # the 2-bit codes and group parameters: 7.8%
    assert stats["repairs"] > 0  # random weights miss often


def test_the_2bit_index_claims_what_it_holds_as_it_grows_and_is_shared():
    """Host-memory accounting follows the index through reallocations and `share` (no claim left behind)."""
    g = torch.Generator().manual_seed(24)
    store = _store(torch.randn(1, 2, 130, 8, generator=g))
    claimed = []
    selector = SELECTORS["lowbit"](DualDecoderConfig(selector="lowbit"), store, "cpu", claim_host=claimed.append)
    selector.extend(130, torch.zeros(1, dtype=torch.long))
    store.share(3)
    selector.share()
    for _ in range(4):  # each sequence's own groups: the index grows past its first allocation
        extra = torch.randn(3, 2, 64, 8, generator=g)
        store.append(extra, extra)
        selector.extend(store.length, torch.zeros(3, dtype=torch.long))
    assert selector.n_groups == [6, 6, 6] and sum(claimed) == selector.host_bytes
