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


def test_scan_bounds_never_skip_a_group_holding_a_shortlisted_position():
    """The bound of `scan_bounds` (per-channel group range and the query's sign) is sound: on random queries and keys
    (fresh seeds) a group it calls skippable holds no position of the shortlist, and a shortlist of every position
    skips nothing."""
    from dual_cache.engine.codes import GROUP
    from dual_cache.eval.selection.scan_bounds import skippable

    seed = int(torch.randint(0, 2**31, ()).item())
    generator = torch.Generator().manual_seed(seed)
    kv_heads, group, dim, first, groups = 2, 3, 16, 4, 12
    query = torch.randn(1, kv_heads * group, dim, generator=generator) * 3
    keys = torch.randn(1, kv_heads, first + groups * GROUP + 5, dim, generator=generator)
    keys[0, :, first + 5 * GROUP : first + 6 * GROUP] *= 0.05  # a quiet group: some bound must fall below
    end = first + groups * GROUP
    (skip_all, total), (skip_some, _) = skippable(query, keys, first, end, 0.25, [groups * GROUP, 8])
    assert total == kv_heads * groups and skip_all == 0, f"seed {seed}"
    q = query[0].view(kv_heads, group, dim)
    k = keys[0, :, first:end]
    logits = 0.25 * torch.einsum("hgd,hnd->hgn", q, k)
    score = (logits - torch.logsumexp(logits, -1, keepdim=True)).amax(1)  # (H_kv, positions)
    top = score.topk(8, dim=-1).indices // GROUP  # the shortlist's groups
    low, high = k.view(kv_heads, groups, GROUP, dim).amin(2), k.view(kv_heads, groups, GROUP, dim).amax(2)
    upper = 0.25 * torch.maximum(q[:, :, None, :] * low[:, None], q[:, :, None, :] * high[:, None]).sum(-1)
    bound = (upper - torch.logsumexp(logits, -1)[..., None]).amax(1)
    assert (bound.view(kv_heads, groups, 1) >= score.view(kv_heads, groups, GROUP) - 1e-5).all(), f"seed {seed}"
    threshold = score.topk(8, dim=-1).values[:, -1:]
    skipped = bound < threshold
    assert not skipped.gather(1, top).any(), f"seed {seed}"
    assert skip_some == int(skipped.sum()) > 0, f"seed {seed}"


def test_speculator_variants_count_hits_through_generate_and_restore_the_library_speculator():
    """Every variant of `speculator_variants` decodes a batch through `generate()` with the dual cache and counts, per
    row, one speculated step per decode step after the first; the library's speculator factory is back afterwards."""
    from types import SimpleNamespace

    from dual_cache.eval.selection import speculator_variants as tool
    from dual_cache.generate import step

    model = tiny_llama(seed=5)
    made = step.make_speculator
    prompt = torch.randint(3, 90, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    prompt[100:120] = prompt[20:40]  # a copied span: lookup has something to find
    for variant in tool.VARIANTS:
        for sample in (False, True):
            # a batch of two rows of different lengths (left-padded): one count per row
            counts = tool.row_hits(model, SimpleNamespace(eos_token_id=0), [prompt, prompt[7:]], variant, 16, 6, sample)
            assert len(counts) == 2, (variant, sample)
            for hit, steps in counts:
                assert steps == 5 and 0 <= hit <= steps, (variant, sample)
    assert step.make_speculator is made
    summary = tool.summary([(4, 5), (1, 5)])
    assert summary["mean"] == 0.5 and summary["worst"] == 0.2 and summary["rate"] == 0.5


def test_resident_capacities_replay_on_a_tiny_model():
    """`resident_candidates --capacities`: today's slots and the default design at 2x and 3x the budget, replayed on
    a tiny model's decode steps; a larger set never copies more, and recall is a finite share."""
    from dual_cache.eval.selection import resident_candidates as resident

    model = tiny_llama(seed=5)
    use_recorder(model)
    policies = resident.capacity_policies([2, 3])
    assert [p.capacity for p in policies] == [None, 2, 3]
    tallies = {p.name: resident.Tally() for p in policies}
    args = argparse.Namespace(steps=5, temperature=0.0, sample_seed=0, n_sink=4, window=16)
    ids = torch.randint(3, 90, (700,), generator=torch.Generator().manual_seed(6)).tolist()
    counts = resident.replay(model, ids, args, policies, tallies)
    assert counts["hit"] + counts["miss"] == args.steps - 1
    copied = {p.capacity: sum(tallies[p.name].copied) for p in policies}
    assert copied[3] <= copied[2] <= copied[None]
    for tally in tallies.values():
        joined = torch.cat(tally.recall["hit"] + tally.recall["miss"])
        assert joined.numel() > 0 and torch.isfinite(joined).all() and (joined >= 0).all()
