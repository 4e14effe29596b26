"""generate() with the dual cache on tiny random-weight Llama, Qwen2 (MQA) and Gemma-3-style models."""

import threading

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from dual_cache import DualDecoderConfig, DualDecoderCache
from dual_cache.eval.attention_observer import observe_attention
from tests.conftest import TINY_MODELS, tiny_llama

FULL = {"budget": 4096, "n_sink": 4, "window": 16}


def _prompt(seed, length, vocab=96, batch=1):
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
@pytest.mark.parametrize("speculator", ["self", "none"])
def test_full_budget_equals_dynamic_cache_greedy(name, speculator):
    model = TINY_MODELS[name](seed=11)
    ids = _prompt(12, 300)
    dense = model.generate(ids, max_new_tokens=40, do_sample=False)
    dual = model.generate(
        ids, max_new_tokens=40, do_sample=False, cache_implementation="dual",
        cache_config={**FULL, "speculator": speculator, "prefill_chunk_size": 128},
    )
    assert torch.equal(dense, dual)


def test_explicit_cache_object_and_sync_reference_path_match():
    model = tiny_llama(seed=13)
    ids = _prompt(14, 200)
    dense = model.generate(ids, max_new_tokens=30, do_sample=False)
    cache = DualDecoderCache(model.config, budget=4096, window=8)
    assert torch.equal(model.generate(ids, max_new_tokens=30, do_sample=False, cache=cache), dense)
    partial = {"budget": 24, "n_sink": 2, "window": 8, "early_layers": 0}
    threaded = model.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="dual",
                              cache_config={**partial, "retrieval_threads": 1})
    sync = model.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="dual",
                          cache_config={**partial, "retrieval_threads": 0})
    assert torch.equal(threaded, sync)


def test_left_padded_batch_matches_single_prompt():
    model = tiny_llama(seed=15)
    short, long = _prompt(16, 120), _prompt(17, 260)
    pad = torch.zeros(1, 140, dtype=torch.long)
    batch = torch.cat([torch.cat([pad, short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 140), torch.ones(1, 120)], 1), torch.ones(1, 260)]).long()
    for config in (FULL, {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0}):
        kwargs = dict(max_new_tokens=25, do_sample=False, cache_implementation="dual",
                      cache_config={**config, "retrieval_threads": 0}, return_dict_in_generate=True)
        alone = model.generate(short, **kwargs)
        both = model.generate(batch, attention_mask=mask, **kwargs)
        assert torch.equal(alone.sequences[0, 120:], both.sequences[0, 260:])
    dense = model.generate(short, max_new_tokens=25, do_sample=False)
    assert torch.equal(dense[0, 120:], model.generate(batch, attention_mask=mask, max_new_tokens=25,
                       do_sample=False, cache_implementation="dual", cache_config=FULL)[0, 260:])


@pytest.mark.parametrize("selector", [{}, {"selector": "oracle"}, {"selector": "lowbit", "lowbit_factor": 2}])
def test_partial_budget_selections_identical_alone_and_in_padded_batch(selector):
    model = tiny_llama(seed=18)
    short, long = _prompt(19, 100), _prompt(20, 177)
    batch = torch.cat([torch.cat([torch.zeros(1, 77, dtype=torch.long), short], 1), long])  # 77: not a multiple of 64
    mask = torch.cat([torch.cat([torch.zeros(1, 77), torch.ones(1, 100)], 1), torch.ones(1, 177)]).long()
    selections, tokens = {}, {}
    for key, ids, attn in (("alone", short, None), ("batch", batch, mask)):
        cache = DualDecoderCache(model.config, budget=12, n_sink=4, window=8, retrieval_threads=1, early_layers=0,
                                 **selector)
        recorded = []

        def record(layer, query, scaling, step, recorded=recorded):
            if layer.layer_idx != 1:
                return
            segments = step.segments
            shape = (query.shape[0], segments[0].keys.shape[1])
            positions = torch.cat([s.positions.expand(*shape, s.keys.shape[2]) for s in segments], 2)
            valid = torch.cat([s.valid.expand(*shape, s.keys.shape[2]) for s in segments], 2)
            # row 0 (the short prompt) attended positions, per KV head, in ascending order (heads may attend to
            # different numbers of resident entries)
            recorded.append([positions[0, h][valid[0, h]].sort().values for h in range(shape[1])])

        observe_attention(cache, record)
        tokens[key] = model.generate(ids, attention_mask=attn, max_new_tokens=10, do_sample=False, cache=cache)[0, -10:]
        selections[key] = recorded
    assert len(selections["alone"]) == len(selections["batch"]) > 0
    if selector.get("selector") == "oracle":
        # the oracle ranks by the real token's query, which the model computes in a different batch shape: the
        # CPU's matmul kernels (AVX-512 vs AVX2) round it differently, so a near-tie at the budget's edge may swap
        # one position; the padding itself must move nothing else
        same = sum(len(set((a[h] + 77).tolist()) & set(b[h].tolist()))
                   for a, b in zip(selections["alone"], selections["batch"]) for h in range(len(a)))
        assert same >= 0.99 * sum(head.numel() for a in selections["alone"] for head in a)
    else:
        for alone, batched in zip(selections["alone"], selections["batch"]):
            assert all(torch.equal(a + 77, b) for a, b in zip(alone, batched))
    assert torch.equal(tokens["alone"], tokens["batch"])


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_seeded_sampling_at_full_budget_equals_the_default_cache(name):
    """The dual loop samples as transformers' own loop does: the same processors (temperature, top-k, top-p,
    repetition penalty) and the same random draws, so a seeded run at full budget gives the default cache's tokens,
    for a left-padded batch too."""
    model = TINY_MODELS[name](seed=21)
    ids = _prompt(22, 150, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=30, do_sample=True, temperature=0.8, top_k=20, top_p=0.9,
                  repetition_penalty=1.2)
    torch.manual_seed(5)
    dense = model.generate(ids, **kwargs)
    torch.manual_seed(5)
    uncoupled = {**FULL, "coupled_sampling": False}  # the default cache's random draws (multinomial)
    dual = model.generate(ids, **kwargs, cache_implementation="dual", cache_config=uncoupled)
    assert torch.equal(dense, dual)
    torch.manual_seed(6)
    assert not torch.equal(model.generate(ids, **kwargs), dense)  # the seed matters: the comparison can fail


