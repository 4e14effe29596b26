"""The decode step's host synchronization points (issues 41 and 57): a step waits for the device at most twice,
whatever the number of layers, the batch, the speculation's misses and greedy or sampled decoding. Counted on CPU
with `SyncCounter` (scalar reads, `bool(tensor)`, `nonzero`, blocking reads through `streams.to_host`, host waits on
events) on the launching thread; retrieval runs on a worker thread, as on CUDA. The synchronous miss-repair option
waits per repaired layer; its steady state (every guess a hit: `ForcedMissCache(miss_rate=0)`) does not."""

from __future__ import annotations

import pytest
import torch

from dual_cache.eval.throughput.forced_miss import ForcedMissCache
from dual_cache.runtime.sync_points import SyncCounter

OPTIONS = {"budget": 16, "window": 8, "early_layers": 0, "retrieval_threads": 1}


def _model(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=None, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def per_step(model, make_cache, short: int = 4, long: int = 12, batch: int = 2, **sampling) -> dict[str, float]:
    """Synchronization points per decode step by operation: the difference between a `long` and a `short`
    generation (the prefill, the first step and the request's set-up cancel out), per extra step."""
    ids = torch.randint(3, 90, (batch, 120), generator=torch.Generator().manual_seed(1))
    sampling = sampling or {"do_sample": False}
    counts = []
    for new in (short, long):
        cache = make_cache()
        torch.manual_seed(0)
        with SyncCounter() as counter:
            model.generate(ids, max_new_tokens=new, **sampling, **cache)
        counts.append(counter.by_op)
    ops = set(counts[0]) | set(counts[1])
    return {op: (counts[1][op] - counts[0][op]) / (long - short) for op in ops if counts[1][op] != counts[0][op]}


@pytest.mark.parametrize("batch", [1, 8, 32])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_a_step_waits_at_most_twice_whatever_the_batch_the_misses_and_the_layer_count(batch, sample):
    """The library defaults (retrieval on a worker, the real token's re-rank on the device): on random weights
    nearly every speculated token misses, and a request's first step is one too, yet no layer waits for the host."""
    totals = {}
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {"do_sample": False}
    for layers in (4, 32):
        model = _model(layers)
        counts = per_step(model, lambda: {"cache_implementation": "dual", "cache_config": OPTIONS}, batch=batch,
                          **sampling)
        totals[layers] = sum(counts.values())
        assert totals[layers] <= 2, (layers, counts)
    assert totals[4] == totals[32]


def test_steady_state_with_synchronous_repair_waits_at_most_twice():
    """The synchronous miss-repair option, every guess a hit (`ForcedMissCache(miss_rate=0)`): no layer waits."""
    totals = {}
    for layers in (4, 32):
        model = _model(layers)
        counts = per_step(model, lambda: {"cache": ForcedMissCache(model.config, miss_rate=0.0, **OPTIONS)})
        totals[layers] = sum(counts.values())
        assert totals[layers] <= 2, (layers, counts)
    assert totals[4] == totals[32]


def test_the_default_cache_is_counted_alike():
    """The reference: transformers' own loop reads one flag per step (`unfinished.max() == 0`)."""
    model = _model(4)
    assert per_step(model, dict) == {"bool(Tensor)": 1.0}


def test_a_repaired_step_waits_per_layer():
    """What steady state avoids: a step that repairs a miss waits for the host in each layer that repairs (the real
    token's query must reach the host before that layer's attention)."""
    counts = {}
    for layers in (4, 8):
        model = _model(layers)
        counts[layers] = sum(per_step(model, lambda: {"cache": ForcedMissCache(
            model.config, miss_rate=1.0, **OPTIONS)}).values())
    assert counts[8] > counts[4] >= 4


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_a_requests_first_decode_step_waits_at_most_twice_too(sample):
    """The first decode step (no speculated token has chosen its entries yet: every row continues its prompt's
    last query's selection) counted on its own, between the first and the second generated token at batch 8: no
    layer waits for the host, at 4 layers as at 32."""
    from transformers.generation.streamers import BaseStreamer

    class Marks(BaseStreamer):
        def __init__(self, counter):
            self.counter, self.totals = counter, []

        def put(self, value):
            self.totals.append(self.counter.total)

        def end(self):
            pass

    ids = torch.randint(3, 90, (8, 120), generator=torch.Generator().manual_seed(2))
    sampling = {"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {"do_sample": False}
    first = {}
    for layers in (4, 32):
        model = _model(layers)
        torch.manual_seed(0)
        with SyncCounter() as counter:
            marks = Marks(counter)
            model.generate(ids, max_new_tokens=3, streamer=marks, cache_implementation="dual",
                           cache_config=OPTIONS, **sampling)
        # puts: the prompt, the token from the prefill's logits, the token of the first decode step
        first[layers] = marks.totals[2] - marks.totals[1]
        assert first[layers] <= 2, (layers, first)
    assert first[4] == first[32]
