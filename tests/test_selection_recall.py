"""`dual-decoder recall --ruler-task`: the prompts it scores are the RULER table's (the harness's items for the same
task, length and sample), and the exact selector's recall and top-k share are what their definitions say."""

import argparse

import pytest
import torch

from dual_cache.eval.quality import harness
from dual_cache.eval.quality.chat_format import prompt_format
from dual_cache.eval.selection import selection_recall
from tests.test_eval_support import char_tokenizer


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    selection_recall.add_recording_arguments(parser)
    return parser.parse_args(argv)


def test_ruler_prompts_are_the_ruler_tables():
    tok = char_tokenizer()
    args = _args(["--ruler-task", "vt", "--tokens", "3000"])
    (item,) = [i for i in harness.ruler_items(tok, ["vt"], [3000], 2, fmt=prompt_format(tok)) if i.sample == 1]
    assert selection_recall.prompt_ids(args, tok, 1) == item.input_ids
    with pytest.raises(SystemExit):
        _args(["--ruler-task", "qa_1"])  # needs a downloaded corpus


def test_exact_recall_is_one_and_share_is_the_top_k_fraction_of_candidate_mass():
    torch.manual_seed(5)
    queries, keys = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 300, 16)
    (out,) = selection_recall.layer_recalls(queries, keys, 0.25, 32, [("exact", {})], n_sink=4, window=16).values()
    assert torch.allclose(out["recall"], torch.ones(6))
    hi = 300 - 3 - 16  # the first query's candidates: positions 4 .. hi - 1 (softmax over them alone)
    logits = torch.einsum("hd,hkd->hk", queries[0, :, 0], keys[0].repeat_interleave(2, 0)[:, 4:hi]) * 0.25
    mass = torch.softmax(logits, -1).reshape(2, 2, -1).sum(1)  # summed over each KV head's query group
    share = mass.topk(32, -1).values.sum(-1) / mass.sum(-1)
    assert torch.allclose(out["share"][:2], share, atol=1e-5)
