"""The serving scheduler: requests arriving over time equal each request run alone, cancellation, sessions that
idle in host memory and resume with only their new tokens, eviction, clean stops, bad input."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from dual_cache import DualDecoderCache
from dual_cache.host.memory import live_host_bytes
from dual_cache.serving import GenerationOptions, Scheduler
from dual_cache.serving.prefix import block_hashes

FULL = {"budget": 100_000, "retrieval_threads": 0}
PARTIAL = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, "retrieval_threads": 0}


def _prompts(seed: int, lengths):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 96, (n,), generator=gen) for n in lengths]


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("dual-")}


@pytest.mark.parametrize("config", [FULL, PARTIAL], ids=["full-budget", "partial-budget"])
def test_requests_arriving_at_different_times_equal_each_run_alone(config):
    model = tiny_llama(seed=15)
    lengths, new = [40, 130, 75, 210, 33, 150, 90, 61], [5, 20, 12, 30, 8, 3, 25, 16]
    prompts = _prompts(1, lengths)
    before = _threads()
    scheduler = Scheduler(model, cache_config=config, max_batch=4)
    handles = []
    for i, (prompt, n) in enumerate(zip(prompts, new)):
        handles.append(scheduler.add_request(prompt, GenerationOptions(max_tokens=n, temperature=0)))
        if i % 3 == 0:
            time.sleep(0.05)  # one, a pause, then bursts of three that join while others decode
    try:
        assert all(h.wait(300) for h in handles)
    finally:
        scheduler.stop()
    assert scheduler.counters["decode_steps"] < sum(new) - len(new)  # rows shared decode steps
    for prompt, n, handle in zip(prompts, new, handles):
        assert handle.finish_reason == "length" and handle.error is None
        if config is FULL:
            expected = model.generate(prompt[None], max_new_tokens=n, do_sample=False)
        else:
            expected = model.generate(prompt[None], max_new_tokens=n, do_sample=False, cache_implementation="dual",
                                      cache_config=config)
        assert handle.token_ids == expected[0, prompt.numel():].tolist()
        assert handle.first_token is not None and handle.arrived <= handle.first_token <= handle.finished
    assert _threads() == before


def test_each_request_samples_with_its_own_options_whatever_it_is_batched_with():
    model = tiny_llama(seed=50)
    prompts = _prompts(51, [30, 45, 60])
    sampled = GenerationOptions(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    alone = Scheduler(model, cache_config=PARTIAL, max_batch=1)
    try:
        solo = alone.add_request(prompts[0], sampled)
        assert solo.wait(120)
    finally:
        alone.stop()
    mixed = Scheduler(model, cache_config=PARTIAL, max_batch=3)
    try:
        with mixed._cond:  # queued together: they decode as one batch
            handles = [mixed.add_request(prompts[0], sampled),
                       mixed.add_request(prompts[1], GenerationOptions(max_tokens=10, temperature=0)),
                       mixed.add_request(prompts[2], GenerationOptions(max_tokens=10, temperature=1.5, seed=3))]
        assert all(h.wait(120) for h in handles)
    finally:
        mixed.stop()
    assert handles[0].token_ids == solo.token_ids and len(solo.token_ids) == 10
    expected = model.generate(prompts[1][None], max_new_tokens=10, do_sample=False, cache_implementation="dual",
                              cache_config=PARTIAL)
    assert handles[1].token_ids == expected[0, prompts[1].numel():].tolist()
    assert mixed.counters["decode_steps"] < 20  # the three shared decode steps


def test_tokens_stream_and_cancel_queued_and_running():
    model = tiny_llama(seed=3)
    scheduler = Scheduler(model, cache_config=FULL, max_batch=1)
    try:
        long = scheduler.add_request(_prompts(2, [50])[0], GenerationOptions(max_tokens=400, temperature=0))
        queued = scheduler.add_request(_prompts(3, [20])[0], GenerationOptions(max_tokens=5, temperature=0))
        streamed = []
        for token in long.tokens(timeout=60):
            streamed.append(token)
            if len(streamed) == 3:
                scheduler.cancel(queued)
                scheduler.cancel(long)
        assert long.finish_reason == "cancelled" and 3 <= len(long.token_ids) < 400
        assert streamed == long.token_ids
        assert queued.finish_reason == "cancelled" and queued.token_ids == []
        after = scheduler.add_request(_prompts(4, [10])[0], GenerationOptions(max_tokens=4, temperature=0))
        assert after.wait(60) and len(after.token_ids) == 4
    finally:
        scheduler.stop()
    assert scheduler.metrics()["running_requests"] == 0


def test_stop_cancels_everything_and_leaves_no_threads():
    model = tiny_llama(seed=4)
    before = _threads()
    scheduler = Scheduler(model, cache_config=FULL, max_batch=2)
    handles = [scheduler.add_request(p, GenerationOptions(max_tokens=500, temperature=0))
               for p in _prompts(5, [30, 40, 50, 60])]
    next(handles[0].tokens(timeout=60))
    scheduler.stop()
    assert all(h.done for h in handles) and {h.finish_reason for h in handles} <= {"cancelled"}
    assert _threads() == before
    with pytest.raises(RuntimeError, match="stopped"):
        scheduler.add_request(_prompts(6, [5])[0])


def test_idle_sessions_hold_no_device_bytes_and_resume_with_only_new_tokens():
    model = tiny_llama(seed=7)
    gc.collect()
    live_before, threads_before = live_host_bytes(), _threads()
    scheduler = Scheduler(model, cache_config=FULL, max_batch=4)
    try:
        firsts = [scheduler.add_request(p, GenerationOptions(max_tokens=6, temperature=0), session=f"s{i}")
                  for i, p in enumerate(_prompts(8, [20 + 3 * i for i in range(20)]))]
        assert all(h.wait(300) for h in firsts) and scheduler.wait_idle(60)
        metrics = scheduler.metrics()
        assert metrics["idle_sessions"] == 20 and metrics["device_bytes"] == 0 and metrics["host_bytes"] > 0
        # turn 2 of session s3: the whole conversation so far plus a new user turn
        first = firsts[3]
        history = torch.cat([first.prompt, torch.tensor(first.token_ids)])
        turn = torch.cat([history, _prompts(9, [7])[0]])
        second = scheduler.add_request(turn, GenerationOptions(max_tokens=9, temperature=0), session="s3")
        assert second.wait(120) and second.error is None
        stored = first.prompt.numel() + len(first.token_ids) - 1  # the last generated token was never fed
        assert second.prefilled_tokens == turn.numel() - stored
        assert scheduler.counters["session_resumes"] == 1
        expected = model.generate(turn[None], max_new_tokens=9, do_sample=False)[0, turn.numel():].tolist()
        assert second.token_ids == expected
        # a turn that does not extend the stored conversation starts the session over (and still answers right)
        other = _prompts(10, [30])[0]
        third = scheduler.add_request(other, GenerationOptions(max_tokens=4, temperature=0), session="s3")
        assert third.wait(120) and third.prefilled_tokens == other.numel()
        assert third.token_ids == model.generate(other[None], max_new_tokens=4, do_sample=False)[0, 30:].tolist()
    finally:
        scheduler.stop()
    assert scheduler.sessions.totals()["host_bytes"] == 0 and len(scheduler.sessions) == 0
    gc.collect()
    assert live_host_bytes() == live_before and _threads() == threads_before  # nothing leaked


def test_a_cancelled_session_turn_keeps_what_it_stored():
    model = tiny_llama(seed=21)
    prompt, user = _prompts(22, [45, 6])
    scheduler = Scheduler(model, cache_config=PARTIAL, max_batch=2)
    try:
        first = scheduler.add_request(prompt, GenerationOptions(max_tokens=300, temperature=0), session="chat")
        for count, _ in enumerate(first.tokens(timeout=60), 1):
            if count == 5:
                scheduler.cancel(first)
        assert first.finish_reason == "cancelled" and 5 <= len(first.token_ids) < 300
        assert scheduler.wait_idle(60) and scheduler.metrics()["device_bytes"] == 0
        # the client resends the conversation with the partial answer, then a new user turn
        turn = torch.cat([prompt, torch.tensor(first.token_ids), user])
        second = scheduler.add_request(turn, GenerationOptions(max_tokens=8, temperature=0), session="chat")
        assert second.wait(120) and second.error is None
        assert scheduler.counters["session_resumes"] == 1
        assert second.prefilled_tokens == user.numel() + 1  # the answer's last token was never fed
        # the reference: the same conversation through generate() on one cache, its first turn's tokens decoded
        # (sparse attention stored their K/V), its second prefilling the answer's last token and the new turn
        with DualDecoderCache(model.config, **PARTIAL) as cache:
            answer = model.generate(prompt[None], max_new_tokens=len(first.token_ids), do_sample=False, cache=cache)
            assert answer[0, prompt.numel():].tolist() == first.token_ids
            expected = model.generate(turn[None], max_new_tokens=8, do_sample=False, cache=cache)
        assert second.token_ids == expected[0, turn.numel():].tolist()
    finally:
        scheduler.stop()


def test_sessions_past_the_host_budget_are_evicted_least_recently_used():
    model = tiny_llama(seed=9)
    probe = DualDecoderCache(model.config, **FULL)
    one = probe.host_bytes_needed(1, 40 + 4 + 1, model.dtype, prompt_tokens=40)
    scheduler = Scheduler(model, cache_config=FULL, max_batch=1, max_host_bytes=int(2.5 * one))
    try:
        for i, prompt in enumerate(_prompts(11, [40] * 5)):
            assert scheduler.add_request(prompt, GenerationOptions(max_tokens=4, temperature=0),
                                         session=f"s{i}").wait(60) and scheduler.wait_idle(60)
        totals = scheduler.sessions.totals()
        assert scheduler.sessions.evicted >= 2 and totals["host_bytes"] <= 2.5 * one
        assert "s4" in scheduler.sessions._sessions and "s0" not in scheduler.sessions._sessions
        huge = scheduler.add_request(_prompts(12, [1500])[0], GenerationOptions(max_tokens=4, temperature=0))
        assert huge.wait(60) and huge.finish_reason == "error" and "host memory" in huge.error
    finally:
        scheduler.stop()


def test_sliding_window_model_and_dense_rows():
    model = tiny_gemma3(seed=2)
    prompts = _prompts(13, [60, 35, 80])
    for dense in (False, True):
        scheduler = Scheduler(model, cache_config=FULL, dense=dense, max_batch=3)
        try:
            handles = [scheduler.add_request(p, GenerationOptions(max_tokens=7, temperature=0)) for p in prompts]
            assert all(h.wait(120) for h in handles)
        finally:
            scheduler.stop()
        for prompt, handle in zip(prompts, handles):
            assert handle.token_ids == model.generate(prompt[None], max_new_tokens=7,
                                                      do_sample=False)[0, prompt.numel():].tolist()


def test_bad_requests_are_refused_before_any_work():
    model = tiny_llama(seed=1)
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(model, max_batch=0)
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(stop=("",)), dict(seed="x")):
        with pytest.raises(ValueError):
            GenerationOptions(**bad)
    scheduler = Scheduler(model, cache_config=FULL)
    try:
        with pytest.raises(ValueError, match="non-empty"):
            scheduler.add_request(torch.tensor([], dtype=torch.long))
        with pytest.raises(ValueError, match="integer"):
            scheduler.add_request(torch.rand(5))
        with pytest.raises(ValueError, match="positions"):
            scheduler.add_request(torch.ones(2000, dtype=torch.long), GenerationOptions(max_tokens=100))
        assert scheduler.metrics()["requests"] == 0
    finally:
        scheduler.stop()
    dense = Scheduler(model, dense=True)
    try:
        with pytest.raises(ValueError, match="sessions need the dual cache"):
            dense.add_request(torch.ones(5, dtype=torch.long), session="a")
    finally:
        dense.stop()


def test_block_hashes_chain_whole_blocks():
    gen = torch.Generator().manual_seed(31)
    document = torch.randint(1, 96, (100,), generator=gen)
    hashes = block_hashes(document, 32)
    assert len(hashes) == 3 and hashes[:1] == block_hashes(document[:50], 32)
    other = document.clone()
    other[40] = 0 if int(other[40]) else 1
    assert block_hashes(other, 32)[0] == hashes[0] and block_hashes(other, 32)[1:] != hashes[1:]
    with pytest.raises(ValueError, match="block >= 1"):
        block_hashes(document, 0)
    with pytest.raises(ValueError, match="prefix_block"):
        Scheduler(tiny_llama(seed=1), cache_config=FULL, prefix_block=-1)


@pytest.mark.parametrize("config", [FULL, {**PARTIAL, "selector": "lowbit", "lowbit_factor": 2}],
                         ids=["full-budget", "partial-budget-lowbit"])
def test_requests_starting_with_a_cached_prefix_copy_it_and_equal_each_request_alone(config):
    """The first request is prefilled to its last whole block, which the prefix cache keeps; later requests with
    the same document copy it and prefill only their own tokens; each equals its solo run (at a partial budget too:
    a copied prefix is the same sequence as a prefilled one)."""
    model = tiny_llama(seed=32)
    gen = torch.Generator().manual_seed(33)
    document = torch.randint(1, 96, (150,), generator=gen)
    prompts = [torch.cat([document, torch.randint(1, 96, (n,), generator=gen)]) for n in (9, 30, 4)]
    new = [12, 5, 9]
    scheduler = Scheduler(model, cache_config=config, max_batch=4, prefix_block=32)
    try:
        first = scheduler.add_request(prompts[0], GenerationOptions(max_tokens=new[0], temperature=0))
        assert first.wait(300)
        handles = [first] + [scheduler.add_request(p, GenerationOptions(max_tokens=n, temperature=0))
                             for p, n in zip(prompts[1:], new[1:])]
        assert all(h.wait(300) for h in handles) and scheduler.wait_idle(60)
        assert scheduler.metrics()["cached_prefixes"] == 1
    finally:
        scheduler.stop()
    assert first.prefilled_tokens == prompts[0].numel()
    assert [h.prefilled_tokens for h in handles[1:]] == [p.numel() - 128 for p in prompts[1:]]
    assert scheduler.counters["prefix_hit_tokens"] == 2 * 128
    for prompt, n, handle in zip(prompts, new, handles):
        assert handle.finish_reason == "length"
        if config is FULL:
            expected = model.generate(prompt[None], max_new_tokens=n, do_sample=False)
        else:
            expected = model.generate(prompt[None], max_new_tokens=n, do_sample=False, cache_implementation="dual",
                                      cache_config=config)
        assert handle.token_ids == expected[0, prompt.numel():].tolist()


def test_a_cached_prefix_with_sliding_window_layers_equals_each_request_alone():
    """Gemma (window 24), requests one after another: the first caches its whole blocks (48 tokens: the document
    and 8 of its own), the second shares 2 blocks with that entry and caches those, the third copies them. A prefix
    copied between requests keeps the sliding layers' windows."""
    model = tiny_gemma3(seed=34)
    gen = torch.Generator().manual_seed(35)
    document = torch.randint(1, 96, (40,), generator=gen)
    prompts = [torch.cat([document, torch.randint(1, 96, (n,), generator=gen)]) for n in (12, 9, 30)]
    scheduler = Scheduler(model, cache_config=FULL, max_batch=2, prefix_block=16)
    try:
        handles = []
        for prompt in prompts:
            handles.append(scheduler.add_request(prompt, GenerationOptions(max_tokens=8, temperature=0)))
            assert handles[-1].wait(300)
    finally:
        scheduler.stop()
    assert scheduler.counters["prefix_hit_tokens"] == 32
    assert [h.prefilled_tokens for h in handles] == [prompts[0].numel(), prompts[1].numel(), prompts[2].numel() - 32]
    for prompt, handle in zip(prompts, handles):
        expected = model.generate(prompt[None], max_new_tokens=8, do_sample=False)
        assert handle.token_ids == expected[0, prompt.numel():].tolist()


