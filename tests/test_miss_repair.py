"""Miss repair: steps whose entries were chosen by a mis-speculated token are re-selected with the real token's
query, synchronously: what the step attends to then holds the real query's own exact top-k (the `"oracle"`
selector's choice)."""

import pytest
import torch

from dual_cache import DualDecoderCache, DualDecoderConfig
from dual_cache.transfer.delta import Delta
from dual_cache.transfer.schedule import TransferSchedule
from tests.conftest import record_selections, six_layer_llama

NEVER = 95  # a token id the tests forbid the model to emit; the speculator always proposes it
# the synchronous repair option: each step's own selection of exactly the budget, added to the resident set
SYNC = {"miss_repair": True, "fetch_factor": 1, "fetch_next": False}


@pytest.fixture
def always_miss(monkeypatch):
    """Every speculated token is NEVER, which generation forbids: every step is a miss."""
    from dual_cache.generate import speculators

    monkeypatch.setattr(speculators.SelfSpeculator, "propose",
                        lambda self, sequences, *rest, **keyed: [NEVER] * len(sequences))


def contains_real_top(cache) -> list[bool]:
    """Per (decode step, layer with a budget): whether the entries the step attends to include its real token's own
    exact top-budget (`Selector.select_exact` with the real query at slot 0), in every sequence and KV head: what
    miss repair guarantees (`attention_observer.observe_attention`)."""
    from dual_cache.eval.attention_observer import observe_attention
    from dual_cache.selection.candidates import Candidates

    seen = []

    def check(layer, query, scaling, step):
        committed = layer.get_seq_length() - query.shape[2]
        end = committed - layer.config.window
        candidates = Candidates(layer.sequences.candidates_below(end), layer.sequences.first_real)
        top, valid = layer.selector.select_exact(query[:, :, 0].float().cpu(), candidates, scaling,
                                                 layer.shape.budget)
        resident = step.segments[1]
        held = resident.positions.expand_as(resident.valid).cpu()
        held = torch.where(resident.valid.cpu(), held, -1)
        seen.append(bool(all(set(top[b, h][valid[b, h]].tolist()) <= set(held[b, h].tolist())
                             for b in range(top.shape[0]) for h in range(top.shape[1]))))

    observe_attention(cache, check)
    return seen


@pytest.mark.parametrize("threads", [0, 1])
def test_repair_on_every_step_makes_the_real_queries_own_top_k_resident(always_miss, threads):
    """Every step misses: each layer repairs, so what the real token attends to holds its own exact top-k (the
    oracle selector's choice), with the resident set's other entries beside it."""
    model = six_layer_llama(seed=7)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(8))
    base = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 24,
            "retrieval_threads": threads, "layer_budgets": {3: 0}, **SYNC}
    cache = DualDecoderCache(model.config, **base, selector="exact")
    seen = contains_real_top(cache)
    model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, bad_words_ids=[[NEVER]])
    stats = cache.stats()
    assert len(seen) == 11 * 5 and all(seen)  # 11 decode forwards × 5 layers with a budget
    assert stats["spec_hits"] == 0
    assert stats["repairs"] == 11 * 5 and stats["repaired_steps"] == 11
    cache = DualDecoderCache(model.config, **{**base, "miss_repair": False}, selector="exact")
    seen = contains_real_top(cache)
    model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False, bad_words_ids=[[NEVER]])
    assert not all(seen)  # without the repair, the mis-speculated token's choice lacks some of them


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


