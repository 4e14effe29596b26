"""The engine's carried pools (`engine.CarriedPool`, the `carried` selector's schedule and its steps between scans)
against the pure-torch reference, on random inputs: every build variant this CPU runs makes the reference's decisions
(which tasks scan: interval, stagger, query cosine, a crop), writes the pools a scan writes and selects from them what
the reference selects; bad pools are refused before any work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dual_cache import engine
from dual_cache.engine import native, reference
from tests.test_engine import CASES, _problem, _runnable


def _pool(batch, kv_heads, slots, width, interval=3, cosine=0.8, phase=1):
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long)  # noqa: E731
    return engine.CarriedPool(torch.full((batch, kv_heads, slots), -1, dtype=torch.long), zeros(batch, kv_heads),
                              zeros(batch, kv_heads), zeros(batch, kv_heads), torch.zeros(batch, kv_heads, width),
                              zeros(batch, kv_heads, 2), interval, cosine, phase)


def _same_pools(a, b) -> bool:
    for field in ("counts", "due", "fresh_from", "query", "tally"):
        if not torch.equal(getattr(a, field), getattr(b, field)):
            return False
    return all(torch.equal(a.positions[s, h, :int(a.counts[s, h])], b.positions[s, h, :int(b.counts[s, h])])
               for s in range(a.counts.shape[0]) for h in range(a.counts.shape[1]))


@pytest.mark.parametrize("variant", list(native.VARIANTS))
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", [21, 22])
def test_pools_decide_write_and_select_what_the_reference_does(variant, case, seed):
    _runnable(variant)
    batch, kv_heads, group, dim, n, dtype = CASES[case]
    query, mask, keys, index = _problem(seed * 10 + case, batch, kv_heads, group, dim, n, dtype)
    library = native.library(variant)
    gen = torch.Generator().manual_seed(seed)
    rows = list(range(batch))
    scaling = dim ** -0.5
    view = (index.packed, index.params, index.group_first)
    for budget, shortlist, slots, cosine in [(8, 32, 16, 0.8), (16, 64, 64, None), (12, 10_000, 7, 0.95)]:
        got_pool = _pool(batch, kv_heads, slots, group * dim, cosine=cosine)
        want_pool = _pool(batch, kv_heads, slots, group * dim, cosine=cosine)
        step_query = query.clone()
        full = mask.shape[1]
        for step, end in enumerate([full - 40, full - 39, full - 38, full - 60, full - 37, full - 36, full]):
            step_query = step_query + (0.9 if step == 4 else 0.15) * torch.randn(query.shape, generator=gen)
            step_mask = mask[:, :end].contiguous()
            got = engine._native_select(library, step_query, step_mask, keys, budget, scaling, index, shortlist,
                                        threads=2, rows=rows, pool=got_pool)
            picked = (view[0], view[1], view[2], index.usable(end))
            want = reference.select(step_query, step_mask, keys, budget, scaling, picked, shortlist, None,
                                    (want_pool, rows))
            assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (budget, step)
            assert _same_pools(got_pool, want_pool), (budget, step)
        scans, pooled = int(got_pool.tally[..., 0].sum()), int(got_pool.tally[..., 1].sum())
        assert scans + pooled == 7 * batch * kv_heads and scans >= batch * kv_heads and pooled > 0


def test_a_pooled_selection_takes_its_pool_and_the_fresh_positions_only():
    query, mask, keys, index = _problem(5, 2, 2, 3, 32, 900, torch.bfloat16)
    pool = _pool(2, 2, 20, 3 * 32, interval=5, cosine=None, phase=3)  # first waits: 3 % 5 and 4 % 5 selections
    end = mask.shape[1]
    engine.select(query, mask[:, :end - 30].contiguous(), keys, 8, 0.2, index, 64, pool=pool)
    kept = pool.positions.clone()
    indices, valid = engine.select(query * -1, mask, keys, 8, 0.2, index, 64, pool=pool)  # pooled, whatever q
    assert int(pool.tally[..., 1].sum()) == 4 and torch.equal(pool.positions, kept)
    for b in range(2):
        for h in range(2):
            allowed = set(kept[b, h, :int(pool.counts[b, h])].tolist()) | set(range(end - 30, end))
            assert set(indices[b, h][valid[b, h]].tolist()) <= allowed


def test_bad_pools_are_refused_before_any_work():
    query, mask, keys, index = _problem(6, 2, 2, 3, 32, 300, torch.float32)
    good = _pool(2, 2, 8, 96)
    with pytest.raises(ValueError, match="KV heads"):
        engine.select(query, mask, keys, 8, 0.2, index, 32, pool=_pool(2, 3, 8, 96))
    with pytest.raises(ValueError, match="sequences"):
        engine.select(query, mask, keys, 8, 0.2, index, 32, pool=_pool(1, 2, 8, 96))
    with pytest.raises(ValueError, match="floats"):
        engine.select(query, mask, keys, 8, 0.2, index, 32, pool=_pool(2, 2, 8, 64))
    with pytest.raises(ValueError, match="distinct"):
        engine.select(query, mask, keys, 8, 0.2, index, 32, pool=good, rows=[1, 1])
    with pytest.raises(ValueError, match="CarriedPool needs"):
        dataclasses.replace(good, counts=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="CarriedPool needs"):
        dataclasses.replace(good, interval=0)
    assert int(good.tally.sum()) == 0  # nothing ran


def test_the_cosine_threshold_is_compared_in_double_precision_as_the_reference_does():
    query = torch.zeros(1, 1, 4)
    query[0, 0, 0] = 1.0
    last = torch.tensor([0.7, (1 - 0.7 ** 2) ** 0.5, 0.0, 0.0])  # cosine 0.7 to float32 precision
    cosine = float(torch.nn.functional.cosine_similarity(query[0, 0].double(), last.double(), dim=0)) + 1e-9
    keys = [torch.randn(1, 1, 300, 4)]
    mask = torch.ones(1, 300, dtype=torch.bool)
    results = []
    for use_reference in (False, True):
        pool = _pool(1, 1, 8, 4, interval=5, cosine=cosine, phase=3)
        engine.select(query, mask, keys, 4, 0.5, pool=pool)  # the first selection scans
        pool.query[0, 0] = last
        if use_reference:
            reference.select(query, mask, keys, 4, 0.5, None, 0, None, (pool, [0]))
        else:
            engine.select(query, mask, keys, 4, 0.5, pool=pool)
        results.append(pool.tally.clone())
    assert torch.equal(results[0], results[1]) and int(results[0][0, 0, 0]) == 2  # just below: both scan


def test_pool_bounds_and_schedule_values_are_refused():
    query, mask, keys, index = _problem(7, 2, 2, 3, 32, 300, torch.float32)
    with pytest.raises(ValueError, match="reach"):
        engine.select(query, mask, [k[:1] for k in keys], 8, 0.2, None, 0, pool=_pool(1, 2, 8, 96), rows=[0, 1])
    with pytest.raises(ValueError, match="interval in"):
        _pool(2, 2, 8, 96, interval=2**64)
    with pytest.raises(ValueError, match="phase in"):
        _pool(2, 2, 8, 96, phase=-1)
