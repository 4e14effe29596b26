"""The retrieval/transfer pipeline (issue 3): ordering under random delays, memory independence from context,
lifecycle on every exit path, the host capacity check, telemetry."""

import gc
import json
import random
import sys
import threading
import time

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from dual_cache import DualDecoderCache, HostMemoryError
from dual_cache.host.memory import live_host_bytes
from dual_cache.selection.selectors.base import Selector
from tests.conftest import record_selections, six_layer_llama


def _prompt(seed: int, length: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def delayed_retrieval(monkeypatch):
    """Random 0–4 ms delays before every retrieval job (on the retriever thread when there is one), to shake out
    ordering bugs."""
    rng = random.Random(1234)
    make_job = Selector.job
    delayed = []

    def slow_job(self, *args, **kwargs):
        run = make_job(self, *args, **kwargs)

        def slow_run():
            delayed.append(1)
            time.sleep(rng.random() * 0.004)
            return run()

        return slow_run

    monkeypatch.setattr(Selector, "job", slow_job)
    return delayed


@pytest.mark.parametrize("layers_in_flight, lookahead", [(1, 0), (2, 1), (3, 2), (6, 5)])
def test_pipeline_equals_synchronous_reference(delayed_retrieval, layers_in_flight, lookahead):
    model = six_layer_llama(seed=40)
    ids = _prompt(41, 160, batch=2)
    base = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 20,
            "layer_budgets": {4: 0}}
    runs = {}
    for name, options in (
        ("sync", {"retrieval_threads": 0, "layers_in_flight": 1, "lookahead": 0}),
        ("pipelined", {"retrieval_threads": 1, "layers_in_flight": layers_in_flight, "lookahead": lookahead}),
    ):
        cache = DualDecoderCache(model.config, **base, **options)
        recorded = record_selections(cache)
        tokens = model.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
        runs[name] = (tokens, recorded, cache.stats())
    (sync_tokens, sync_sel, _), (pipe_tokens, pipe_sel, pipe_stats) = runs["sync"], runs["pipelined"]
    assert torch.equal(sync_tokens, pipe_tokens)
    assert len(sync_sel) == len(pipe_sel) == 11 * 5  # 11 decode steps × 5 retrieving layers (layer 4 has none)
    for (layer_a, idx_a, ok_a, keys_a), (layer_b, idx_b, ok_b, keys_b) in zip(sync_sel, pipe_sel):
        assert layer_a == layer_b
        assert torch.equal(idx_a[ok_a], idx_b[ok_b]) and torch.equal(keys_a[ok_a], keys_b[ok_b])
    assert pipe_stats["steps"] == 11
    assert len(delayed_retrieval) >= 2 * 11 * 5  # every job of both runs went through the delay


def test_device_bytes_do_not_depend_on_context_length():
    model = six_layer_llama(seed=42)
    options = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, "layers_in_flight": 2, "lookahead": 1}
    device = {}
    for length in (1024, 8192):
        cache = DualDecoderCache(model.config, **options)
        model.generate(_prompt(43, length), max_new_tokens=3, do_sample=False, cache=cache)
        device[length] = cache.stats()["device_bytes"]
    # hand computation, fp32, batch 1, 2 KV heads, head_dim 16: per layer sink (4) + ring (8 + 2) K/V entries and a
    # resident set of 3 × 16 entries per KV head (the default resident_factor × budget: K, V, int64 position); pool:
    # 2 delta buffers of 2 KV heads × 32 rows (the budget 16 fetched + 16 next positions: the most one step copies)
    # × (K, V, int64 slot, int64 position)
    kv_entry = 2 * 2 * 16 * 4  # K and V of one token over both KV heads
    resident = 48 * (kv_entry + 2 * 8)
    rows = 2 * (16 + 16)
    expected = 6 * ((4 + 10) * kv_entry + resident) + 2 * rows * (2 * 16 * 4 + 8 + 8)
    assert device[1024] == device[8192] == expected


class _Boom(BaseStreamer):
    def __init__(self, after: int, error: BaseException):
        self.count, self.after, self.error = 0, after, error

    def put(self, value):
        self.count += 1
        if self.count > self.after:
            raise self.error

    def end(self):
        pass


