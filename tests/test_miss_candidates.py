"""The miss-candidates tool (eval/selection/miss_candidates.py) and the natural-text prompts at tiny sizes."""

from __future__ import annotations

import argparse

import torch

from dual_cache.eval.quality.natural_text import natural_prompt_ids
from dual_cache.eval.selection import miss_candidates as tool
from dual_cache.eval.selection.decode_steps import use_recorder
from tests.conftest import tiny_llama


def test_every_candidate_is_scored_on_a_tiny_model():
    model = tiny_llama(seed=3)
    use_recorder(model)
    args = argparse.Namespace(steps=6, budget=8, n_sink=2, window=4, skip_layers=0, factors=[1, 2], leads=[1],
                              cosines=[0.9])
    scores = tool.Scores()
    ids = torch.randint(3, 90, (120,), generator=torch.Generator().manual_seed(4)).tolist()
    tool.decode_and_score(model, ids, args, scores)
    assert scores.steps["miss"] + scores.steps["hit"] == args.steps - 1  # the first forward has no chooser yet
    names = set(scores.miss) | set(scores.hit)
    assert {"spec", "prev-real", "rerank-1", "rerank-2+next", "all-2", "lookahead-1", "heads-0.9"} <= names
    for kind in (scores.miss, scores.hit):
        for name, values in kind.items():
            joined = torch.cat(values)
            assert torch.isfinite(joined).all() and (joined >= 0).all(), name
            if name.startswith(("spec", "prev-real", "rerank", "lookahead")):
                assert (joined <= 1 + 1e-5).all(), name  # budget entries never hold more than the exact top-k


def test_natural_prompts_are_distinct_passages_of_the_requested_length(embedded):
    _, tokenizer = embedded
    first, second = natural_prompt_ids(tokenizer, 512, 0), natural_prompt_ids(tokenizer, 512, 1)
    assert 480 <= len(first) <= 512 and 480 <= len(second) <= 512
    assert first != second
    assert natural_prompt_ids(tokenizer, 512, 0) == first
