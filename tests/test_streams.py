"""The CUDA ordering of the decode step's transfers, run on CPU: `SimulatedStreams` gives the copy stream a thread of
its own with random delays, so a transfer consumed before its event — a selection slot read before its copy landed,
a staging buffer reused too early, a host store read before its tokens were written — changes tokens or selections.
The pipelined path under simulation must equal the synchronous reference exactly; with the compute stream's waits
removed it must not (the test can fail)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dual_cache import DualDecoderCache
from dual_cache.runtime.streams import SimulatedStreams, simulated_streams
from tests.conftest import record_selections, six_layer_llama

PARTIAL = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 1, "early_layer_budget": 20}


def test_simulated_copies_run_in_order_after_their_waits():
    streams = SimulatedStreams(max_delay_s=0.005, seed=1)
    src, dst, later = torch.arange(4.0), torch.zeros(4), torch.zeros(4)
    gate = streams.record("copy")
    gate.synchronize()
    blocker = type(gate)()  # an event nothing has recorded yet: the copy stream waits for it
    streams.wait(blocker, "copy")
    streams.copy(dst, src)
    done = streams.record("copy")
    time.sleep(0.02)
    assert not done.query() and torch.equal(dst, torch.zeros(4))  # held back by the wait
    blocker._done.set()
    done.synchronize()
    assert torch.equal(dst, src)
    streams.copy(later, dst)
    streams.wait(streams.record("copy"), "compute")  # the compute stream (this thread) waits for the copy
    assert torch.equal(later, src)
    streams.close()
    assert not any(t.name == "dual-simulated-copy-stream" for t in threading.enumerate())


def _run(model, ids, mask, **options):
    """Greedy tokens with each step's logits `(steps, B, V)`, and the selections attention read."""
    cache = DualDecoderCache(model.config, **PARTIAL, **options)
    recorded = record_selections(cache)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, cache=cache,
                         return_dict_in_generate=True, output_logits=True)
    cache.close()
    return (out.sequences, torch.stack(out.logits)), recorded


def _inputs():
    ids = torch.randint(3, 96, (2, 150), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    return ids, mask


@pytest.mark.parametrize("threads, layers_in_flight, lookahead", [(1, 2, 1), (2, 3, 2), (0, 1, 0)])
def test_pipelined_under_asynchronous_copies_equals_the_synchronous_reference(threads, layers_in_flight, lookahead):
    model = six_layer_llama(seed=6)
    ids, mask = _inputs()
    reference, reference_selections = _run(model, ids, mask, retrieval_threads=0, layers_in_flight=1, lookahead=0)
    with simulated_streams(max_delay_s=0.003, seed=threads):
        out, selections = _run(model, ids, mask, retrieval_threads=threads, layers_in_flight=layers_in_flight,
                               lookahead=lookahead)
    assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])
    assert len(selections) == len(reference_selections) > 0
    for (layer_a, idx_a, valid_a, keys_a), (layer_b, idx_b, valid_b, keys_b) in zip(selections, reference_selections):
        assert layer_a == layer_b
        assert torch.equal(idx_a[valid_a], idx_b[valid_b]) and torch.equal(keys_a[valid_a], keys_b[valid_b])
    assert not any(t.name == "dual-simulated-copy-stream" for t in threading.enumerate())


def test_without_the_compute_streams_waits_the_simulation_reads_slots_too_early(monkeypatch):
    """The negative control: drop the device-side waits and the step reads delta buffers before their copies land:
    wrong tokens, or slots that are garbage (an index error), either of which the comparison above would catch."""
    model = six_layer_llama(seed=6)
    ids, mask = _inputs()
    reference, _ = _run(model, ids, mask, retrieval_threads=0, layers_in_flight=1, lookahead=0)
    wait = SimulatedStreams.wait

    def skip_compute_waits(self, event, on):
        if on == "copy":
            wait(self, event, on)

    monkeypatch.setattr(SimulatedStreams, "wait", skip_compute_waits)
    with simulated_streams(max_delay_s=0.02, seed=3):
        try:
            out, _ = _run(model, ids, mask, retrieval_threads=1, layers_in_flight=2, lookahead=1)
            corrupted = not torch.equal(out[1], reference[1])  # some step applied a delta its copy had not reached
        except IndexError:  # the delta's slots were read before they arrived
            corrupted = True
    assert corrupted


