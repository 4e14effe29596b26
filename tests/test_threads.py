"""Concurrent generate() calls on one shared model, each with its own dual cache (and one with the default cache),
give the same tokens as the same calls run one after another: nothing is switched on the shared model per call."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from tests.conftest import tiny_llama

# (prompt length, cache_config or None for the default cache): different lengths, budgets, speculators, threads
JOBS = [
    (150, {"budget": 16, "window": 8, "early_layers": 0, "speculator": "self", "retrieval_threads": 1}),
    (220, {"budget": 32, "window": 16, "speculator": "ngram", "selector": "lowbit", "lowbit_factor": 2}),
    (90, {"budget": 4096, "window": 8, "speculator": "none"}),
    (120, None),
]


class _WatchConfig(StoppingCriteria):
    """Records the model's attention implementation at every step (it must never change)."""

    def __init__(self, model, seen):
        self.model, self.seen = model, seen

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.add(self.model.config._attn_implementation)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _run(model, job: int, seen: set) -> torch.Tensor:
    length, options = JOBS[job]
    ids = torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(40 + job))
    kwargs = {} if options is None else {"cache_implementation": "dual", "cache_config": options}
    return model.generate(ids, max_new_tokens=16, do_sample=False,
                          stopping_criteria=StoppingCriteriaList([_WatchConfig(model, seen)]), **kwargs)


def _concurrent_equals_sequential(repetitions: int) -> None:
    model = tiny_llama(seed=41)
    seen: set = set()
    expected = [_run(model, job, seen) for job in range(len(JOBS))]
    for _ in range(repetitions):
        results, errors = [None] * len(JOBS), []
        barrier = threading.Barrier(len(JOBS))

        def work(job):
            try:
                barrier.wait()
                results[job] = _run(model, job, seen)
            except Exception as error:  # surfaced below with the job that raised
                errors.append((job, repr(error)))

        threads = [threading.Thread(target=work, args=(job,)) for job in range(len(JOBS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        for job in range(len(JOBS)):
            assert torch.equal(results[job], expected[job]), f"job {job} differs from its sequential run"
    assert seen == {"sdpa"}


def test_concurrent_generate_calls_on_one_model_match_sequential_runs():
    _concurrent_equals_sequential(repetitions=3)


@pytest.mark.slow
def test_concurrent_generate_calls_on_one_model_match_sequential_runs_20_times():
    _concurrent_equals_sequential(repetitions=20)
