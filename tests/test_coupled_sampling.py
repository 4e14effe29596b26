"""Coupled sampling (issue 57): the real token stays an exact sample of the processed scores' softmax, and the test
has the power to catch a biased sampler. Chi-square goodness of fit with p-values from torch's regularized
incomplete gamma function; the thresholds (p > 1e-4 passes, p < 1e-6 for the biased ones) leave a fair sampler
one false failure in ten thousand runs."""

from __future__ import annotations

import torch

from dual_cache.generate.sampling import StepSampler, gumbel_argmax, gumbel_noise


def chi_square_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's chi-square for counts `observed` against `expected` (same total), bins with an expected
    count below 5 merged (in order of expectation) so the chi-square approximation holds."""
    order = torch.argsort(expected)
    observed, expected = observed[order].double(), expected[order].double()
    bins_o, bins_e, acc_o, acc_e = [], [], 0.0, 0.0
    for o, e in zip(observed.tolist(), expected.tolist()):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            bins_o.append(acc_o)
            bins_e.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e and bins_e:
        bins_o[-1] += acc_o
        bins_e[-1] += acc_e
    o, e = torch.tensor(bins_o), torch.tensor(bins_e)
    stat = ((o - e) ** 2 / e).sum()
    df = torch.tensor(len(bins_e) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def _scores(seed: int, vocab: int = 12) -> torch.Tensor:
    """Processed scores as a top-k warper leaves them: random logits at temperature 0.7, the 3 worst at -inf."""
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 1.5
    scores = logits / 0.7
    scores[torch.topk(logits, 3, largest=False).indices] = float("-inf")
    return scores


def test_gumbel_argmax_samples_the_softmax_exactly():
    torch.manual_seed(11)
    scores = _scores(1)
    draws = 40_000
    tokens = gumbel_argmax(scores.expand(draws, -1), gumbel_noise((draws, scores.numel()), torch.device("cpu")))
    counts = torch.bincount(tokens, minlength=scores.numel())
    assert counts[scores == float("-inf")].sum() == 0
    assert chi_square_p(counts, torch.softmax(scores, -1) * draws) > 1e-4


def test_the_test_rejects_a_biased_sampler():
    """Power: a sampler that adds the noise to the raw logits (the temperature ignored) and one that draws its
    noise in float32 with `-log(E)`, E exponential (a token gets +inf noise when E rounds to 0) are caught."""
    torch.manual_seed(12)
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    scores = logits / 0.7
    draws = 40_000
    noise = gumbel_noise((draws, 12), torch.device("cpu"))
    raw = torch.bincount(gumbel_argmax(logits.expand(draws, -1), noise), minlength=12)
    assert chi_square_p(raw, torch.softmax(scores, -1) * draws) < 1e-6
    # a shared noise row across draws (noise not refreshed): every draw the same token
    stale = torch.bincount(gumbel_argmax(scores.expand(draws, -1), noise[:1].expand(draws, -1)), minlength=12)
    assert chi_square_p(stale, torch.softmax(scores, -1) * draws) < 1e-6


def test_a_coupled_real_token_is_an_exact_sample_and_the_guess_shares_its_noise():
    """Through `StepSampler`: the real token of step t+1 uses the noise drawn with the speculated token at step t;
    over many rows its distribution is the processed softmax, and where the two slots' scores agree the guess equals
    the sample."""
    torch.manual_seed(13)
    rows = 30_000
    scores = _scores(2).expand(rows, -1).contiguous()
    sampler = StepSampler(do_sample=True, coupled=True)
    first = sampler.real(scores)  # the first step: fresh noise
    guess = sampler.speculated(scores)  # the speculated slot saw the same context here
    second = sampler.real(scores)
    assert torch.equal(guess, second)
    expected = torch.softmax(scores[0], -1) * rows
    for tokens in (first, second):
        assert chi_square_p(torch.bincount(tokens, minlength=scores.shape[1]), expected) > 1e-4
    # independent steps: the first and second tokens are not correlated (a stale-noise bug would make them equal)
    assert (first == second).float().mean() < 0.5


def test_greedy_and_uncoupled_sampling_are_what_transformers_does():
    scores = torch.randn(4, 20, generator=torch.Generator().manual_seed(3))
    greedy = StepSampler(do_sample=False)
    assert torch.equal(greedy.real(scores), scores.argmax(-1))
    assert torch.equal(greedy.speculated(scores), scores.argmax(-1))
    torch.manual_seed(5)
    expected = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
    torch.manual_seed(5)
    assert torch.equal(StepSampler(do_sample=True, coupled=False).real(scores), expected)


def _third_token_fit(monkeypatch=None) -> float:
    """p-value of the third generated token of 1000 sampled rows (coupled sampling, full budget, temperature 0.6,
    top-k 20: its noise was drawn with the second step's speculated token) against the processed softmax of the
    model's logits after each row's own first two tokens."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    from tests.conftest import tiny_llama

    model = tiny_llama(seed=31)
    with torch.no_grad():  # random weights give nearly flat distributions; sharpen them so temperature matters
        model.lm_head.weight.mul_(12.0)
    ids = torch.randint(3, 90, (1, 40), generator=torch.Generator().manual_seed(32)).expand(1000, -1)
    torch.manual_seed(33)
    out = model.generate(ids, max_new_tokens=3, do_sample=True, temperature=0.6, top_k=20, top_p=None,
                         cache_implementation="dual", cache_config={"budget": 4096, "retrieval_threads": 0})
    with torch.no_grad():
        logits = model(out[:, :-1]).logits[:, -1]
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopKLogitsWarper(20)])
    probs = torch.softmax(warp(out[:, :-1], logits), dim=-1)
    observed = torch.bincount(out[:, -1], minlength=probs.shape[1])
    return chi_square_p(observed, probs.sum(0))


def test_generate_with_coupled_sampling_draws_exact_samples(monkeypatch):
    """End to end through `generate()`: the tokens drawn with noise shared with a speculated token follow the
    processed distribution; a sampler that applies the temperature twice is caught (the test's power)."""
    assert _third_token_fit() > 1e-4
    original = StepSampler.real
    monkeypatch.setattr(StepSampler, "real", lambda self, scores: original(self, scores / 0.6))
    assert _third_token_fit() < 1e-6


def test_the_logits_processors_run_once_a_step_unless_coupled_sampling_scores_the_guess():
    """A processor that keeps state between calls (a forced-token schedule, a call counter) sees one call per step
    under greedy decoding and uncoupled sampling, as under the default cache; coupled sampling also scores the
    speculated slot (two calls a step after the first)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from tests.conftest import tiny_llama

    class Counting(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            return scores

    model = tiny_llama(seed=41)
    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(42))
    config = {"budget": 4096, "retrieval_threads": 0}
    for sample, coupled, calls in ((False, True, 6), (True, False, 6), (True, True, 11)):
        counting = Counting()
        model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=sample, top_k=None, top_p=None,
                       logits_processor=LogitsProcessorList([counting]), cache_implementation="dual",
                       cache_config={**config, "coupled_sampling": coupled})
        assert counting.calls == calls, (sample, coupled)
