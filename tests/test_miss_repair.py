"""Miss repair: steps whose entries were chosen by a mis-speculated token are re-selected with the real token's
query. Reference: the `"oracle"` selector, which always selects with the real token's query."""

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig
from dual_cache.transfer_schedule import TransferSchedule
from dual_cache.selection import Selection
from tests.conftest import record_selections, six_layer_llama

NEVER = 95  # a token id the tests forbid the model to emit; the speculator always proposes it
# the synchronous repair option as defined against the oracle: the selection of exactly the budget, no re-rank
SYNC = {"miss_repair": True, "fetch_factor": 1, "fetch_next": False}


@pytest.fixture
def always_miss(monkeypatch):
    """Every speculated token is NEVER, which generation forbids: every step is a miss."""
    from dual_cache import speculators

    monkeypatch.setattr(speculators.SelfSpeculator, "propose",
                        lambda self, sequences, chained, hit: [NEVER] * len(sequences))


@pytest.mark.parametrize("threads", [0, 1])
def test_repair_on_every_step_reproduces_the_oracle_selector(always_miss, threads):
    model = six_layer_llama(seed=7)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(8))
    base = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 24,
            "retrieval_threads": threads, "layer_budgets": {3: 0}, **SYNC}
    kwargs = dict(max_new_tokens=12, do_sample=False, bad_words_ids=[[NEVER]])
    runs = {}
    for name, options in (("repair", {"selector": "exact"}), ("oracle", {"selector": "oracle"})):
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
    out = model.generate(ids, cache_implementation="dual", cache_config={"budget": 256, "early_layers": 0,
                                                                         "miss_repair": True},
                         return_dict_in_generate=True, **kwargs)
    assert torch.equal(dense, out.sequences)
    assert out.cache.stats()["repairs"] == 0  # every candidate fits the budget: any query selects them all


def test_schedule_repair_replaces_only_the_missed_rows():
    schedule = TransferSchedule("cpu", layer_order=[0], layers_in_flight=1, lookahead=0, threads=0)
    shape = (3, 2, 4, 5)
    generator = torch.Generator().manual_seed(3)
    prefetched = Selection(torch.randint(0, 50, shape[:3], generator=generator), torch.ones(shape[:3], dtype=torch.bool),
                           torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    repaired = Selection(torch.randint(50, 99, shape[:3], generator=generator), torch.zeros(shape[:3], dtype=torch.bool),
                         torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    schedule.submit(0, lambda staging: staging.copy_from(prefetched), shape, torch.float32)
    view = schedule.acquire(0)
    schedule.repair(0, lambda staging: staging.copy_from(repaired), [1])
    for used, before, after in zip((view.indices, view.valid, view.keys, view.values),
                                   (prefetched.indices, prefetched.valid, prefetched.keys, prefetched.values),
                                   (repaired.indices, repaired.valid, repaired.keys, repaired.values)):
        assert torch.equal(used[0], before[0]) and torch.equal(used[2], before[2])
        assert torch.equal(used[1], after[1])
    schedule.release(0)
    assert schedule.repairs == 1 and schedule.repaired_steps == 1
    assert schedule.bytes_copied == prefetched.nbytes + repaired.nbytes // 3
    with pytest.raises(KeyError):
        schedule.repair(0, lambda staging: None, [0, 1, 2])
    schedule.close()


# --- drift repair: hit steps whose real query drifted from the speculated query that chose the entries ----------

def test_query_drift_matches_a_per_group_loop():
    from dual_cache.repair import query_drift

    generator = torch.Generator().manual_seed(21)
    batch, kv_heads, group, dim = 3, 2, 4, 8
    real = torch.randn(batch, kv_heads * group, dim, generator=generator)
    chooser = real + 0.3 * torch.randn(real.shape, generator=generator)
    chooser[1] = real[1]  # an exact match drifts 0
    expected = torch.zeros(batch)
    for b in range(batch):
        for h in range(kv_heads):
            q, q_hat = real[b, h * group : (h + 1) * group].flatten(), chooser[b, h * group : (h + 1) * group].flatten()
            expected[b] = max(expected[b], ((q - q_hat).norm() / q.norm()).item())
    drift = query_drift(real.to(torch.bfloat16).float(), chooser.to(torch.bfloat16).float(), kv_heads)
    torch.testing.assert_close(query_drift(real, chooser, kv_heads), expected)
    assert drift[1] == 0 and drift.dtype == torch.float32
    assert query_drift(torch.zeros(1, 4, 8), torch.ones(1, 4, 8), 2)[0] > 1e6  # a zero query: fully drifted


@pytest.mark.parametrize("threads", [0, 1])
def test_zero_drift_threshold_repairs_every_step_like_the_oracle(threads):
    """`repair_drift=0` re-selects hit steps too, so every step selects with the real token's query."""
    model = six_layer_llama(seed=13)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(14))
    base = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, "retrieval_threads": threads, **SYNC}
    runs = {}
    for name, options in (("drift0", {"repair_drift": 0.0, "selector": "exact"}), ("oracle", {"selector": "oracle"})):
        cache = DualDecoderCache(model.config, **base, **options)
        recorded = record_selections(cache, at="release")
        runs[name] = (model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False), recorded, cache.stats())
    (drift_ids, drift_sel, stats), (oracle_ids, oracle_sel, _) = runs["drift0"], runs["oracle"]
    assert torch.equal(drift_ids, oracle_ids)
    assert len(drift_sel) == len(oracle_sel) == 11 * 6
    for (layer_a, idx_a, valid_a, keys_a), (layer_b, idx_b, valid_b, keys_b) in zip(drift_sel, oracle_sel):
        assert layer_a == layer_b
        assert torch.equal(idx_a, idx_b) and torch.equal(valid_a, valid_b) and torch.equal(keys_a, keys_b)
    assert stats["spec_hits"] > 0 and stats["drift_repairs"] > 0  # the hits were repaired as drift
    assert stats["repairs"] == 11 * 6