def test_sampling_is_reproducible_and_processors_apply():
    model = tiny_llama(seed=21)
    ids = _prompt(22, 150)
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2,
                  cache_implementation="dual", cache_config={"budget": 32, "window": 8, "early_layers": 0})
    torch.manual_seed(5)
    first = model.generate(ids, **kwargs)
    torch.manual_seed(5)
    second = model.generate(ids, **kwargs)
    assert torch.equal(first, second)

    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 7] = float("-inf")
            return scores

    out = model.generate(ids, max_new_tokens=20, do_sample=False, logits_processor=LogitsProcessorList([Ban()]),
                         cache_implementation="dual", cache_config={"budget": 32, "window": 8, "early_layers": 0})
    assert 7 not in out[0, 150:].tolist()


def test_streamer_stopping_criteria_eos_and_scores():
    model = tiny_llama(seed=23)
    ids = _prompt(24, 120)
    received = []

    class Collect(BaseStreamer):
        def put(self, value):
            received.append(value.clone())

        def end(self):
            received.append("end")

    out = model.generate(ids, max_new_tokens=15, do_sample=False, streamer=Collect(), return_dict_in_generate=True,
                         output_scores=True, output_logits=True, cache_implementation="dual",
                         cache_config={"budget": 32, "window": 8, "early_layers": 0})
    new = out.sequences[0, 120:]
    assert torch.equal(received[0], ids)
    assert [int(t) for t in received[1:-1]] == new.tolist() and received[-1] == "end"
    assert len(out.scores) == len(out.logits) == len(new) == 15
    stats = out.cache.stats()
    assert 0 <= stats["spec_hits"] <= stats["spec_steps"] == 14
    assert stats["seq_length"] == 120 + 14
    # at 134 tokens the resident sets (4 × 32 entries per KV head) can hold the whole context: the device holds about
    # what a dense cache would, plus the delta buffers
    assert 0 < stats["device_bytes"] < 2 * stats["dense_equivalent_bytes"]

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 125, dtype=torch.bool)

    short = model.generate(ids, max_new_tokens=15, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter()]),
                           cache_implementation="dual", cache_config={"budget": 32, "window": 8, "early_layers": 0})
    assert short.shape[1] == 125
    eos = int(new[3])
    stopped = model.generate(ids, max_new_tokens=15, do_sample=False, eos_token_id=eos, pad_token_id=0,
                             cache_implementation="dual", cache_config={"budget": 32, "window": 8, "early_layers": 0})
    assert stopped[0, -1] == eos and stopped.shape[1] <= 124


def test_crop_and_seq_length():
    model = tiny_llama(seed=25)
    cache = DualDecoderCache(model.config, budget=8, window=4)
    model.generate(_prompt(26, 30), max_new_tokens=1, cache=cache)  # stores the prompt (a cache fills in generate())
    assert cache.get_seq_length() == 30
    cache.crop(-3)
    assert cache.get_seq_length() == 27
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_beams": 2}, "beam"),
        ({"prompt_lookup_num_tokens": 3}, "assisted"),
        ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
    ],
)
def test_unsupported_generation_modes_raise_before_work(kwargs, message):
    model = tiny_llama(seed=27)
    threads = threading.active_count()
    with pytest.raises(ValueError, match=message):
        model.generate(_prompt(28, 40), max_new_tokens=5, cache_implementation="dual", **kwargs)
    with pytest.raises(ValueError, match=message):
        model.generate(_prompt(28, 40), max_new_tokens=5, cache=DualDecoderCache(model.config), **kwargs)
    assert threading.active_count() == threads