class _StopAt(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def test_fifty_generate_calls_leave_threads_and_host_bytes_at_baseline():
    model = six_layer_llama(seed=44)
    options = {"budget": 8, "window": 8, "early_layers": 0, "retrieval_threads": 1, "host_chunk_tokens": 64}
    gc.collect()
    threads, host = threading.active_count(), live_host_bytes()
    for call in range(50):
        ids = _prompt(100 + call, 40 + call % 7)
        kind = call % 5
        if kind == 0:
            with pytest.raises(RuntimeError, match="streamer failed"):
                model.generate(ids, max_new_tokens=8, streamer=_Boom(3, RuntimeError("streamer failed")),
                               cache_implementation="dual", cache_config=options)
        elif kind == 1:
            with pytest.raises(KeyboardInterrupt):
                model.generate(ids, max_new_tokens=8, streamer=_Boom(2, KeyboardInterrupt()),
                               cache_implementation="dual", cache_config=options)
        elif kind == 2:
            out = model.generate(ids, max_new_tokens=8, stopping_criteria=StoppingCriteriaList([_StopAt(ids.shape[1] + 2)]),
                                 cache_implementation="dual", cache_config=options)
            assert out.shape[1] == ids.shape[1] + 2
        else:
            model.generate(ids, max_new_tokens=4, do_sample=kind == 4, cache_implementation="dual",
                           cache_config=options)
        assert live_host_bytes() == host  # released on every exit path, before garbage collection
    gc.collect()
    assert threading.active_count() == threads
    assert live_host_bytes() == host


@pytest.mark.parametrize("selector", ["exact", "lowbit"])
def test_host_capacity_check_raises_before_allocating(selector):
    model = six_layer_llama(seed=45)
    ids = _prompt(46, 300, batch=2)
    host = live_host_bytes()
    config = {"host_chunk_tokens": 128, "selector": selector}
    # what a request allocates on the host, measured by the process-wide accounting of every host store and index
    out = model.generate(ids, max_new_tokens=8, cache_implementation="dual", return_dict_in_generate=True,
                         cache_config=config)
    allocated = live_host_bytes() - host
    dense = out.cache.stats()["dense_equivalent_bytes"]  # a first request's stores are sized to it at once: only the
    assert dense < allocated <= 1.1 * dense  # speculated token's slot and the index (7.8% of K/V for lowbit) beyond
    assert out.cache.stats()["host_bytes"] == allocated
    out.cache.close()
    assert live_host_bytes() == host
    threads = threading.active_count()  # (tqdm starts its monitor thread once per process)
    with pytest.raises(HostMemoryError, match="max_host_bytes") as error:
        model.generate(ids, max_new_tokens=8, cache_implementation="dual",
                       cache_config={**config, "max_host_bytes": allocated - 1})
    assert f"{allocated:,} bytes" in str(error.value)  # the check predicts the allocation exactly, before it
    assert live_host_bytes() == host and threading.active_count() == threads
    out = model.generate(ids, max_new_tokens=8, cache_implementation="dual", return_dict_in_generate=True,
                         cache_config={**config, "max_host_bytes": allocated})
    assert out.cache.stats()["host_bytes"] == allocated


def test_chunked_host_store_and_timeline(tmp_path):
    model = six_layer_llama(seed=47)
    ids = _prompt(48, 150)
    common = {"budget": 16, "window": 8, "early_layers": 0}
    whole = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="dual",
                           cache_config=common)
    cache = DualDecoderCache(model.config, **common, host_chunk_tokens=32, record_timeline=True,
                             retrieval_threads=1, layers_in_flight=3, lookahead=2)
    chunked = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache)
    assert torch.equal(whole, chunked)
    stats = cache.stats()
    assert stats["steps"] == 9
    sync = DualDecoderCache(model.config, **common, retrieval_threads=0)
    model.generate(ids, max_new_tokens=10, do_sample=False, cache=sync)
    assert sync.stats()["overlap_ratio"] == 0.0  # the synchronous path waits for all of its host work
    timeline = cache.timeline()
    assert len(timeline) == 9 * 6
    for record in timeline:
        assert record["retrieval_start"] <= record["retrieval_end"]
        assert record["copy_start"] <= record["copy_end"] <= record["attention_start"] <= record["attention_end"]
        assert record["bytes"] > 0 and record["slot"] in (0, 1, 2)
    # copies issued ahead (lookahead 2) for a step that never ran are counted in bytes_copied only
    unused = stats["bytes_copied"] - sum(r["bytes"] for r in timeline)
    assert 0 <= unused <= 2 * max(r["bytes"] for r in timeline)
    from dual_cache.eval.throughput.pipeline_timeline import summarize

    layers = summarize(timeline, skip_steps=1)
    assert [row["layer"] for row in layers] == list(range(6))
    assert all(row["retrieval_ms"] >= 0 and row["bytes"] > 0 for row in layers)
    cache.dump_timeline(tmp_path / "timeline.json")
    dumped = json.loads((tmp_path / "timeline.json").read_text())
    assert dumped["stats"]["steps"] == 9 and len(dumped["timeline"]) == 9 * 6


