"""What the launch thread does per decode step: its synchronization points and the time it is blocked.

The launch thread is the one that runs the model's forward and so queues the device's work: the thread calling
`generate()`, or the serving scheduler's loop thread. Per decode step, `StepProbe` records

- its **synchronization points**: the host-synchronizing torch calls and host waits it makes
  (`dual_cache.runtime.sync_points. SyncCounter`, by operation), each of which stalls it on a GPU until the device has
  run everything queued;
- its **blocked time**: the seconds it waits for host selection instead of launching work, from the dual cache's own
  clock (`cache.stats()["wait_seconds"]`): a retrieval job it runs in line (`retrieval_threads=0`) or that a worker
  has not finished when its layer needs the entries, a CPU device's host→device copies of the selected entries
  (synchronous there), and synchronous miss repairs (`miss_repair`). A cache without that clock (transformers'
  `DynamicCache`: dense rows) never waits for a selection and reads 0. Its synchronization points are its other
  waits: on a CPU device they return at once (the device is the thread itself, whose work has already run) and add
  nothing; on CUDA each one waits for the device's queue, which the device clock's idle shares measure instead
  (`cache.stats()["device_starved_seconds"]`, the benchmark's `idle_host_fraction`).

Either a step boundary is marked each time a token comes out (`mark`, from a streamer's `put`: a step is the
interval between two tokens) or each step is wrapped (`step`, the serving scheduler's `step_probe` hook).
"""

from __future__ import annotations

import contextlib
import statistics
from collections import Counter
from typing import Iterator

from ...runtime.sync_points import SyncCounter, uncounted

NAN = float("nan")


def wait_seconds(cache) -> float:
    """Seconds the launch thread has waited for host selection on `cache` (`DualDecoderCache.stats()`); 0 for a
    cache that never selects (no `stats`)."""
    if cache is None or not hasattr(cache, "stats"):
        return 0.0
    return float(cache.stats()["wait_seconds"])


class StepProbe:
    """Per-step synchronization points and blocked seconds of one launch thread (see the module docstring).

    Args:
        count: whether `step` counts synchronization points (a TorchFunctionMode that adds Python work to every
            torch call of the thread); False records the blocked seconds only. `counting` counts when it is used.

    Attributes:
        steps: one `(sync points by operation, blocked seconds)` per recorded step, in order.
    """

    def __init__(self, count: bool = True) -> None:
        self.steps: list[tuple[Counter, float]] = []
        self.count = count
        self.counter: SyncCounter | None = None
        self.counted = False  # whether synchronization points were counted (`counting` or `step`)
        self._last: tuple[Counter, float] | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[SyncCounter]:
        """Count on the calling thread for the block (e.g. around `generate()`); `mark` reads this counter."""
        with SyncCounter() as counter:
            self.counter, self.counted = counter, True
            try:
                yield counter
            finally:
                self.counter = None

    def mark(self, cache=None) -> None:
        """A step boundary (a token came out) inside `counting`: the step since the previous mark is recorded.
        `cache`: the request's cache (its wait clock), or None."""
        with uncounted():
            now = (Counter(self.counter.by_op) if self.counter is not None else Counter(), wait_seconds(cache))
        if self._last is not None:
            self.steps.append((now[0] - self._last[0], now[1] - self._last[1]))
        self._last = now

    def restart(self) -> None:
        """Forget the last boundary: the next `mark` starts a new run of steps (e.g. the next `generate()` call,
        on a new cache), so no step spans two calls."""
        self._last = None

    @contextlib.contextmanager
    def step(self, cache=None) -> Iterator[None]:
        """Record the block as one step, its synchronization points counted on the calling thread (the serving
        scheduler's loop thread) when `count`; `cache`: the batch's cache (its wait clock), or None. A block that
        raises records nothing."""
        before = wait_seconds(cache)
        if not self.count:
            yield
            self.steps.append((Counter(), wait_seconds(cache) - before))
            return
        self.counted = True
        with SyncCounter() as counter:
            yield
        self.steps.append((Counter(counter.by_op), wait_seconds(cache) - before))

    def summary(self, skip: int = 0) -> dict:
        """Means over the recorded steps after the first `skip` (warm-up): `sync_points_per_step`,
        `sync_points_by_op` (`{operation: mean per step}`), `blocked_ms_per_step`; NaN / empty without steps (the
        synchronization points also when they were not counted)."""
        steps = self.steps[skip:]
        if not steps:
            return {"sync_points_per_step": NAN, "sync_points_by_op": {}, "blocked_ms_per_step": NAN}
        blocked = 1000 * statistics.fmean(seconds for _, seconds in steps)
        if not self.counted:
            return {"sync_points_per_step": NAN, "sync_points_by_op": {}, "blocked_ms_per_step": blocked}
        ops = Counter()
        for counts, _ in steps:
            ops.update(counts)
        return {
            "sync_points_per_step": sum(ops.values()) / len(steps),
            "sync_points_by_op": {op: n / len(steps) for op, n in sorted(ops.items()) if n},
            "blocked_ms_per_step": blocked,
        }
