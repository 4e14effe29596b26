"""The self speculator's recovery after a miss (issue 71): its incremental prompt lookup (`NgramIndex`) against
transformers' and a brute-force reference, its per-sequence choice of guess source, its per-request state, and the
per-row hit statistics of `cache.stats()`. No model: sequences and guesses are synthetic."""

import math
import random

import pytest
import torch

from dual_cache.cache.stats import CacheAccounting
from dual_cache.generate.ngram_index import NgramIndex
from dual_cache.generate.speculators import PromptLookupSpeculator, SelfSpeculator

NGRAM = 3


def continuation(tokens: list[int], size: int, latest: bool) -> int | None:
    """Brute force: the token after the first (latest) earlier occurrence of the longest suffix n-gram (n ≤ size)."""
    for n in range(min(size, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        starts = range(len(tokens) - n)  # occurrences that end before the last position
        for start in (reversed(starts) if latest else starts):
            if tokens[start:start + n] == suffix:
                return tokens[start + n]
    return None


def random_sequences(count: int, vocab: int, length: int):
    seed = random.SystemRandom().randrange(2**31)  # fresh every run; printed on failure
    rng = random.Random(seed)
    for _ in range(count):
        yield seed, [rng.randrange(vocab) for _ in range(rng.randrange(1, length))]


def test_ngram_index_matches_references_on_random_sequences():
    reference = PromptLookupSpeculator(NGRAM)
    for seed, tokens in random_sequences(200, vocab=6, length=60):
        first, latest = NgramIndex(NGRAM), NgramIndex(NGRAM, latest=True)
        for end in range(1, len(tokens) + 1):  # grown one token at a time, as the decode loop grows it
            prefix = tokens[:end]
            first.update(torch.tensor(prefix))
            latest.update(torch.tensor(prefix))
            theirs = reference.propose([torch.tensor(prefix)], [-1], None)[0]  # -1 where nothing matches
            assert (-1 if first.lookup() is None else first.lookup()) == theirs, (seed, prefix)
            assert first.lookup() == continuation(prefix, NGRAM, latest=False), (seed, prefix)
            assert latest.lookup() == continuation(prefix, NGRAM, latest=True), (seed, prefix)


def test_ngram_index_indexes_in_chunks_and_checks_extension():
    for latest, answer in ((False, 3), (True, 9)):
        index = NgramIndex(NGRAM, latest=latest)
        index.update(torch.tensor([1, 2, 3, 4, 1, 2]))
        assert index.lookup() == 3
        index.update(torch.tensor([1, 2, 3, 4, 1, 2, 9, 1, 2]))
        assert index.lookup() == answer  # the first / the most recent continuation of (1, 2)
        assert index.extends(torch.tensor([1, 2, 3, 4, 1, 2, 9, 1, 2, 5]))
        assert not index.extends(torch.tensor([1, 2, 3, 4, 1, 2, 9, 7, 2, 5]))
        assert not index.extends(torch.tensor([1, 2]))
    with pytest.raises(ValueError):
        NgramIndex(0)


def run_rows(speculator, prompts, next_token, chain_guess, steps):
    """Drive `speculator` over `steps` decode steps: row i's real token after sequence s is `next_token(i, s)`, its
    chained guess `chain_guess(i, s, hit)`. Returns per row the hits after the first step."""
    sequences = [list(p) for p in prompts]
    chained = last_hit = None
    hits = [0] * len(prompts)
    for step in range(steps):
        proposed = speculator.propose([torch.tensor(s) for s in sequences], chained, last_hit)
        reals = [next_token(i, s) for i, s in enumerate(sequences)]
        last_hit = [p == r for p, r in zip(proposed, reals)]
        for i, (s, r) in enumerate(zip(sequences, reals)):
            s.append(r)
            hits[i] += last_hit[i] and step > 0
        chained = [chain_guess(i, s, h) for i, (s, h) in enumerate(zip(sequences, last_hit))]
    return hits


def own_words(i: int, sequence: list[int]) -> int:
    """A text in the row's own words over a tiny vocabulary: every token occurred before, so lookup always finds a
    match, but the next token is a fixed pseudo-random function of the position (lookup is right about 1 in 3)."""
    return (len(sequence) * 2654435761 >> 11) % 3 + 1


def right_guess(i: int, sequence: list[int], hit: bool) -> int:
    return own_words(i, sequence)


def test_a_row_whose_lookup_keeps_missing_switches_to_the_chain():
    prompt = [1, 2, 3] * 20
    # greedy: the chained guess after a hit is exact, and after a miss right too (the model's own words)
    hits = run_rows(SelfSpeculator(NGRAM, window=8), [prompt], own_words, right_guess, steps=20)
    assert hits[0] >= 20 - 1 - 3  # a few after-miss steps to learn, then every step hits


def test_under_sampling_the_better_source_after_a_miss_wins():
    prompt = [1, 2, 3] * 20
    # sampled: the chained guess is right on 7 of 10 steps, hit or miss, never persistently; lookup about 1 in 3
    chain = lambda i, s, hit: own_words(i, s) if len(s) * 40503 % 10 < 7 else -7  # noqa: E731
    steps = 80
    hits = run_rows(SelfSpeculator(NGRAM, window=8), [prompt], own_words, chain, steps=steps)
    always_lookup = run_rows(SelfSpeculator(NGRAM, window=1), [prompt], own_words, lambda i, s, hit: -7, steps=steps)
    assert hits[0] >= 0.55 * steps and hits[0] > always_lookup[0] + 0.2 * steps


def test_a_row_that_copies_its_prompt_keeps_lookup():
    rng = random.Random(7)
    prompt = [rng.randrange(50_000) for _ in range(200)]
    copy = lambda i, s: prompt[len(s) - len(prompt)]  # noqa: E731  (continues quoting the prompt from token 10)
    chain = lambda i, s, hit: -1 if not hit else copy(i, s)  # noqa: E731  (after a miss the chain is always wrong)
    sequences = [prompt + prompt[:10]]
    hits = run_rows(SelfSpeculator(NGRAM, window=8), sequences, copy, chain, steps=30)
    assert hits[0] >= 30 - 2


def test_rows_score_their_sources_apart():
    prompt = [1, 2, 3] * 20
    copying = lambda s: s[len(s) - 3]  # noqa: E731  (the row repeats its period-3 text: lookup is right)
    real = lambda i, s: own_words(i, s) if i == 0 else copying(s)  # noqa: E731
    chain = lambda i, s, hit: own_words(i, s) if i == 0 else (copying(s) if hit else -1)  # noqa: E731
    hits = run_rows(SelfSpeculator(NGRAM, window=8), [prompt, prompt], real, chain, steps=20)
    assert hits[0] >= 15 and hits[1] >= 18


def test_a_new_request_does_not_inherit_a_rows_scores():
    speculator = SelfSpeculator(NGRAM, window=8)
    prompt = [1, 2, 3] * 20
    sampled = lambda i, s, hit: own_words(i, s) if len(s) * 40503 % 10 < 7 else -7  # noqa: E731
    run_rows(speculator, [prompt], own_words, sampled, steps=30)
    assert speculator.state[0][1].prefers_chain()
    # the row's next request (its first step: no chained guess) starts with fresh scores and a fresh index
    speculator.propose([torch.tensor([4, 5, 6, 4, 5])], None, None)
    index, scores = speculator.state[0]
    assert not scores.outcomes and index.tokens == [4, 5, 6, 4, 5]
    # a row whose sequence is replaced mid-way (another request in that row) is re-indexed and re-scored
    run_rows(speculator, [prompt], own_words, sampled, steps=30)
    assert speculator.state[0][1].outcomes
    speculator.propose([torch.tensor([9, 9, 8, 9])], [3], [False])
    index, scores = speculator.state[0]
    assert len(scores.outcomes) == 0 and index.tokens == [9, 9, 8, 9]


def test_keyed_rows_follow_their_requests_and_leave():
    speculator = SelfSpeculator(NGRAM, window=8)
    a, b = object(), object()
    seq_a, seq_b = torch.tensor([1, 2, 1, 2]), torch.tensor([7, 8, 7])
    assert speculator.propose([seq_a, seq_b], [None, None], [None, None], rows=[a, b]) == [1, 8]
    # b now first, a new row c joins on its first step; the keys carry each row's own state
    seq_c = torch.tensor([3, 3])
    out = speculator.propose([torch.cat([seq_b, torch.tensor([8])]), seq_c, torch.cat([seq_a, torch.tensor([5])])],
                             [4, None, 6], [True, None, False], rows=[b, speculator_key := object(), a])
    assert out[0] == 4 and out[1] == 3
    assert set(speculator.state) == {a, b, speculator_key}
    assert speculator.state[a][1].pending == (None, 6)  # (5) never occurred before: lookup has nothing
    speculator.propose([seq_c], [None], [None], rows=[speculator_key])
    assert set(speculator.state) == {speculator_key}  # rows absent from a call left: their state is dropped
    with pytest.raises(ValueError):
        speculator.propose([seq_c], None, None, rows=[a, b])


def test_stats_report_each_rows_hit_rate():
    accounting = CacheAccounting()
    accounting.record_speculation([True, False, None])
    accounting.record_speculation([True, True, False])
    assert (accounting.spec_hits, accounting.spec_steps) == (3, 5)
    rates = accounting.row_rates()
    assert rates["spec_rows"] == 3
    assert rates["spec_row_hit_rate_min"] == 0.0
    assert rates["spec_row_hit_rate_mean"] == pytest.approx((1 + 0.5 + 0) / 3)
    accounting.end_rows()  # the next request's rows count apart
    accounting.record_speculation([True])
    assert accounting.row_rates()["spec_rows"] == 4
    assert math.isnan(CacheAccounting().row_rates()["spec_row_hit_rate_min"])


def test_ngram_index_bulk_runs_agree_with_step_by_step_indexing():
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for trial in range(20):
        latest = bool(trial % 2)
        tokens = [rng.randrange(5) for _ in range(rng.randrange(NgramIndex.BULK, 4 * NgramIndex.BULK))]
        cut = rng.randrange(1, len(tokens))
        index = NgramIndex(NGRAM, latest=latest)
        index.update(torch.tensor(tokens[:cut]))  # a prompt, maybe in bulk
        for end in range(cut + 1, len(tokens) + 1):
            index.update(torch.tensor(tokens[:end]))
            if end % 7 == 0 or end == len(tokens):
                assert index.lookup() == continuation(tokens[:end], NGRAM, latest), (seed, end)
        # a long extension at once: a second bulk run over the first
        more = [rng.randrange(7) for _ in range(NgramIndex.BULK + 3)]
        index.update(torch.tensor(tokens + more))
        assert index.lookup() == continuation(tokens + more, NGRAM, latest), seed
    wide = 1 + (1 << 21)  # packs as 1: (wide, 2, 3) collides with (1, 2, 3), followed by 7; a real match follows
    for latest, tokens in ((False, [2, 3, 8, 1, 2, 3, 7, wide, 2, 3]), (True, [1, 2, 3, 7, 5, 2, 3, 8, wide, 2, 3])):
        index = NgramIndex(NGRAM, latest=latest)
        index.update(torch.tensor(tokens))
        assert index.lookup() == continuation(tokens, NGRAM, latest) == 8
