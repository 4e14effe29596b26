"""`regroup`: sequences of dual caches moved into a new cache keep their K/V, validity, sink, token ids, next
queries and 2-bit index; a regrouped sequence decodes as it would have in its old cache; bad input is refused."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_gemma3, tiny_llama
from dual_cache import DualDecoderCache
from dual_cache.cache.regroup import regroup
from dual_cache.host.memory import live_host_bytes
from dual_cache.layer.layer import DualLayer

PARTIAL = {"budget": 16, "n_sink": 4, "window": 8, "early_layers": 0, "retrieval_threads": 0, "selector": "lowbit",
           "lowbit_factor": 2}


def _left_padded(prompts, pad=0):
    width = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel():], mask[row, width - p.numel():] = p, 1
    return ids, mask


def _real(cache: DualDecoderCache, layer: DualLayer, row: int):
    """(H, n_real, D) keys and values of one sequence's real positions, and the positions."""
    n = layer.host.length
    keys, values = layer.host.read(0, n)
    real = cache.sequences.is_real(torch.arange(n)[None, :])
    real = real[row if real.shape[0] > 1 else 0]
    return keys[row][:, real], values[row][:, real]


def test_regrouped_sequences_keep_their_state():
    model = tiny_llama(seed=41)
    gen = torch.Generator().manual_seed(42)
    batch = DualDecoderCache(model.config, **PARTIAL)
    ids, mask = _left_padded([torch.randint(1, 96, (n,), generator=gen) for n in (150, 90)])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=batch)
    alone = DualDecoderCache(model.config, **PARTIAL)
    single = torch.randint(1, 96, (1, 200), generator=gen)
    out_alone = model.generate(single, max_new_tokens=3, do_sample=False, cache=alone)
    rows = [(batch, 1), (alone, 0), (batch, 0)]
    new = regroup(rows)
    try:
        lengths = [89 + 5, 199 + 3, 149 + 5]  # prompt + new - 1 stored per sequence
        axis = max(lengths)
        assert new.get_seq_length() == axis
        for i, ((source, row), length) in enumerate(zip(rows, lengths)):
            assert int(new.sequences.first_real[i]) == axis - length
            assert bool(new.sequences.valid[i, axis - length:].all()) and not new.sequences.valid[i, :axis - length].any()
            sink = new.sequences.sink_positions[i] - (axis - length)
            assert torch.equal(sink, source.sequences.sink_positions[row] - source.sequences.first_real[row])
            fed = (out if source is batch else out_alone)[row, :-1][-length:]  # the last token was never fed
            assert torch.equal(new.token_ids[i, axis - length:], fed)
            for layer, old in zip(new.dual_layers, source.dual_layers):
                for mine, theirs in zip(_real(new, layer, i), _real(source, old, row)):
                    assert torch.equal(mine, theirs)
                assert torch.equal(layer.carry.query[i], old.carry.query[row])
                index, old_index = layer.selector, old.selector
                groups = old_index.n_groups[row]
                assert index.n_groups[i] >= groups and index.group_first[i] == axis - length
                assert torch.equal(index.packed[i, :, :groups], old_index.packed[row, :, :groups])
                assert torch.equal(index.params[i, :, :groups], old_index.params[row, :, :groups])
        for layer in new.dual_layers:  # the copied index equals one built anew over the regrouped store
            copied = layer.selector
            rebuilt = type(copied)(copied.config, layer.host, copied.device)
            rebuilt.extend(axis, new.sequences.first_real)
            assert rebuilt.group_first == copied.group_first and rebuilt.n_groups == copied.n_groups
            for i, count in enumerate(copied.n_groups):
                assert torch.equal(rebuilt.packed[i, :, :count], copied.packed[i, :, :count])
                assert torch.equal(rebuilt.params[i, :, :count], copied.params[i, :, :count])
    finally:
        for cache in (new, batch, alone):
            cache.close()


@pytest.mark.parametrize("make_model", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_a_regrouped_sequence_decodes_as_in_its_old_cache(make_model):
    """Decode 4 tokens, regroup the sequence with a longer and a shorter one, decode on through the serving batch:
    the tokens equal one uninterrupted generate() with the same cache config (partial budget)."""
    from dual_cache.serving import GenerationOptions, Scheduler

    model = make_model(seed=43)
    gen = torch.Generator().manual_seed(44)
    prompts = [torch.randint(1, 96, (n,), generator=gen) for n in (70, 120, 40)]
    config = {k: v for k, v in PARTIAL.items()}
    scheduler = Scheduler(model, cache_config=config, max_batch=3)
    try:
        first = scheduler.add_request(prompts[0], GenerationOptions(max_tokens=20, temperature=0))
        assert len([t for _, t in zip(range(4), first.tokens(timeout=60))]) == 4  # it decodes alone, then others join
        others = [scheduler.add_request(p, GenerationOptions(max_tokens=6, temperature=0)) for p in prompts[1:]]
        assert all(h.wait(120) for h in [first, *others])
    finally:
        scheduler.stop()
    assert scheduler.counters["regroups"] >= 2
    for prompt, handle, n in zip(prompts, [first, *others], (20, 6, 6)):
        expected = model.generate(prompt[None], max_new_tokens=n, do_sample=False, cache_implementation="dual",
                                  cache_config=config)
        assert handle.token_ids == expected[0, prompt.numel():].tolist()


def test_bad_regroups_are_refused_before_any_work():
    model = tiny_llama(seed=45)
    prompt = torch.randint(1, 96, (1, 30))
    cache = DualDecoderCache(model.config, **PARTIAL)
    other = DualDecoderCache(model.config, **{**PARTIAL, "budget": 32})
    empty = DualDecoderCache(model.config, **PARTIAL)
    for c in (cache, other):
        model.generate(prompt, max_new_tokens=2, do_sample=False, cache=c)
    before = live_host_bytes()
    try:
        with pytest.raises(ValueError, match="at least one"):
            regroup([])
        with pytest.raises(ValueError, match="out of range"):
            regroup([(cache, 1)])
        with pytest.raises(ValueError, match="one DualDecoderConfig"):
            regroup([(cache, 0), (other, 0)])
        with pytest.raises(ValueError, match="holds no tokens"):
            regroup([(empty, 0)])
        with pytest.raises(TypeError, match="DualDecoderCache"):
            regroup([(object(), 0)])
        assert live_host_bytes() == before
        other.close()
        with pytest.raises(RuntimeError, match="closed"):
            regroup([(other, 0)])
    finally:
        for c in (cache, other, empty):
            c.close()


def test_copy_positions_equals_concatenating_the_chunks():
    from dual_cache.cache.regroup import _copy_positions

    gen = torch.Generator().manual_seed(20261204)
    for _ in range(20):
        sizes = torch.randint(1, 9, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
        chunks = [torch.randn(1, 3, n, 4, generator=gen) for n in sizes]
        start = int(torch.randint(0, sum(sizes), (1,), generator=gen))
        out = torch.full((3, sum(sizes) - start, 4), float("nan"))
        _copy_positions(chunks, start, out)
        assert torch.equal(out, torch.cat([c[0] for c in chunks], dim=1)[:, start:])