def test_bad_cache_config_and_reuse_raise():
    model = tiny_llama(seed=29)
    with pytest.raises(ValueError, match="Unknown dual cache option"):
        model.generate(_prompt(30, 20), max_new_tokens=3, cache_implementation="dual", cache_config={"budgett": 1})
    with pytest.raises(ValueError, match="layer_budgets"):
        DualDecoderCache(model.config, layer_budgets={7: 16})
    cache = DualDecoderCache(model.config, budget=8)
    model.generate(_prompt(30, 20), max_new_tokens=3, cache=cache)
    with pytest.raises(ValueError, match="must extend"):  # reuse continues the cached sequences, or is refused
        model.generate(_prompt(30, 20), max_new_tokens=3, cache=cache)


def test_other_cache_implementations_untouched():
    model = tiny_llama(seed=31)
    ids = _prompt(32, 50)
    out = model.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert type(out.cache).__name__ == "DynamicCache"
    assert model.config._attn_implementation != "dual"
    import dual_cache

    dual_cache.register()  # idempotent
    from transformers.generation import configuration_utils

    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS.count("dual") == 1


@pytest.mark.parametrize("selector", ["exact", "lowbit"])
def test_host_store_is_sized_to_the_request(selector):
    """A 6,000-token prompt with 32 new tokens: the host store holds about what a dense cache would (the first chunk
    is prompt + max_new_tokens when generate() knows it), not a geometric over-allocation; the 2-bit index adds its
    own share on top for `lowbit`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
    model = LlamaForCausalLM(config).eval()
    with DualDecoderCache(model.config, budget=64, selector=selector) as cache:
        model.generate(_prompt(5, 6000), max_new_tokens=32, do_sample=False, cache=cache)
        stats = cache.stats()
        store = sum(layer.host.nbytes for layer in cache.dual_layers)
    assert store <= 1.05 * stats["dense_equivalent_bytes"]
    if selector == "exact":
        assert stats["host_bytes"] <= 1.05 * stats["dense_equivalent_bytes"]


def _attended(monkeypatch, model, ids, config) -> list[tuple[int, int, list[int]]]:
    """`(committed, query position, attended positions)` of sequence 0, KV head 0, for every decode query of every
    full-attention layer, read from the segments handed to the decode attention."""
    import dual_cache.layer.attention as attention

    seen = []
    original = attention.sparse_decode_attention

    def spy(query, segments, query_positions, scaling, **kwargs):
        positions = torch.cat([s.positions.expand(*s.keys.shape[:3]) for s in segments], dim=2)[0, 0]
        valid = torch.cat([s.valid.expand(*s.keys.shape[:3]) for s in segments], dim=2)[0, 0]
        committed = int(query_positions[0])
        for position in query_positions.tolist():  # causal: the speculated slot also sees slot 0
            seen.append((committed, position, sorted(positions[valid & (positions <= position)].tolist())))
        return original(query, segments, query_positions, scaling, **kwargs)

    monkeypatch.setattr(attention, "sparse_decode_attention", spy)
    model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="dual", cache_config=config)
    monkeypatch.setattr(attention, "sparse_decode_attention", original)
    return seen


def test_each_decode_query_attends_sink_budget_window_and_its_own_step(monkeypatch):
    """What attention reads in decode, per (sequence, KV head): the sink, the middle positions of its resident set
    (`budget` of them re-ranked by the real query with `resident_attention="rerank"`; with `"all"` every resident
    one: at least the budget, at most the set's capacity), the last `window` committed positions and the step's
    causal new tokens, each once, whatever the context; with a budget covering the context, every position."""
    model = tiny_llama(seed=27)
    n_sink, window, budget = 4, 8, 12
    config = {"budget": budget, "n_sink": n_sink, "window": window, "early_layers": 0}
    for context, attend in ((90, "rerank"), (200, "rerank"), (200, "all")):
        seen = _attended(monkeypatch, model, _prompt(28, context), {**config, "resident_attention": attend})
        assert len(seen) == 5 * 3 * 2  # decode steps × layers × (real, speculated)
        for committed, position, attended in seen:
            assert len(attended) == len(set(attended))
            assert attended[:n_sink] == list(range(n_sink))
            middle = len([p for p in attended if n_sink <= p < committed - window])
            if attend == "rerank":
                assert middle == budget
            else:
                assert budget <= middle <= DualDecoderConfig().resident_factor * budget
            assert [p for p in attended if p >= committed - window] == list(range(committed - window, position + 1))
    seen = _attended(monkeypatch, model, _prompt(29, 90), {**config, "budget": 4096})
    assert all(attended == list(range(position + 1)) for _, position, attended in seen)