def test_requests_whose_layer_types_differ_share_a_batch():
    """Gemma (window 24): a short request serves its sliding layers as full attention, a long one does not; queued
    together they share the batch (its sliding layers slide for all of them: `regroup`), each equal to its solo
    run."""
    model = tiny_gemma3(seed=60)
    prompts, new = _prompts(61, [6, 40, 8]), [12, 4, 3]
    scheduler = Scheduler(model, cache_config={**FULL, "prefill_chunk_size": 4}, max_batch=3)
    widths = []
    step = scheduler.batch.step

    def spy():
        widths.append(len([row for row in scheduler.batch.rows if not row.done]))
        step()

    scheduler.batch.step = spy
    try:
        with scheduler._cond:
            handles = [scheduler.add_request(p, GenerationOptions(max_tokens=n, temperature=0))
                       for p, n in zip(prompts, new)]
        assert all(h.wait(120) for h in handles)
    finally:
        scheduler.stop()
    assert max(widths) >= 2  # a short and a long request decoded together
    for prompt, n, handle in zip(prompts, new, handles):
        assert handle.finish_reason == "length", handle.error
        assert handle.token_ids == model.generate(prompt[None], max_new_tokens=n,
                                                  do_sample=False)[0, prompt.numel():].tolist()


def test_a_session_continued_past_the_sliding_window_equals_the_default_cache():
    """Gemma (window 24): turn 1 fits the window (sliding layers served as full attention), turn 2 passes it; the
    session's cache slides from then on and answers as transformers' default cache does."""
    model = tiny_gemma3(seed=70)
    first_prompt, user = _prompts(71, [10, 30])
    scheduler = Scheduler(model, cache_config=FULL, max_batch=2)
    try:
        first = scheduler.add_request(first_prompt, GenerationOptions(max_tokens=5, temperature=0), session="s")
        assert first.wait(60) and scheduler.wait_idle(60)
        turn = torch.cat([first_prompt, torch.tensor(first.token_ids), user])
        second = scheduler.add_request(turn, GenerationOptions(max_tokens=12, temperature=0), session="s")
        assert second.wait(60) and second.error is None
    finally:
        scheduler.stop()
    assert scheduler.counters["session_resumes"] == 1
    assert second.token_ids == model.generate(turn[None], max_new_tokens=12, do_sample=False)[0, turn.numel():].tolist()


