"""A randomized differential test: one `DualDecoderCache` driven through a random conversation of `generate()` calls,
against transformers' `DynamicCache` driven the same way.

A scenario draws, from its seed: a tiny model of one layer-type mix (full attention only with GQA or MQA, sliding +
full, sliding + full with logit soft-capping, sliding only), a batch with random left padding, 2-4 turns whose new
tokens and `max_new_tokens` (1-20) cross the sliding window in both directions (turns that stay inside it, turns that
pass it, continuations after the window was passed), sometimes a batch that continues one stored sequence (a shared
prefix), sometimes a crop between turns (the conversation continues from an earlier point), the dual cache's sink,
window, retrieval threads, speculator and selector, and a budget at or above the context or below it.

- At or above the context (`n_sink + window + budget >= tokens`), every call must equal `DynamicCache`'s greedy
  tokens, token for token (fp32).
- Below it, the pipelined run (retrieval threads) must equal the synchronous reference (`retrieval_threads=0`)
  driven the same way, token for token.

A failure names its seed and scenario: rerun one with `DUAL_DIFF_SEEDS=<seed> pytest tests/test_differential.py -m ""`.
The default run covers a fixed slice of seeds; `-m slow` runs many more (`DUAL_DIFF_RUNS`, 300 by default).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import pytest
import torch
from transformers import DynamicCache

from dual_cache import DualDecoderCache
from dual_cache.model.inputs import cache_kwarg_name

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             max_position_embeddings=2048, eos_token_id=None, pad_token_id=0, bos_token_id=1)
WINDOW = 20  # the models' sliding window (tokens)


def _llama_gqa(seed):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMALL, num_hidden_layers=3, num_key_value_heads=2)).eval()


def _qwen2_mqa(seed):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**SMALL, num_hidden_layers=2, num_key_value_heads=1)).eval()


def _gemma3_mixed(seed):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(seed)
    config = Gemma3TextConfig(**SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"] * 2)
    return Gemma3ForCausalLM(config).eval()


def _gemma2_softcap(seed):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    config = Gemma2Config(**SMALL, num_hidden_layers=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                          attn_logit_softcapping=2.0, query_pre_attn_scalar=16,
                          layer_types=["full_attention", "sliding_attention"] * 2)
    return Gemma2ForCausalLM(config).eval()


def _mistral_sliding(seed):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2,
                                            sliding_window=WINDOW)).eval()


MODELS = {  # layer-type mixes the project serves
    "full-gqa": _llama_gqa,
    "full-mqa": _qwen2_mqa,
    "sliding+full": _gemma3_mixed,
    "sliding+full-softcap": _gemma2_softcap,
    "sliding-only": _mistral_sliding,
}
_loaded: dict[str, torch.nn.Module] = {}


def _model(name: str) -> torch.nn.Module:
    if name not in _loaded:
        _loaded[name] = MODELS[name](seed=7)
    return _loaded[name]


@dataclass
class Scenario:
    """One random conversation: what is fed, and the dual cache's options."""

    seed: int
    model: str
    batch: int
    pads: list[int]  # leading pads of each row in the first turn
    turns: list[tuple[int, int]]  # (new prompt tokens, max_new_tokens) per turn
    share_at: int | None  # turn at which a one-sequence conversation continues as `batch` sequences
    crops: list[int] = field(default_factory=list)  # tokens cropped from the cache before each turn (0: none)
    options: dict = field(default_factory=dict)
    full: bool = True  # budget at or above the context: compare with DynamicCache

    def describe(self) -> str:
        return (f"seed={self.seed} model={self.model} batch={self.batch} pads={self.pads} turns={self.turns} "
                f"share_at={self.share_at} crops={self.crops} options={self.options}")


