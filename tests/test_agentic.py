"""Agentic use: a conversation continues on the same cache (no re-prefill of what it holds), a batch of requests
shares one stored prefix, and a cache holds no thread or device memory between requests.

References: transformers' `DynamicCache` passed back the same way (multi-turn), the default cache on the same
batch (shared prefix), `live_host_bytes()` and the thread count (lifecycle)."""

import gc
import threading

import pytest
import torch
from transformers import DynamicCache

from dual_cache import DualDecoderCache
from dual_cache.eval.selection.torch_exact import query_key_logits
from dual_cache.host.memory import live_host_bytes
from dual_cache.selection.selectors import SELECTORS
from tests.conftest import TINY_MODELS, record_selections, six_layer_llama

FULL = {"budget": 4096, "window": 8}


def _turns(seed: int, batch: int = 2, lengths=(60, 17, 9)) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (batch, n), generator=generator) for n in lengths]


def _converse(model, cache, turns, via: str = "past_key_values", **kwargs) -> list[torch.Tensor]:
    sequences, outputs = None, []
    for turn in turns:
        ids = turn if sequences is None else torch.cat([sequences, turn], dim=1)
        sequences = model.generate(ids, max_new_tokens=6, do_sample=False, **{via: cache}, **kwargs)
        outputs.append(sequences)
    return outputs


@pytest.mark.parametrize("name", ["llama", "qwen2-mqa", "gemma3"])
def test_three_turns_at_full_budget_equal_dynamic_cache_passed_back(name):
    model = TINY_MODELS[name](seed=1)
    turns = _turns(2)
    dense = _converse(model, DynamicCache(config=model.config), turns)
    for via in ("past_key_values", "cache"):
        with DualDecoderCache(model.config, **FULL) as cache:
            dual = _converse(model, cache, turns, via=via)
            assert cache.stats()["requests"] == 3
        assert all(torch.equal(a, b) for a, b in zip(dense, dual))


def test_a_returned_cache_continues_and_only_new_tokens_are_prefilled():
    model = six_layer_llama(seed=3)
    turns = _turns(4, batch=1, lengths=(120, 11))
    first = model.generate(turns[0], max_new_tokens=5, do_sample=False, cache_implementation="dual",
                           cache_config=FULL, return_dict_in_generate=True)
    cache = first.past_key_values
    stored = cache.get_seq_length()
    assert stored == first.sequences.shape[1] - 1  # the last generated token is not stored yet
    stored_keys = [layer.host.key_chunks(stored)[0].clone() for layer in cache.dual_layers]
    ids = torch.cat([first.sequences, turns[1]], dim=1)
    calls = []
    forward = model.forward

    def counting(*args, **kwargs):
        calls.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).shape[1])
        return forward(*args, **kwargs)

    model.forward = counting
    try:
        second = model.generate(ids, max_new_tokens=5, do_sample=False, cache=cache)
    finally:
        del model.forward
    assert calls[0] == ids.shape[1] - stored  # the prefill covers the new tokens only
    for layer, keys in zip(cache.dual_layers, stored_keys):  # what was stored is kept, not recomputed
        assert torch.equal(layer.host.key_chunks(stored)[0], keys)
    dense = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(second, dense)
    cache.close()