def test_overlap_comes_from_the_device_clock_when_there_is_one():
    """With a device clock (CUDA events; here the simulated one), `overlap_ratio` is the share of the compute
    stream's step time not spent waiting for copies: slow copies show as waits; a CPU device has no clock and keeps
    the host-side ratio."""
    model = six_layer_llama(seed=8)
    ids, mask = _inputs()
    with simulated_streams(max_delay_s=0.01, seed=4):
        cache = DualDecoderCache(model.config, **PARTIAL, retrieval_threads=1)
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache=cache)
        cache.close()
    stats = cache.stats()
    assert 0 < stats["device_wait_seconds"] < stats["device_step_seconds"]
    idle = stats["device_wait_seconds"] + stats["device_starved_seconds"]
    assert stats["overlap_ratio"] == pytest.approx(1 - idle / stats["device_step_seconds"])
    host = DualDecoderCache(model.config, **PARTIAL, retrieval_threads=0)
    model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache=host)
    assert host.stats()["device_step_seconds"] == 0 and host.stats()["overlap_ratio"] == 0.0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_request_leaves_no_copy_stream_behind(error):
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Interrupt(StoppingCriteria):
        calls = 0

        def __call__(self, input_ids, scores, **kwargs):
            Interrupt.calls += 1
            if Interrupt.calls == 3:
                raise error("interrupted mid-decode")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = six_layer_llama(seed=9)
    ids, mask = _inputs()
    with simulated_streams(max_delay_s=0.005, seed=5):
        cache = DualDecoderCache(model.config, **PARTIAL, retrieval_threads=1)
        with pytest.raises(error):
            model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache=cache,
                           stopping_criteria=StoppingCriteriaList([Interrupt()]))
    assert cache.closed
    assert not any(t.name.startswith(("dual-simulated", "dual-retriever")) for t in threading.enumerate())


@pytest.mark.parametrize("threads", [1, 0])
def test_a_slow_host_selection_shows_as_device_idle_time(monkeypatch, threads):
    """The device idles for selections in two ways: waiting for a copy (an event wait), and with no work at all while
    the launch thread waits for a host selection job (the job still running when its layer acquires; on the
    synchronous path, the job itself). With copies that land at once and a host selection slowed to 40 ms a layer,
    nearly all of the step is the second kind: the measure sees at least half the step idle, the copy waits alone
    (the measure before issue 54) close to none."""
    from dual_cache.transfer.schedule import TransferSchedule

    submit = TransferSchedule.submit

    def slow_submit(self, layer_idx, job, *args, **kwargs):
        def slow_job(staging):
            time.sleep(0.04)
            return job(staging)

        submit(self, layer_idx, slow_job, *args, **kwargs)

    monkeypatch.setattr(TransferSchedule, "submit", slow_submit)
    model = six_layer_llama(seed=8)
    ids, mask = _inputs()
    cores = torch.get_num_threads()
    torch.set_num_threads(1)  # the toy model's compute in microseconds, not an oversubscribed machine's barriers
    try:
        with simulated_streams(max_delay_s=0.0, seed=4):
            cache = DualDecoderCache(model.config, **PARTIAL, retrieval_threads=threads)
            model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=cache)
            cache.close()
    finally:
        torch.set_num_threads(cores)
    stats = cache.stats()
    step = stats["device_step_seconds"]
    assert step > 0
    assert stats["device_wait_seconds"] + stats["device_starved_seconds"] >= 0.5 * step, stats
    assert stats["device_wait_seconds"] <= 0.1 * step, stats
    assert stats["overlap_ratio"] <= 0.5


def test_reading_the_device_clock_never_replaces_the_error_that_ended_a_request():
    """A request that fails mid-step leaves timing events the compute stream never reached; CUDA's `elapsed_time`
    raises on them ("Both events must be completed"). Closing reads only the pairs that completed."""
    from dual_cache.cache.stats import overlap_ratio
    from dual_cache.transfer.schedule import TransferSchedule

    class Event:  # a CUDA timing event's contract: elapsed_time raises unless both ends completed
        def __init__(self, done: bool, at: float):
            self.done, self.at = done, at

        def query(self) -> bool:
            return self.done

        def elapsed_time(self, end) -> float:
            if not (self.done and end.done):
                raise RuntimeError("Both events must be completed before calculating elapsed time.")
            return (end.at - self.at) * 1e3

    schedule = TransferSchedule("cpu", [0, 1], layers_in_flight=2, lookahead=1, threads=0)
    schedule._step_marks = [Event(True, 0.0), Event(True, 1.0), Event(False, 0.0)]
    schedule._stalls = [(0, Event(True, 0.0), Event(True, 0.25)), (1, Event(True, 1.0), Event(False, 0.0))]
    schedule._starved = [(0, Event(True, 0.5), Event(True, 0.75)), (1, Event(False, 0.0), Event(False, 0.0))]
    schedule.close()
    assert (schedule.device_step_seconds, schedule.device_wait_seconds, schedule.device_starved_seconds) == \
        (1.0, 0.25, 0.25)
    assert overlap_ratio(vars(schedule)) == 0.5