def test_unreachable_drift_threshold_is_the_same_as_no_drift_repair():
    model = six_layer_llama(seed=13)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(15))
    runs = []
    for drift in (None, 1e30, 0.4):
        cache = DualDecoderCache(model.config, budget=16, n_sink=4, window=8, early_layers=0, repair_drift=drift,
                                 **SYNC)
        recorded = record_selections(cache, at="release")
        runs.append((model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False), recorded, cache.stats()))
    (off_ids, off_sel, off_stats), (huge_ids, huge_sel, huge_stats), (_, _, default_stats) = runs
    assert torch.equal(off_ids, huge_ids) and off_stats["drift_repairs"] == huge_stats["drift_repairs"] == 0
    assert all(torch.equal(a[1], b[1]) for a, b in zip(off_sel, huge_sel))
    assert off_stats["spec_hits"] > 0
    assert default_stats["drift_repairs"] <= default_stats["repairs"]


def test_drift_repair_needs_miss_repair(always_miss):
    model = six_layer_llama(seed=7)
    ids = torch.randint(3, 90, (1, 300), generator=torch.Generator().manual_seed(9))
    out = model.generate(ids, max_new_tokens=6, do_sample=False, bad_words_ids=[[NEVER]], cache_implementation="dual",
                         cache_config={"budget": 16, "window": 8, "miss_repair": False, "repair_drift": 0.0},
                         return_dict_in_generate=True)
    assert out.cache.stats()["repairs"] == 0 == out.cache.stats()["drift_repairs"]


def test_cli_repair_drift_option(tmp_path, capsys):
    from dual_cache.cli import _drift_threshold, main

    assert _drift_threshold("off") is None and _drift_threshold("0.25") == 0.25
    doc = tmp_path / "doc.txt"
    doc.write_text("a document")
    for bad in ("-1", "abc", "nan", "inf"):
        with pytest.raises(SystemExit) as exit_info:  # argparse rejects it before any model loads
            main(["generate", "--prompt-file", str(doc), "--question", "q", "--repair-drift", bad])
        assert exit_info.value.code == 2
        assert "--repair-drift" in capsys.readouterr().err


@pytest.mark.parametrize("selector", [{"selector": "exact"}, {"selector": "lowbit", "lowbit_factor": 2}])
def test_repairing_some_sequences_scores_only_them_with_the_same_result(monkeypatch, selector):
    """A repair of a strict subset of the batch scores only those sequences, in one engine call; the selections they
    attend to (and the tokens) equal those of scoring the whole batch and copying the same rows."""
    from dual_cache.layer import DualLayer

    model = six_layer_llama(seed=17)
    generator = torch.Generator().manual_seed(18)
    ids = torch.randint(3, 90, (3, 260), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :70] = 0  # a left-padded row
    options = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, **SYNC, **selector}
    subsets = []

    def run():
        cache = DualDecoderCache(model.config, **options)
        recorded = record_selections(cache, at="release")
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=14, do_sample=False)
        return out, recorded

    original_repair = DualLayer.repair_selection

    def spy(self, query, committed, rows, batch, drifted=()):
        subsets.append(len(rows))
        return original_repair(self, query, committed, rows, batch, drifted)

    monkeypatch.setattr(DualLayer, "repair_selection", spy)
    rows_out, rows_sel = run()
    assert any(0 < n < 3 for n in subsets)  # some repairs covered part of the batch

    def whole_batch(self, query, committed, rows, batch, drifted=()):  # the reference: every sequence, rows copied
        job = self._selection_job(query, committed, None, frozenset(drifted), use="repair")
        self.schedule.repair(self.layer_idx, job, list(rows))

    monkeypatch.setattr(DualLayer, "repair_selection", whole_batch)
    full_out, full_sel = run()
    assert torch.equal(rows_out, full_out)
    assert len(rows_sel) == len(full_sel)
    for (layer_a, idx_a, valid_a, keys_a), (layer_b, idx_b, valid_b, keys_b) in zip(rows_sel, full_sel):
        assert layer_a == layer_b
        assert torch.equal(valid_a, valid_b) and torch.equal(idx_a[valid_a], idx_b[valid_b])
        assert torch.equal(keys_a[valid_a], keys_b[valid_b])