def test_schedule_repair_copies_the_repair_delta_after_the_prefetched_one():
    """`TransferSchedule.repair` runs its job now and returns its delta on the device; the prefetched delta stays as
    acquired; bytes count both deltas' rows."""
    schedule = TransferSchedule("cpu", layer_order=[0], layers_in_flight=1, lookahead=0, threads=0)
    generator = torch.Generator().manual_seed(3)

    def filler(count, first_slot):
        def job(staging: Delta):
            staging.count = count
            staging.slots[:count] = torch.arange(first_slot, first_slot + count)
            staging.positions[:count] = torch.randint(0, 99, (count,), generator=generator)
            staging.keys[:count] = torch.randn(count, 5, generator=generator)
            staging.values[:count] = torch.randn(count, 5, generator=generator)
            return None
        return job

    schedule.submit(0, filler(7, 0), 24, 5, torch.float32, chooser="handoff")
    prefetched, chooser = schedule.acquire(0)
    assert chooser == "handoff" and prefetched.count == 7
    before = [t.clone() for t in prefetched.fields()]
    repaired = schedule.repair(0, filler(3, 10), [1], 24, 5, torch.float32)
    assert repaired.count == 3 and torch.equal(repaired.slots, torch.arange(10, 13))
    assert all(torch.equal(a, b) for a, b in zip(before, prefetched.fields()))
    schedule.release(0)
    assert schedule.repairs == 1 and schedule.repaired_steps == 1
    row = 8 + 8 + 2 * 5 * 4  # slot, position, K and V (fp32, head dim 5)
    assert schedule.bytes_copied == (7 + 3) * row
    with pytest.raises(KeyError):
        schedule.repair(0, filler(1, 0), [0, 1, 2], 24, 5, torch.float32)
    schedule.close()


# --- drift repair: hit steps whose real query drifted from the speculated query that chose the entries ----------

def test_query_drift_matches_a_per_group_loop():
    from dual_cache.layer.repair import query_drift

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
    """`repair_drift=0` re-selects hit steps too, so every step attends to its real query's own exact top-k."""
    model = six_layer_llama(seed=13)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(14))
    base = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, "retrieval_threads": threads, **SYNC}
    cache = DualDecoderCache(model.config, **base, repair_drift=0.0, selector="exact")
    seen = contains_real_top(cache)
    model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    stats = cache.stats()
    assert len(seen) == 11 * 6 and all(seen)
    assert stats["spec_hits"] > 0 and stats["drift_repairs"] > 0  # the hits were repaired as drift
    assert stats["repairs"] == 11 * 6


def test_unreachable_drift_threshold_is_the_same_as_no_drift_repair():
    model = six_layer_llama(seed=13)
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(15))
    runs = []
    for drift in (None, 1e30, 0.4):
        cache = DualDecoderCache(model.config, budget=16, n_sink=4, window=8, early_layers=0, repair_drift=drift,
                                 **SYNC)
        recorded = record_selections(cache)
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
    from dual_cache.cli.main import _drift_threshold, main

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
    from dual_cache.layer.layer import DualLayer

    model = six_layer_llama(seed=17)
    generator = torch.Generator().manual_seed(18)
    ids = torch.randint(3, 90, (3, 260), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :70] = 0  # a left-padded row
    options = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, **SYNC, **selector}
    subsets = []

    def run():
        cache = DualDecoderCache(model.config, **options)
        recorded = record_selections(cache)
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=14, do_sample=False)
        return out, recorded

    original_repair = DualLayer.repair_selection

    def spy(self, query, committed, rows, batch, drifted=()):
        subsets.append(len(rows))
        return original_repair(self, query, committed, rows, batch, drifted)

    monkeypatch.setattr(DualLayer, "repair_selection", spy)
    rows_out, rows_sel = run()
    assert any(0 < n < 3 for n in subsets)  # some repairs covered part of the batch

    def one_by_one(self, query, committed, rows, batch, drifted=()):  # the reference: one repair per sequence
        for row in rows:
            original_repair(self, query, committed, [row], batch, [row] if row in drifted else ())

    monkeypatch.setattr(DualLayer, "repair_selection", one_by_one)
    full_out, full_sel = run()
    assert torch.equal(rows_out, full_out)
    assert len(rows_sel) == len(full_sel)
    for (layer_a, idx_a, valid_a, keys_a), (layer_b, idx_b, valid_b, keys_b) in zip(rows_sel, full_sel):
        assert layer_a == layer_b
        assert torch.equal(valid_a, valid_b) and torch.equal(idx_a[valid_a], idx_b[valid_b])
        assert torch.equal(keys_a[valid_a], keys_b[valid_b])
