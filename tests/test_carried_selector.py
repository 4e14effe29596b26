"""The `carried` selector (the default) against the flat scan it is built on (`lowbit`): the same selections where the
design says so (every step a scan; a pool that holds every candidate), the schedule of its scans, keys appended
during decode always selectable, its state reset with the store; through `generate`, full budget = dense."""

from __future__ import annotations

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig
from dual_cache.selection.candidates import Candidates
from dual_cache.selection.selectors import SELECTORS
from tests.conftest import record_selections, six_layer_llama
from tests.test_selectors import _store


def _selector(store, phase=0, **options):
    config = DualDecoderConfig(**{"selector": "carried", "lowbit_factor": 2, **options})
    return SELECTORS[config.selector](config, store, "cpu", phase=phase)


def _steps(selector, keys, starts, steps, budget, seed, first_end):
    """Select at `steps` consecutive ends from `first_end` on (one new position per step), queries drifting."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(keys.shape[0], 2 * keys.shape[1], keys.shape[3], generator=g)
    out = []
    for step in range(steps):
        end = first_end + step
        selector.extend(end, starts)
        mask = torch.arange(end)[None, :] >= starts[:, None] + 2
        query = query + 0.2 * torch.randn(query.shape, generator=g)
        out.append(selector.select(query, Candidates(mask, starts), 0.3, budget))
    return out


def _same(a, b) -> bool:
    return torch.equal(a[1], b[1]) and torch.equal(a[0][a[1]], b[0][b[1]])


@pytest.mark.parametrize("seed", [31, 32])
def test_with_a_scan_every_step_it_selects_what_lowbit_selects(seed):
    keys = torch.randn(2, 2, 400, 8, generator=torch.Generator().manual_seed(seed))
    starts = torch.tensor([0, 30])
    carried = _selector(_store(keys), rescan_interval=1)
    lowbit = SELECTORS["lowbit"](DualDecoderConfig(selector="lowbit", lowbit_factor=2), _store(keys), "cpu")
    for a, b in zip(_steps(carried, keys, starts, 12, 12, seed, 330), _steps(lowbit, keys, starts, 12, 12, seed, 330)):
        assert _same(a, b)


@pytest.mark.parametrize("seed", [33, 34])
def test_a_pool_holding_every_candidate_selects_what_the_exact_scan_selects(seed):
    keys = torch.randn(2, 2, 400, 8, generator=torch.Generator().manual_seed(seed))
    starts = torch.tensor([0, 30])
    carried = _selector(_store(keys), rescan_interval=8, rescan_cosine=None, lowbit_factor=64, carried_factor=64)
    exact = SELECTORS["exact"](DualDecoderConfig(selector="exact"), _store(keys), "cpu")
    for a, b in zip(_steps(carried, keys, starts, 20, 8, seed, 320), _steps(exact, keys, starts, 20, 8, seed, 320)):
        assert _same(a, b)
    assert carried.tasks_pooled > carried.tasks_scanned > 0


def test_scans_follow_the_interval_staggered_by_layer_and_head_and_the_query_cosine():
    keys = torch.randn(1, 2, 600, 8, generator=torch.Generator().manual_seed(35))
    starts = torch.zeros(1, dtype=torch.long)
    interval = 4
    for phase in (0, 1):
        selector = _selector(_store(keys), phase, rescan_interval=interval, rescan_cosine=None)
        _steps(selector, keys, starts, 1 + 3 * interval, 8, 36, 500)
        # per head: 1 scan, a staggered first wait of 1 + (phase + head) % interval, then one scan per interval
        waits = [1 + (phase + head) % interval for head in range(2)]
        expected = sum(1 + len(range(1 + wait, 1 + 3 * interval, interval)) for wait in waits)
        assert selector.tasks_scanned == expected
        assert selector.tasks_scanned + selector.tasks_pooled == 2 * (1 + 3 * interval)
    moved = _selector(_store(keys), rescan_interval=1000, rescan_cosine=1.0)  # every query moves: every step scans
    _steps(moved, keys, starts, 6, 8, 37, 500)
    assert moved.tasks_pooled == 0 and moved.tasks_scanned == 12


def test_a_key_appended_after_the_scan_is_selectable_at_once():
    g = torch.Generator().manual_seed(38)
    keys = torch.randn(1, 2, 400, 8, generator=g)
    query = torch.randn(1, 4, 8, generator=g)
    keys[0, :, 350] = 6 * query[0].view(2, 2, 8).mean(1)  # the newest key: far the highest logit of each head
    store = _store(keys)
    selector = _selector(store, 1, rescan_interval=100, rescan_cosine=None)  # first waits: 2 and 3 selections
    starts = torch.zeros(1, dtype=torch.long)
    for end in (300, 351):
        selector.extend(end, starts)
        indices, valid = selector.select(query, Candidates(torch.arange(end)[None] >= 2, starts), 0.3, 8)
    assert selector.tasks_pooled == 2  # the second step rescored the pool (and the fresh positions)
    assert all(350 in indices[0, h][valid[0, h]].tolist() for h in range(2))


def test_a_crop_below_the_pool_the_store_shared_and_free_reset_the_pool():
    keys = torch.randn(1, 2, 400, 8, generator=torch.Generator().manual_seed(39))
    store = _store(keys)
    selector = _selector(store, rescan_interval=100, rescan_cosine=None)
    starts = torch.zeros(1, dtype=torch.long)
    _steps(selector, keys, starts, 2, 8, 40, 380)
    selector.truncate(200)
    assert int(selector._pool.fresh_from.max()) == 200  # what is appended after the crop is fresh
    scans = selector.tasks_scanned
    store.share(3)
    selector.share()
    assert selector._pool is None and selector.tasks_scanned == scans  # every task of the 3 sequences scans next
    selector.free()
    assert selector.host_bytes == 0


@pytest.mark.parametrize("interval", [1, 4])
def test_generate_full_budget_equals_dense_and_interval_one_equals_lowbit(interval):
    model = six_layer_llama(seed=41)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(42))
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    dense = model.generate(ids, **kwargs)
    full = model.generate(ids, cache_implementation="dual", cache_config={"budget": 4096, "window": 8,
                                                                         "rescan_interval": interval}, **kwargs)
    assert torch.equal(dense, full)
    small = {"budget": 12, "n_sink": 4, "window": 8, "lowbit_factor": 2, "early_layers": 1,
             "early_layer_budget": 20, "miss_repair": True}
    runs = {}
    for selector in ("carried", "lowbit"):
        cache = DualDecoderCache(model.config, **small, selector=selector, rescan_interval=interval)
        recorded = record_selections(cache)
        runs[selector] = (model.generate(ids, cache=cache, **kwargs), recorded)
    threaded = DualDecoderCache(model.config, **small, selector="carried", rescan_interval=interval,
                                retrieval_threads=2)  # jobs on worker threads, outside generate's inference mode
    assert torch.equal(model.generate(ids, cache=threaded, **kwargs), runs["carried"][0])
    stats = threaded.stats()
    assert stats["selections_pooled"] == 0 if interval == 1 else 0 < stats["scan_share"] < 1
    if interval == 1:
        assert torch.equal(runs["carried"][0], runs["lowbit"][0])
        for (layer_a, idx_a, ok_a, _), (layer_b, idx_b, ok_b, _) in zip(runs["carried"][1], runs["lowbit"][1]):
            assert layer_a == layer_b and torch.equal(ok_a, ok_b) and torch.equal(idx_a[ok_a], idx_b[ok_b])