def test_quest_baseline_full_budget_matches_dense_and_counts_page_metadata():
    model = six_layer_llama(seed=49)
    ids = _prompt(50, 120)
    dense = model.generate(ids, max_new_tokens=10, do_sample=False)
    full = {"selector": "quest", "block_size": 16, "budget": 128, "window": 8, "speculator": "none"}
    out = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="dual",
                         cache_config=full, return_dict_in_generate=True)
    assert torch.equal(dense, out.sequences)
    partial = {**full, "budget": 32, "early_layers": 0}
    out = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="dual",
                         cache_config=partial, return_dict_in_generate=True)
    streaming = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="dual",
                               cache_config={**partial, "budget": 0, "selector": "exact"},
                               return_dict_in_generate=True)
    pages = -(-(120 + 9) // 16)
    metadata = 6 * 2 * 2 * pages * 16 * 4  # layers × (min, max) × KV heads × pages × head_dim × fp32
    # each layer's resident set holds exactly its 32 selected entries per KV head (K, V, int64 position); the pool: 2
    # delta buffers of 2 KV heads × 32 rows (K, V, int64 slot, int64 position)
    resident = 6 * 2 * 32 * (2 * 16 * 4 + 8)
    pool = 2 * 2 * 32 * (2 * 16 * 4 + 16)
    assert out.cache.stats()["device_bytes"] == streaming.cache.stats()["device_bytes"] + metadata + resident + pool


def test_gpu_check_script_correctness_part_runs_on_cpu():
    from dual_cache.eval.gpu_check import check_correctness

    results = check_correctness(torch.device("cpu"), tiny=True)
    assert len(results) == 4 and all(r["passed"] for r in results), results


@pytest.fixture
def nan_filled_buffers(monkeypatch):
    """Every float buffer dual_cache allocates with `torch.empty` starts as NaN (bool buffers True), as memory that
    an earlier request freed may: nothing the cache has not written may reach attention."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = empty(*args, **kwargs)
        if sys._getframe(1).f_globals.get("__name__", "").startswith("dual_cache"):
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
            elif tensor.dtype == torch.bool:
                tensor.fill_(True)
        return tensor

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.mark.parametrize("length, budget", [(20, 100_000), (20, 12), (160, 100_000), (160, 12)])
def test_memory_the_cache_never_wrote_never_reaches_attention(nan_filled_buffers, length, budget):
    """Prompts shorter than sink + window (no position to select: every selection slot unused) and longer ones, in a
    left-padded batch, at full and partial budget, with and without a retrieval thread."""
    model = six_layer_llama(seed=42)
    ids = _prompt(43, length, batch=2)
    mask = torch.ones_like(ids)
    mask[1, : length // 3] = 0
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    for threads in (0, 1):
        cache = DualDecoderCache(model.config, budget=budget, n_sink=4, window=32, retrieval_threads=threads)
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache=cache)
        if budget == 100_000:
            assert torch.equal(tokens, dense)
        else:
            reference = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                       cache=DualDecoderCache(model.config, budget=budget, n_sink=4, window=32,
                                                              retrieval_threads=0))
            assert torch.equal(tokens, reference)