def test_requests_that_do_not_extend_the_cached_sequences_are_refused_before_any_work():
    model = six_layer_llama(seed=5)
    ids = _turns(6, batch=2, lengths=(50,))[0]
    cache = DualDecoderCache(model.config, **FULL)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, cache=cache)
    host, threads = live_host_bytes(), threading.active_count()
    changed = out.clone()
    changed[1, 10] = (changed[1, 10] + 1) % 90
    cases = [
        (dict(input_ids=torch.cat([changed, ids[:, :3]], 1)), "sequence 1 has token"),
        (dict(input_ids=out[:, :20]), "at least one token"),
        (dict(input_ids=torch.cat([out, out], 0)), "same batch size"),
        (dict(inputs_embeds=torch.randn(2, out.shape[1] + 2, 64)), "not inputs_embeds"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            model.generate(**kwargs, max_new_tokens=3, do_sample=False, cache=cache)
        assert live_host_bytes() == host and threading.active_count() == threads
    # a valid continuation still works after the refusals
    more = model.generate(torch.cat([out, ids[:, :2]], 1), max_new_tokens=2, do_sample=False, cache=cache)
    assert more.shape[1] == out.shape[1] + 4
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        model.generate(torch.cat([more, ids[:, :2]], 1), max_new_tokens=2, cache=cache)


def test_between_requests_a_cache_holds_no_thread_and_no_device_memory():
    model = six_layer_llama(seed=7)
    ids = _turns(8, batch=1, lengths=(90,))[0]
    threads = threading.active_count()
    cache = DualDecoderCache(model.config, budget=8, window=8, early_layers=0, retrieval_threads=2)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, cache=cache)
    assert threading.active_count() == threads
    assert cache.schedule is None and all(layer.ring_keys is None for layer in cache.dual_layers)
    assert cache._device_bytes() == 0 and cache.stats()["device_bytes"] > 0  # what decoding held is reported
    assert cache.stats()["host_bytes"] > 0
    model.generate(torch.cat([out, ids[:, :3]], 1), max_new_tokens=3, do_sample=False, cache=cache)
    assert threading.active_count() == threads
    cache.close()


@pytest.mark.parametrize("conversations", [pytest.param(50, marks=pytest.mark.slow), 8])
def test_closed_and_abandoned_conversations_leave_nothing_behind(conversations):
    model = six_layer_llama(seed=9)
    gc.collect()
    host, threads = live_host_bytes(), threading.active_count()
    for index in range(2 * conversations):
        cache = DualDecoderCache(model.config, budget=8, window=8, early_layers=0, retrieval_threads=1)
        out = model.generate(_turns(index, batch=1, lengths=(40,))[0], max_new_tokens=3, do_sample=False,
                             cache=cache)
        model.generate(torch.cat([out, out[:, :2]], 1), max_new_tokens=2, do_sample=False, cache=cache)
        if index % 2:
            cache.close()
        del cache  # the other half is abandoned without close()
    gc.collect()
    assert live_host_bytes() == host and threading.active_count() == threads


def _shared_batch(seed: int, prefix: int = 200, lengths=(5, 9, 7)):
    """A document `(1, prefix)` and a batch of questions after it, padded between the two (attention mask 0)."""
    generator = torch.Generator().manual_seed(seed)
    document = torch.randint(3, 90, (1, prefix), generator=generator)
    width = max(lengths)
    suffix = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        suffix[row, width - n:] = torch.randint(3, 90, (n,), generator=generator)
        mask[row, width - n:] = 1
    ids = torch.cat([document.expand(len(lengths), -1), suffix], dim=1)
    return document, ids, torch.cat([torch.ones(len(lengths), prefix, dtype=torch.long), mask], dim=1)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
@pytest.mark.parametrize("selector", [name for name, cls in SELECTORS.items() if cls.shares_prefix])
def test_a_batch_sharing_one_stored_prefix_equals_the_default_cache_at_full_budget(name, selector):
    model = TINY_MODELS[name](seed=10)
    document, ids, mask = _shared_batch(11)
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    with DualDecoderCache(model.config, **FULL, selector=selector) as cache:
        model.generate(document, max_new_tokens=1, do_sample=False, cache=cache)  # the prefill of the document
        one = cache.stats()["host_bytes"]
        shared = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache=cache)
        assert torch.equal(shared, dense)
        # the document is stored once: what the batch added is each question's own positions
        own_tokens = cache.get_seq_length() - document.shape[1]
        layers = len(cache.dual_layers)
        per_token = 2 * cache.kv_heads * cache.head_dim * 4  # K and V, fp32, one sequence
        assert cache.stats()["host_bytes"] - one < 3 * layers * per_token * (own_tokens + 64) * 2