def test_a_row_that_cannot_be_regrouped_fails_alone(monkeypatch):
    """A regroup that fails for one joining request's sequence fails that request only; the other rows keep
    decoding and answer as they would alone."""
    import dual_cache.serving.batch as batch_module

    model = tiny_llama(seed=72)
    prompts = _prompts(73, [30, 44, 25])
    poison = prompts[1][:3].tolist()
    real = batch_module.regroup

    def regroup(sources):
        for cache, row in sources:
            if cache.token_ids is not None and cache.token_ids[row if cache.token_ids.shape[0] > 1 else 0, :3].tolist() \
                    == poison:
                raise RuntimeError("this sequence cannot be copied")
        return real(sources)

    monkeypatch.setattr(batch_module, "regroup", regroup)
    scheduler = Scheduler(model, cache_config=FULL, max_batch=3)
    try:
        with scheduler._cond:
            handles = [scheduler.add_request(p, GenerationOptions(max_tokens=8, temperature=0)) for p in prompts]
        assert all(h.wait(120) for h in handles)
    finally:
        scheduler.stop()
    assert handles[1].finish_reason == "error" and "cannot be copied" in handles[1].error
    for i in (0, 2):
        assert handles[i].finish_reason == "length", handles[i].error
        assert handles[i].token_ids == model.generate(prompts[i][None], max_new_tokens=8,
                                                      do_sample=False)[0, prompts[i].numel():].tolist()


