"""The benchmark-only forced miss rate (eval/throughput/forced_miss.py): the split it draws, and repairs through the real loop."""

from __future__ import annotations

import pytest
import torch

from dual_cache.eval.throughput.forced_miss import ForcedMissCache
from dual_cache.layer.repair import StepRows
from tests.conftest import tiny_llama

OPTIONS = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 0, "retrieval_threads": 0}


def test_split_has_the_rate_among_live_rows_and_passes_the_first_step_through():
    model = tiny_llama(seed=3)
    cache = ForcedMissCache(model.config, miss_rate=0.3, seed=7, **OPTIONS)
    batch = 20_000
    live = tuple(i for i in range(batch) if i % 4)  # finished sequences are never repaired
    assert cache.begin_step(StepRows(live, (), live, batch, first=True)).rows.repair == live
    hit = [i % 2 == 0 for i in range(batch)]
    rows = cache.begin_step(StepRows(tuple(i for i in live if not hit[i]), tuple(i for i in live if hit[i]), live,
                                     batch)).rows
    assert set(rows.repair) <= set(live)
    assert len(rows.repair) / len(live) == pytest.approx(0.3, abs=0.02)
    assert rows.check == ()  # forced hits are not drift-checked
    assert cache.forced_rows == len(live)
    again = ForcedMissCache(model.config, miss_rate=0.3, seed=7, **OPTIONS)
    assert again.begin_step(StepRows((), live, live, batch)).rows.repair == rows.repair  # seeded, whatever the split
    cache.close()
    again.close()


@pytest.mark.parametrize("rate, repaired_steps", [(0.0, 1), (1.0, None)])
def test_generate_repairs_every_step_or_only_the_first(rate, repaired_steps):
    model = tiny_llama(seed=11)
    ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(2))
    cache = ForcedMissCache(model.config, miss_rate=rate, **OPTIONS)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=7, min_new_tokens=7, do_sample=False,
                   cache=cache)
    stats = cache.stats()
    assert stats["repaired_steps"] == (stats["steps"] if repaired_steps is None else repaired_steps)


def test_bad_rates_and_no_repair_are_refused():
    config = tiny_llama().config
    for rate in (-0.1, 1.5, True, "0.2"):
        with pytest.raises(ValueError, match="miss_rate"):
            ForcedMissCache(config, miss_rate=rate, **OPTIONS)
    with pytest.raises(ValueError, match="miss_repair=False"):
        ForcedMissCache(config, miss_rate=0.2, miss_repair=False, **OPTIONS)
