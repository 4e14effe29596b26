"""The max-batch search (eval/throughput/bench_capacity.py) with fake probes: which limit binds, the predicted batch is the one
measured, bisection when the prediction fails, extrapolation when a run would take too long, CPU's shared pool."""

from __future__ import annotations

import math

import pytest

from dual_cache.eval.throughput.bench_capacity import (
    BATCH_CAP, DEVICE, FAILED, HOST, MemoryLimits, find_max_batch, footprint, predict_batches,
)
from dual_cache.eval.throughput.bench_cell import empty_row
from dual_cache.eval.throughput.bench_grid import BenchGrid

GRID = BenchGrid(new_tokens=12, warmup_steps=2)
WEIGHTS = 5_000


class FakeCell:
    """Rows as `run_cell` returns them, for a method whose memory and time are affine in the batch."""

    def __init__(self, device_fixed=1_000, device_per=100, host_per=0, cuda=True, oom_above=None, ms=(10.0, 5.0),
                 prefill=(0.0, 1.0)):
        self.device_fixed, self.device_per, self.host_per = device_fixed, device_per, host_per
        self.cuda, self.oom_above, self.ms, self.prefill = cuda, oom_above, ms, prefill
        self.calls: list[int] = []

    def __call__(self, batch: int) -> dict:
        self.calls.append(batch)
        row = empty_row("dual-self", 1024, batch, 256, GRID)
        if self.oom_above is not None and batch > self.oom_above:
            row["error"] = "out of memory: CUDA out of memory. Tried to allocate"
            return row
        row.update(device_bytes_per_request=self.device_per, host_bytes_per_request=self.host_per,
                   decode_steps=11, ms_per_step=self.ms[0] + self.ms[1] * batch,
                   prefill_s=self.prefill[0] + self.prefill[1] * batch)
        row["decode_tokens_per_s"] = 1000 * batch / row["ms_per_step"]
        if self.cuda:
            row["cuda_peak_total_bytes"] = WEIGHTS + self.device_fixed + self.device_per * batch
            row["cuda_decode_peak_total_bytes"] = WEIGHTS + self.device_per * batch // 2
        return row


def test_device_cap_binds_and_the_predicted_batch_is_measured():
    cell = FakeCell()
    limits = MemoryLimits(device_bytes=WEIGHTS + 1_000 + 37 * 100 + 50, host_bytes=10 ** 9)
    found = find_max_batch(cell, limits, WEIGHTS)
    assert cell.calls == [1, 2, 37]
    assert (found["max_batch"], found["limited_by"], found["how"], found["measured_at_batch"]) == (37, DEVICE,
                                                                                                    "measured", 37)
    assert found["decode_tokens_per_s"] == pytest.approx(1000 * 37 / (10 + 5 * 37))
    assert found["predicted"]["device"] == 37 and found["predicted"]["host"] == math.inf
    assert found["predicted"]["device_decode"] > 37  # without the prefill's extra memory, more would fit
    assert [run["batch"] for run in found["runs"]] == [1, 2, 37]


def test_host_memory_binds():
    cell = FakeCell(host_per=1_000)
    found = find_max_batch(cell, MemoryLimits(device_bytes=10 ** 9, host_bytes=12_500), WEIGHTS)
    assert (found["max_batch"], found["limited_by"]) == (12, HOST)
    assert cell.calls == [1, 2, 12]


def test_failed_prediction_bisects_to_the_largest_fitting_batch():
    cell = FakeCell(oom_above=20)  # memory not affine past 20: the predicted 37 runs out of memory
    limits = MemoryLimits(device_bytes=WEIGHTS + 1_000 + 37 * 100, host_bytes=10 ** 9)
    found = find_max_batch(cell, limits, WEIGHTS, max_retries=10)
    assert (found["max_batch"], found["limited_by"], found["how"]) == (20, DEVICE, "measured")
    assert cell.calls[:3] == [1, 2, 37] and cell.calls[-1] in (20, 21)
    assert any(run["error"] and run["error"].startswith("out of memory") for run in found["runs"])
    few = find_max_batch(FakeCell(oom_above=20), limits, WEIGHTS, max_retries=1)
    assert 2 <= few["max_batch"] <= 20 and len(few["runs"]) == 4  # 1, 2, 37, one bisection point


