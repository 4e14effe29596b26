"""Miss repair: steps whose entries were chosen by a mis-speculated token are re-selected with the real token's
query. Reference: the `"oracle"` selector, which always selects with the real token's query."""

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig
from dual_cache.schedule import Selection, TransferSchedule
from tests.conftest import record_selections, six_layer_llama

NEVER = 95  # a token id the tests forbid the model to emit; the speculator always proposes it


@pytest.fixture
def always_miss(monkeypatch):
    """Every speculated token is NEVER, which generation forbids: every step is a miss."""
    from dual_cache import speculators

    monkeypatch.setattr(speculators.SelfSpeculator, "propose", lambda self, ids, logits, hit: torch.full_like(ids[:, -1], NEVER))


@pytest.mark.parametrize("threads", [0, 1])
def test_repair_on_every_step_reproduces_the_oracle_selector(always_miss, threads):
    model = six_layer_llama(seed=7)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(8))
    base = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 24,
            "retrieval_threads": threads, "layer_budgets": {3: 0}}
    kwargs = dict(max_new_tokens=12, do_sample=False, bad_words_ids=[[NEVER]])
    runs = {}
    for name, options in (("repair", {}), ("oracle", {"selector": "oracle"})):
        cache = DualDecoderCache(model.config, **base, **options)
        recorded = record_selections(cache, at="release")
        runs[name] = (model.generate(ids, cache=cache, **kwargs), recorded, cache.stats())
    (repair_ids, repair_sel, stats), (oracle_ids, oracle_sel, _) = runs["repair"], runs["oracle"]
    assert torch.equal(repair_ids, oracle_ids)
    assert len(repair_sel) == len(oracle_sel) == 11 * 5  # 11 decode forwards × 5 layers with a budget
    for (layer_a, idx_a, valid_a, keys_a), (layer_b, idx_b, valid_b, keys_b) in zip(repair_sel, oracle_sel):
        assert layer_a == layer_b
        assert torch.equal(idx_a, idx_b) and torch.equal(valid_a, valid_b) and torch.equal(keys_a, keys_b)
    assert stats["spec_hits"] == 0
    assert stats["repairs"] == 11 * 5 and stats["repaired_steps"] == 11


def test_no_repair_keeps_the_prefetched_selection(always_miss):
    model = six_layer_llama(seed=7)
    ids = torch.randint(3, 90, (1, 300), generator=torch.Generator().manual_seed(9))
    config = {"budget": 16, "n_sink": 4, "window": 8, "miss_repair": False}
    out = model.generate(ids, max_new_tokens=6, do_sample=False, bad_words_ids=[[NEVER]], cache_implementation="dual",
                         cache_config=config, return_dict_in_generate=True)
    assert out.cache.stats()["repairs"] == 0
    with pytest.raises(ValueError, match="miss_repair"):
        DualDecoderConfig(miss_repair="yes")


def test_full_budget_with_repair_matches_dense_and_skips_the_repair():
    model = six_layer_llama(seed=11)
    ids = torch.randint(3, 90, (2, 200), generator=torch.Generator().manual_seed(12))
    kwargs = dict(max_new_tokens=16, do_sample=False)
    dense = model.generate(ids, **kwargs)
    out = model.generate(ids, cache_implementation="dual", cache_config={"budget": 256, "early_layers": 0},
                         return_dict_in_generate=True, **kwargs)
    assert torch.equal(dense, out.sequences)
    assert out.cache.stats()["repairs"] == 0  # every candidate fits the budget: any query selects them all


def test_schedule_repair_replaces_only_the_missed_rows():
    schedule = TransferSchedule("cpu", layer_order=[0], slot_tokens=4, layers_in_flight=1, lookahead=0, threads=0)
    shape = (3, 2, 4, 5)
    generator = torch.Generator().manual_seed(3)
    prefetched = Selection(torch.randint(0, 50, shape[:3], generator=generator), torch.ones(shape[:3], dtype=torch.bool),
                           torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    repaired = Selection(torch.randint(50, 99, shape[:3], generator=generator), torch.zeros(shape[:3], dtype=torch.bool),
                         torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    schedule.submit(0, lambda staging: staging.copy_from(prefetched), shape, torch.float32)
    view = schedule.acquire(0)
    schedule.repair(0, lambda staging: staging.copy_from(repaired), torch.tensor([False, True, False]))
    for used, before, after in zip((view.indices, view.valid, view.keys, view.values),
                                   (prefetched.indices, prefetched.valid, prefetched.keys, prefetched.values),
                                   (repaired.indices, repaired.valid, repaired.keys, repaired.values)):
        assert torch.equal(used[0], before[0]) and torch.equal(used[2], before[2])
        assert torch.equal(used[1], after[1])
    schedule.release(0)
    assert schedule.repairs == 1 and schedule.repaired_steps == 1
    assert schedule.bytes_copied == prefetched.nbytes + repaired.nbytes // 3
    with pytest.raises(KeyError):
        schedule.repair(0, lambda staging: None, torch.tensor([True, True, True]))
    schedule.close()
