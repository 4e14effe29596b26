"""`python -m dual_cache.eval.gpu_check` end to end at toy sizes on CPU: exit status, PASS lines, the JSON."""

from __future__ import annotations

import json
import threading
from collections import Counter

import pytest
import torch

from dual_cache import DualDecoderCache
from dual_cache.eval import gpu_check
from dual_cache.eval.throughput.bench_models import random_model
from dual_cache.runtime.streams import simulated_streams


def test_gpu_check_cli_on_cpu_writes_its_json(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("[PASS]") == 4 and "default selector" in printed
    assert "no host synchronization inside a steady-state decode step" in printed
    with open(tmp_path / "gpu_check.json", encoding="utf-8") as handle:
        written = json.load(handle)
    assert written["device"] == "cpu" and len(written["checks"]) == 4 and written["selector"]


def test_gpu_check_refuses_a_full_size_run_without_cuda(capsys):
    assert gpu_check.main(["--device", "cpu"]) == 2
    assert "--tiny" in capsys.readouterr().err


class _SyncDebugModeOnCpu:
    """A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`: while on, any host synchronization
    `SyncCounter` sees on this thread raises as CUDA's does, except the decode loop's deliberate reads
    (`streams.to_host`, which the real mode lets through too); `SimulatedStreams` counts draining its copy stream,
    as `CudaStreams.close` synchronizes its stream."""

    def __init__(self):
        self.counter = None

    def set(self, mode):
        from dual_cache.runtime.sync_points import SyncCounter

        if mode == "error" and self.counter is None:
            self.counter = SyncCounter()
            self.counter.by_op = _Raising()
            self.counter.__enter__()
        elif mode == 0 and self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.counter = None


class _Raising(Counter):
    def __setitem__(self, op, count):
        if op != "host wait: to_host":
            raise RuntimeError(f"called a synchronizing CUDA operation ({op})")
        super().__setitem__(op, count)


@pytest.fixture
def sync_debug_mode_on_cpu(monkeypatch):
    mode = _SyncDebugModeOnCpu()
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", mode.set)
    yield mode
    mode.set(0)


def _steady_state_inputs():
    config = gpu_check.small_real_shaped_config(tiny=True)
    model = random_model(config, torch.float32, torch.device("cpu"), seed=0)
    ids = torch.randint(1, config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(1))
    return model, ids, {"budget": 32, "n_sink": 4, "window": 64}


def test_the_strict_branch_under_simulated_streams_gives_no_false_verdict(sync_debug_mode_on_cpu):
    """The CUDA branch (sync debug mode "error") on CPU under `SimulatedStreams`: the steady-state steps pass; ending
    the request (reading the sequences back, draining the copy stream) happens after the region is left."""
    model, ids, options = _steady_state_inputs()
    with simulated_streams(max_delay_s=0.001, seed=2):
        check = gpu_check.check_no_sync_in_steady_state(model, ids, options, steps=4, strict=True)
    assert check["passed"], check["detail"]
    assert check["detail"].count("4 steps, no synchronization raised") == 2
    assert sync_debug_mode_on_cpu.counter is None  # the mode is off again


def test_the_stand_in_catches_a_strict_region_left_on_through_the_end_of_the_request(sync_debug_mode_on_cpu):
    """The negative control: the region left on until generate() returns (the check before issue 54) raises at the
    request's end, as it did on CUDA."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    model, ids, options = _steady_state_inputs()

    class FromTheThirdStepOn(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            FromTheThirdStepOn.calls += 1
            if FromTheThirdStepOn.calls == 3:
                torch.cuda.set_sync_debug_mode("error")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    with simulated_streams(max_delay_s=0.001, seed=2), pytest.raises(RuntimeError, match="copy stream drained"):
        model.generate(ids, max_new_tokens=6, do_sample=False, stopping_criteria=StoppingCriteriaList(
            [FromTheThirdStepOn()]), cache=DualDecoderCache(model.config, **options, miss_repair=False,
                                                             retrieval_threads=2))
    assert not any(t.name.startswith(("dual-simulated", "dual-retriever")) for t in threading.enumerate())