def draw(seed: int) -> Scenario:
    """The scenario of `seed`."""
    rng = random.Random(seed)
    model = rng.choice(sorted(MODELS))
    share_at = rng.choice([None, None, 1]) if model != "sliding-only" or rng.random() < 0.5 else None
    batch = rng.choice([1, 2, 3]) if share_at is None else rng.choice([2, 3])
    first_batch = 1 if share_at is not None else batch
    pads = [0] * first_batch if first_batch == 1 else \
        [rng.choice([0, 0, rng.randint(1, 12)]) for _ in range(first_batch)]
    # windows crossed both ways: short turns that stay inside the window, long ones that pass it
    turns = [(rng.choice([rng.randint(1, WINDOW // 2), rng.randint(WINDOW // 2, 2 * WINDOW)]), rng.randint(1, 20))
             for _ in range(rng.randint(2, 4))]
    options = {"n_sink": rng.randint(0, 4), "window": rng.randint(1, 16),
               "retrieval_threads": rng.choice([0, 1, 2]), "speculator": rng.choice(["self", "self", "ngram", "none"]),
               "selector": rng.choice(["lowbit", "lowbit", "exact"]), "prefill_chunk_size": rng.choice([8, 64, 8192]),
               "early_layers": rng.choice([0, 2])}
    crops = [0] + [rng.choice([0, 0, rng.randint(1, 6)]) for _ in turns[1:]]  # continue from an earlier point
    full = rng.random() < 0.6
    total = max(pads, default=0) + sum(n + m for n, m in turns) + 1
    if full:
        options["budget"] = rng.choice([4096, max(0, total - options["n_sink"] - options["window"])])
        options["early_layer_budget"] = 4096
    else:
        options["budget"] = rng.randint(1, 12)
        options["early_layer_budget"] = rng.randint(options["budget"], 24)
    return Scenario(seed, model, batch, pads, turns, share_at, crops, options, full)


def converse(model, cache, scenario: Scenario) -> list[torch.Tensor]:
    """Drive `cache` through the scenario's turns with greedy `generate()`; returns each call's new tokens."""
    gen = torch.Generator().manual_seed(scenario.seed)
    rows = len(scenario.pads)
    sequences = mask = None
    shared = 0  # positions a shared prefix holds once for every sequence (never cropped)
    outputs = []
    for turn, (new, max_new) in enumerate(scenario.turns):
        stored = cache.get_seq_length()
        crop = scenario.crops[turn] if turn < len(scenario.crops) else 0
        # a crop that keeps the sink and leading pads, while no sliding window has been passed (past it, a window
        # no longer holds what an earlier point needs: the dual cache refuses, test_crop_between_requests)
        if crop and stored - crop > max(scenario.pads) + scenario.options["n_sink"] and stored - crop >= shared and \
                (scenario.model.startswith("full") or stored < WINDOW):
            cache.crop(-crop)
            sequences, mask = sequences[:, : stored - crop], mask[:, : stored - crop]
        if turn == scenario.share_at:  # the stored sequence becomes a prefix `batch` sequences continue
            if isinstance(cache, DynamicCache):
                cache.batch_repeat_interleave(scenario.batch)
            rows, shared = scenario.batch, stored
            sequences, mask = sequences.expand(rows, -1), mask.expand(rows, -1)
        if sequences is None:  # row r: pads[r] leading pads, then real tokens to the common width
            width = max(scenario.pads) + new
            ids = torch.randint(3, VOCAB, (rows, width), generator=gen)
            mask = torch.ones_like(ids)
            for row, pad in enumerate(scenario.pads):
                ids[row, :pad], mask[row, :pad] = 0, 0
        else:
            tokens = torch.randint(3, VOCAB, (rows, new), generator=gen)
            ids = torch.cat([sequences, tokens], dim=1)
            mask = torch.cat([mask, torch.ones_like(tokens)], dim=1)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             **{cache_kwarg_name(model): cache})
        outputs.append(out[:, ids.shape[1]:])
        mask = torch.cat([mask, torch.ones_like(outputs[-1])], dim=1)
        sequences = out
    return outputs


def run(seed: int) -> int:
    """Run one scenario; returns the number of generate() calls compared. Raises AssertionError naming the seed."""
    scenario = draw(seed)
    model = _model(scenario.model)
    if scenario.full:
        reference = converse(model, DynamicCache(config=model.config), scenario)
        against = "DynamicCache"
    else:
        with DualDecoderCache(model.config, **{**scenario.options, "retrieval_threads": 0}) as sync:
            reference = converse(model, sync, scenario)
        against = "the synchronous dual cache"
    with DualDecoderCache(model.config, **scenario.options) as cache:
        dual = converse(model, cache, scenario)
    for call, (mine, theirs) in enumerate(zip(dual, reference)):
        assert torch.equal(mine, theirs), (
            f"call {call} differs from {against}: {mine.tolist()} vs {theirs.tolist()}\n{scenario.describe()}\n"
            f"rerun: DUAL_DIFF_SEEDS={seed} pytest tests/test_differential.py -m ''"
        )
    return len(dual)


def _seeds() -> list[int]:
    given = os.environ.get("DUAL_DIFF_SEEDS")
    return [int(s) for s in given.split(",")] if given else list(range(24))


@pytest.mark.parametrize("seed", _seeds())
def test_random_conversations_equal_the_reference(seed):
    run(seed)


def test_the_fixed_slice_covers_every_layer_type_mix_and_both_window_crossings():
    """The default run's seeds draw every model, full and partial budgets, shared prefixes, left padding, and
    conversations whose tokens end inside and past the window."""
    scenarios = [draw(seed) for seed in range(24)]
    assert {s.model for s in scenarios} == set(MODELS)
    assert {s.full for s in scenarios} == {True, False}
    assert any(s.share_at is not None for s in scenarios) and any(max(s.pads) > 0 for s in scenarios)
    assert any(any(s.crops) and s.model.startswith("full") for s in scenarios)
    sliding = [s for s in scenarios if s.model.startswith("sliding")]
    ends = {s.turns[0][0] + s.turns[0][1] + 1 <= WINDOW < sum(n + m for n, m in s.turns) for s in sliding}
    assert ends == {True, False}  # first turn inside the window and the conversation past it, and not


@pytest.mark.slow
def test_many_random_conversations_equal_the_reference():
    start = int(os.environ.get("DUAL_DIFF_START", random.randrange(10**6)))
    runs = int(os.environ.get("DUAL_DIFF_RUNS", 300))
    print(f"differential: seeds {start}..{start + runs - 1}")
    calls = sum(run(seed) for seed in range(start, start + runs))
    print(f"differential: {runs} conversations, {calls} generate() calls, all equal")