def test_a_shared_prefix_at_partial_budget_selects_per_sequence_with_repairs():
    model = six_layer_llama(seed=12)
    document, ids, mask = _shared_batch(13, prefix=400, lengths=(6, 12, 9))
    options = {"budget": 16, "window": 8, "early_layers": 0, "miss_repair": True}
    with DualDecoderCache(model.config, **options) as cache:
        model.generate(document, max_new_tokens=1, do_sample=False, cache=cache)
        recorded = record_selections(cache)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=cache)
        assert out.shape == (3, ids.shape[1] + 6) and cache.stats()["repairs"] > 0
    _, indices, valid, _ = recorded[-1]
    rows = [set(indices[b][valid[b]].tolist()) for b in range(3)]
    assert rows[0] != rows[1] or rows[1] != rows[2]  # each request chooses its own entries
    with DualDecoderCache(model.config, **options, selector="quest", block_size=4) as cache:  # pages per sequence
        model.generate(document, max_new_tokens=1, do_sample=False, cache=cache)
        with pytest.raises(ValueError, match="cannot share"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, cache=cache)


def test_a_shared_prefix_with_the_2bit_index_answers_as_each_sequence_with_its_own_copy():
    """lowbit copies the prefix's index to every sequence on `share`: a batch continuing one stored document
    decodes the same tokens as the same batch with the document stored per sequence (partial budget)."""
    model = six_layer_llama(seed=17)
    document, ids, mask = _shared_batch(18, prefix=400, lengths=(6, 12, 9))
    options = {"budget": 16, "window": 8, "early_layers": 0, "selector": "lowbit", "lowbit_factor": 2}
    with DualDecoderCache(model.config, **options) as cache:
        model.generate(document, max_new_tokens=1, do_sample=False, cache=cache)
        shared = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=cache)
        copied = cache.stats()["host_bytes"]
    with DualDecoderCache(model.config, **options) as cache:
        alone = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, cache=cache)
        assert copied < cache.stats()["host_bytes"]  # the document's K/V are stored once
    assert torch.equal(shared, alone)


@pytest.mark.parametrize("seed", [14, 15])
def test_queries_of_every_sequence_against_shared_keys_equal_per_sequence_products(seed):
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(1, 2, 50, 8, generator=generator)
    own = torch.randn(3, 2, 20, 8, generator=generator)
    query = torch.randn(3, 6, 8, generator=generator)
    got = query_key_logits(query, [shared, own])
    for row in range(3):
        expected = query_key_logits(query[row : row + 1], [shared, own[row : row + 1]])
        torch.testing.assert_close(got[row : row + 1], expected)


def test_a_short_prompt_holds_about_what_it_stores():
    model = six_layer_llama(seed=16)
    cache = DualDecoderCache(model.config, budget=8, window=8)
    model.generate(torch.randint(3, 90, (1, 57)), max_new_tokens=4, do_sample=False, cache=cache)
    stats = cache.stats()
    kv = stats["dense_equivalent_bytes"]
    assert stats["host_bytes"] <= 2 * kv  # store chunks sized to the prompt, then small steps
    cache.close()


def test_a_continuation_may_not_change_the_mask_of_leading_pads_or_sink_tokens():
    """Later held positions may become padding (a generated token equal to `pad_token_id`), as with the default
    cache; the sink and the leading pads are fixed by the first request, so changing them is refused."""
    model = six_layer_llama(seed=19)
    ids = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(20))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with DualDecoderCache(model.config, budget=16, window=8) as cache:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache=cache)
        longer = torch.cat([out, torch.randint(3, 90, (2, 4))], dim=1)
        extended = torch.cat([mask, torch.ones(2, longer.shape[1] - 40, dtype=torch.long)], dim=1)
        for row, position in [(1, 1), (0, 0), (1, 4)]:  # a leading pad made real; sink tokens made padding
            bad = extended.clone()
            bad[row, position] = 1 - bad[row, position]
            with pytest.raises(ValueError, match=f"position {position} of sequence {row}"):
                model.generate(longer, attention_mask=bad, max_new_tokens=2, cache=cache)
        later = extended.clone()
        later[0, 30] = 0  # past the sink: applied as the default cache applies it
        model.generate(longer, attention_mask=later, max_new_tokens=2, do_sample=False, cache=cache)


