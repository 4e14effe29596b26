"""The device re-rank (`rerank.rerank_valid`) and the next-position candidates (`selectors.base.next_positions`)
against plain per-(sequence, KV head) loops on random inputs."""

from __future__ import annotations

import pytest
import torch

from dual_cache.selection.rerank import rerank_valid
from dual_cache.selection.selectors.base import next_positions


def rerank_loop(query, keys, valid, budget, scaling, softcap=None):
    batch, kv_heads, fetched, dim = keys.shape
    group = query.shape[1] // kv_heads
    out = torch.zeros_like(valid)
    for b in range(batch):
        for h in range(kv_heads):
            slots = [i for i in range(fetched) if valid[b, h, i]]
            if not slots:
                continue
            mass = torch.zeros(len(slots), dtype=torch.float64)
            for g in range(group):
                q = query[b, h * group + g].double()
                logits = torch.stack([q @ keys[b, h, i].double() for i in slots]) * scaling
                if softcap is not None:
                    logits = torch.tanh(logits / softcap) * softcap
                mass += torch.softmax(logits, 0)
            for rank in torch.argsort(mass, descending=True)[:budget].tolist():
                out[b, h, slots[rank]] = True
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_rerank_keeps_the_budget_of_most_group_mass(seed, softcap):
    generator = torch.Generator().manual_seed(seed)
    batch, q_heads, kv_heads, fetched, dim, budget = 3, 6, 2, 24, 8, 5
    query = torch.randn(batch, q_heads, dim, generator=generator)
    keys = torch.randn(batch, kv_heads, fetched, dim, generator=generator)
    valid = torch.rand(batch, kv_heads, fetched, generator=generator) < 0.7
    valid[0, 1] = False  # a row without entries
    valid[1, 0] = False
    valid[1, 0, :3] = True  # fewer valid entries than the budget: all kept
    got = rerank_valid(query, keys, valid, budget, 0.35, softcap)
    assert torch.equal(got, rerank_loop(query, keys, valid, budget, 0.35, softcap))
    assert not (got & ~valid).any()
    assert (got.sum(-1) <= budget).all()


def test_rerank_with_budget_covering_the_slot_changes_nothing():
    valid = torch.rand(2, 1, 4, generator=torch.Generator().manual_seed(4)) < 0.5
    keys = torch.randn(2, 1, 4, 8)
    assert rerank_valid(torch.randn(2, 2, 8), keys, valid, 4, 1.0) is valid


def next_loop(attended, chosen, chosen_valid, mask, width):
    batch, kv_heads, _ = attended.shape
    positions = torch.zeros(batch, kv_heads, width, dtype=torch.long)
    valid = torch.zeros(batch, kv_heads, width, dtype=torch.bool)
    for b in range(batch):
        for h in range(kv_heads):
            held = {int(p) for p, v in zip(chosen[b, h], chosen_valid[b, h]) if v}
            wanted = sorted({int(p) + 1 for p in attended[b, h] if p >= 0 and p + 1 < mask.shape[1]
                             and mask[b, p + 1] and int(p) + 1 not in held})[:width]
            positions[b, h, :len(wanted)] = torch.tensor(wanted, dtype=torch.long)
            valid[b, h, :len(wanted)] = True
    return positions, valid


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_next_positions_match_a_loop(seed):
    generator = torch.Generator().manual_seed(seed)
    batch, kv_heads, end, n, k, width = 3, 2, 60, 12, 10, 6
    attended = torch.stack([torch.stack([torch.randperm(end, generator=generator)[:n] for _ in range(kv_heads)])
                            for _ in range(batch)])
    attended[torch.rand(attended.shape, generator=generator) < 0.3] = -1
    attended[0, 0, 0] = end - 1  # its next position lies past the candidates
    chosen = torch.stack([torch.stack([torch.randperm(end, generator=generator)[:k].sort().values
                                       for _ in range(kv_heads)]) for _ in range(batch)])
    chosen_valid = torch.rand(chosen.shape, generator=generator) < 0.8
    mask = torch.rand(batch, end, generator=generator) < 0.85
    got = next_positions(attended, chosen, chosen_valid, mask, width)
    want = next_loop(attended, chosen, chosen_valid, mask, width)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])