def test_nothing_fits_and_batch_one_only():
    assert find_max_batch(FakeCell(oom_above=0), MemoryLimits(None, 10 ** 9), WEIGHTS)["max_batch"] == 0
    over = find_max_batch(FakeCell(), MemoryLimits(device_bytes=WEIGHTS + 1_050, host_bytes=10 ** 9), WEIGHTS)
    assert (over["max_batch"], over["limited_by"], over["how"]) == (0, DEVICE, "nothing fitted")
    one = find_max_batch(FakeCell(oom_above=1), MemoryLimits(None, 10 ** 9), WEIGHTS)
    assert (one["max_batch"], one["limited_by"], one["measured_at_batch"]) == (1, DEVICE, 1)
    host_error = FakeCell()
    original = host_error.__call__

    def refused(batch):
        row = original(batch)
        if batch > 1:
            row["error"] = "host memory: the KV cache needs ~9 GiB"
        return row

    assert find_max_batch(refused, MemoryLimits(None, 10 ** 9), WEIGHTS)["limited_by"] == HOST


def test_batch_cap():
    cell = FakeCell()
    found = find_max_batch(cell, MemoryLimits(device_bytes=None, host_bytes=10 ** 9), WEIGHTS, cap=16)
    assert (found["max_batch"], found["limited_by"]) == (16, BATCH_CAP)
    assert find_max_batch(FakeCell(), MemoryLimits(None, 10 ** 9), WEIGHTS, cap=1)["limited_by"] == BATCH_CAP


def test_too_long_runs_are_extrapolated_not_made():
    cell = FakeCell(prefill=(0.0, 2.0))  # 2 s of prefill per sequence
    limits = MemoryLimits(device_bytes=WEIGHTS + 1_000 + 100 * 100, host_bytes=10 ** 9)
    found = find_max_batch(cell, limits, WEIGHTS, max_cell_seconds=60)
    assert cell.calls == [1, 2]  # batch 100 would take ~200 s
    assert found["max_batch"] == 100 and found["measured_at_batch"] == 2
    assert found["how"] == "extrapolated from batches 1, 2"
    assert found["ms_per_step"] == pytest.approx(10 + 5 * 100)
    assert found["decode_tokens_per_s"] == pytest.approx(1000 * 100 / (10 + 5 * 100))
    assert found["prefill_s"] == pytest.approx(200)


def test_cpu_pool_is_shared_by_weights_device_and_host_bytes():
    cell = FakeCell(device_per=100, host_per=900, cuda=False)  # device bytes from the cache's accounting
    row = cell(3)
    used = footprint(row, WEIGHTS)
    assert (used.device, used.host) == (WEIGHTS + 300, 2_700)
    limits = MemoryLimits(device_bytes=10 ** 9, host_bytes=WEIGHTS + 25 * 1_000 + 10, shared=True)
    found = find_max_batch(cell, limits, WEIGHTS)
    assert (found["max_batch"], found["limited_by"]) == (25, HOST)
    # without the shared pool, host bytes alone would allow more
    alone = predict_batches(footprint(cell(1), WEIGHTS), footprint(cell(2), WEIGHTS),
                            MemoryLimits(device_bytes=None, host_bytes=limits.host_bytes))
    assert alone["host"] > 25


def test_a_failed_run_stops_the_search():
    cell = FakeCell()
    original = cell.__call__

    def broken(batch):
        row = original(batch)
        if batch > 1:
            row["error"] = "failed: TypeError: offloaded cache cannot do this"
        return row

    found = find_max_batch(broken, MemoryLimits(None, 10 ** 9), WEIGHTS)
    assert (found["max_batch"], found["limited_by"]) == (1, FAILED)


def test_a_falling_time_fit_is_not_extrapolated_downwards():
    cell = FakeCell(ms=(50.0, -10.0), prefill=(0.0, 2.0))  # noisy timings: batch 2 stepped faster than batch 1
    limits = MemoryLimits(device_bytes=WEIGHTS + 1_000 + 100 * 100, host_bytes=10 ** 9)
    found = find_max_batch(cell, limits, WEIGHTS, max_cell_seconds=60)
    assert found["max_batch"] == 100 and found["ms_per_step"] == 30.0  # the largest measured batch's step time
    assert found["decode_tokens_per_s"] == pytest.approx(1000 * 100 / 30.0)