def test_a_conversation_continues_from_an_earlier_point_after_a_crop():
    """Between requests a crop lets a conversation continue from an earlier point (regenerate a reply), as with the
    default cache; a crop that would remove the sink, or that a sliding window already passed cannot serve, is
    refused before any work."""
    model = TINY_MODELS["llama"](seed=5)
    turns = _turns(6, batch=2, lengths=(40, 9))

    def regenerate(cache):
        first = model.generate(turns[0], max_new_tokens=8, do_sample=False, past_key_values=cache)
        cache.crop(-5)  # forget the last 5 stored tokens: the reply's tail
        kept = first[:, : cache.get_seq_length()]
        return model.generate(torch.cat([kept, turns[1]], 1), max_new_tokens=6, do_sample=False,
                              past_key_values=cache)

    with DualDecoderCache(model.config, **FULL) as cache:
        assert torch.equal(regenerate(cache), regenerate(DynamicCache(config=model.config)))
        with pytest.raises(ValueError, match="sink"):
            cache.crop(-(cache.get_seq_length() - 2))
    gemma = TINY_MODELS["gemma3"](seed=5)  # window 24, passed by a 40-token prompt
    with DualDecoderCache(gemma.config, **FULL) as cache:
        gemma.generate(turns[0], max_new_tokens=3, do_sample=False, cache=cache)
        stored = cache.get_seq_length()
        with pytest.raises(ValueError, match="sliding-window layer past its window"):
            cache.crop(-2)
        assert cache.get_seq_length() == stored  # refused before anything changed


def test_a_cache_of_another_attention_layout_is_refused_before_any_work():
    """Same layers, KV heads and head_dim are not enough: a cache built for another sliding window or other layer
    types would keep the wrong tokens (wrong answers) or fail inside attention."""
    from tests.conftest import tiny_gemma3

    model = tiny_gemma3()
    ids = torch.randint(3, 90, (1, 30), generator=torch.Generator().manual_seed(2))
    other_window = model.config.__class__(**{**model.config.to_dict(), "sliding_window": 16})
    all_full = model.config.__class__(**{**model.config.to_dict(), "layer_types": ["full_attention"] * 4})
    for config, message in ((other_window, "sliding_window=16"), (all_full, "full_attention', 'full_attention'")):
        cache = DualDecoderCache(config, **FULL)
        with pytest.raises(ValueError, match=message):
            model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)
        assert cache.stats()["requests"] == 0
        cache.close()


def test_crop_refuses_a_positive_count_with_its_own_error_past_a_sliding_window():
    from tests.conftest import tiny_gemma3

    model = tiny_gemma3()
    cache = DualDecoderCache(model.config, **FULL)
    model.generate(torch.randint(3, 90, (1, 30)), max_new_tokens=4, do_sample=False, cache=cache)
    with pytest.raises(ValueError, match="pass a negative count"):
        cache.crop(3)
    cache.close()


def test_generate_leaves_no_thread_behind_in_a_fresh_process():
    """Not even tqdm's monitor thread (a disabled prefill bar would start it once per process)."""
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import threading, torch\n"
        "from tests.conftest import tiny_llama\n"
        "model = tiny_llama()\n"
        "model.generate(torch.randint(3, 90, (1, 40)), max_new_tokens=4, do_sample=False,\n"
        "               cache_implementation='dual', cache_config={'budget': 8, 'retrieval_threads': 1})\n"
        "print(sorted(t.name for t in threading.enumerate()))\n"
    )
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "['MainThread']", run.stdout
