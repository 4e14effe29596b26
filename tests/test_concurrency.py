"""State shared between the decode loop's thread and the retrieval worker threads: the host-memory allowance
(`HostMemory.claim` runs inside retrieval jobs when an index grows) and the 2-bit index (`LowBitSelector.extend`
in a job, `truncate` from the decode loop's `crop(-1)`)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from dual_cache import DualDecoderConfig
from dual_cache.engine.codes import GROUP
from dual_cache.host.memory import HostMemory, HostMemoryError
from dual_cache.selection.selectors import SELECTORS
from tests.test_engine import _store


@pytest.fixture
def switch_often():
    """Make the interpreter switch threads every microsecond, so unlocked read-modify-writes interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_concurrent_claims_add_up_and_never_pass_the_limit(switch_often):
    threads, claims, size = 8, 2000, 3
    memory = HostMemory(limit=threads * claims * size)  # exactly enough for every claim
    start = threading.Barrier(threads)

    def claim_all():
        start.wait()
        for _ in range(claims):
            memory.claim(size)

    workers = [threading.Thread(target=claim_all) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert memory.claimed == threads * claims * size  # no update lost
    with pytest.raises(HostMemoryError):
        memory.claim(1)  # the limit holds exactly

    # racing past the limit (an unlocked check-then-add passed it in about 1 trial of 25): the claims that succeed
    # never sum above it
    for _ in range(50):
        tight = HostMemory(limit=1000)
        granted = []
        lock = threading.Lock()

        def race():
            start.wait()
            for _ in range(200):
                try:
                    tight.claim(7)
                except HostMemoryError:
                    continue
                with lock:
                    granted.append(7)

        workers = [threading.Thread(target=race) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert sum(granted) == tight.claimed <= 1000 and tight.claimed > 1000 - 7
    tight.release(70)
    assert tight.claimed == sum(granted) - 70


def test_decode_crops_never_touch_the_index_while_a_job_extends_it(switch_often):
    """The decode pattern: a job extends the index up to `committed - window` on a worker thread while the loop
    crops the speculated token (`truncate(committed)`); every extension survives."""
    store = _store(6, tokens=400)
    selector = SELECTORS["lowbit"](DualDecoderConfig(selector="lowbit"), store, "cpu")
    first_real = torch.tensor([0, 5])
    window = 1  # the smallest window the config allows: the tightest case
    ends = range(2 * GROUP, 400 - window)
    submitted = threading.Semaphore(0)

    def jobs():
        for end in ends:
            submitted.acquire()  # the step that submits this job (selectable end `end`) has begun
            selector.extend(end, first_real)  # runs while the loop crops that step's speculated token

    worker = threading.Thread(target=jobs)
    worker.start()
    for end in ends:
        submitted.release()
        selector.truncate(end + window)  # crop(-1): back to the committed tokens, which the index never reaches
    worker.join()
    assert selector.n_groups == [(ends[-1] - first) // GROUP for first in (0, 5)]


def test_a_deep_truncate_waits_for_a_running_extend(monkeypatch):
    """A crop that forgets groups takes the index lock: it never interleaves with an extension in flight."""
    store = _store(7, tokens=400)
    selector = SELECTORS["lowbit"](DualDecoderConfig(selector="lowbit"), store, "cpu")
    first_real = torch.tensor([0, 0])
    selector.extend(3 * GROUP, first_real)
    inside, release = threading.Event(), threading.Event()
    quantize = selector._extend

    def slow_extend(*args):
        inside.set()
        release.wait(5)
        quantize(*args)

    monkeypatch.setattr(selector, "_extend", slow_extend)
    worker = threading.Thread(target=selector.extend, args=(6 * GROUP, first_real))
    worker.start()
    assert inside.wait(5)
    truncated = threading.Thread(target=selector.truncate, args=(GROUP,))
    truncated.start()
    truncated.join(0.2)
    assert truncated.is_alive()  # waiting for the extension
    release.set()
    worker.join()
    truncated.join()
    assert selector.n_groups == [1, 1]  # the truncate came after the extension, and won