def test_a_cached_prefix_served_within_the_window_continues_past_it():
    """Gemma (window 24): the first prompt and its reply fit the window, so its cached prefix serves the sliding
    layers as full attention; a later prompt that starts with it and passes the window slides from its copy on,
    and answers as the default cache does."""
    model = tiny_gemma3(seed=74)
    document = _prompts(75, [16])[0]
    prompts = [torch.cat([document, own]) for own in _prompts(76, [1, 17])]
    scheduler = Scheduler(model, cache_config=FULL, max_batch=2, prefix_block=8)
    try:
        handles = []
        for prompt, n in zip(prompts, (4, 6)):
            handles.append(scheduler.add_request(prompt, GenerationOptions(max_tokens=n, temperature=0)))
            assert handles[-1].wait(120) and scheduler.wait_idle(60)
    finally:
        scheduler.stop()
    assert scheduler.counters["prefix_hit_tokens"] == 16
    for prompt, n, handle in zip(prompts, (4, 6), handles):
        assert handle.finish_reason == "length", handle.error
        assert handle.token_ids == model.generate(prompt[None], max_new_tokens=n,
                                                  do_sample=False)[0, prompt.numel():].tolist()


def test_prompts_sharing_a_document_queued_together_use_the_prefix_cache():
    model = tiny_llama(seed=62)
    document = _prompts(63, [96])[0]
    prompts = [torch.cat([document, own]) for own in _prompts(64, [5, 17, 1])]
    scheduler = Scheduler(model, cache_config=FULL, max_batch=3, prefix_block=16)
    try:
        with scheduler._cond:
            handles = [scheduler.add_request(p, GenerationOptions(max_tokens=4, temperature=0)) for p in prompts]
        assert all(h.wait(120) for h in handles)
    finally:
        scheduler.stop()
    assert scheduler.counters["prefix_hit_tokens"] > 0
    for prompt, handle in zip(prompts, handles):
        assert handle.finish_reason == "length", handle.error
        assert handle.token_ids == model.generate(prompt[None], max_new_tokens=4,
                                                  do_sample=False)[0, prompt.numel():].tolist()


def test_options_out_of_range_and_counters_on_stop():
    with pytest.raises(ValueError, match="seed"):
        GenerationOptions(seed=2**64)
    model = tiny_llama(seed=65)
    prompt = _prompts(66, [20])[0]
    scheduler = Scheduler(model, cache_config=FULL, max_batch=1)
    try:
        tiny = scheduler.add_request(prompt, GenerationOptions(max_tokens=5, temperature=1e-40))  # greedy
        assert tiny.wait(60) and tiny.finish_reason == "length", tiny.error
        assert tiny.token_ids == model.generate(prompt[None], max_new_tokens=5, do_sample=False)[0, 20:].tolist()
        handles = [scheduler.add_request(prompt, GenerationOptions(max_tokens=200, temperature=0)) for _ in range(4)]
        next(handles[0].tokens(timeout=60))
    finally:
        scheduler.stop()
    metrics = scheduler.metrics()
    assert all(h.done for h in handles) and metrics["finished"] == metrics["requests"] == 5
