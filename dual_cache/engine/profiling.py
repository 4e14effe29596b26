"""Where one native engine call's time goes: per (sequence, KV head) task, the CPU time of each phase.

`recording()` asks every native `select` call made on this thread inside it to time its phases (a few clock reads
per task; without a recording the engine reads no clock). Used by `dual_cache.eval.selection.profile_selection`, and
by `cpu_seconds` (the host core-seconds of a retrieval job: `TransferSchedule`, `bench_retrieval`).
"""

from __future__ import annotations

import ctypes
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

# the engine's phases, in its order (`Phase` in selection_engine.cpp)
PHASES = ("scan_setup", "scan_sample", "scan_main", "shortlist", "exact_reads", "exact_topk", "gather")

_local = threading.local()


@dataclass
class CallProfile:
    """One engine call: per (sequence, KV head) task and phase, the CPU nanoseconds of the thread that ran it (time
    spent waiting for memory counts, time the thread was descheduled does not, so other load on the host inflates it
    less than wall time); the call's wall time inside the engine (threads started and joined included); the threads
    it ran on; the calling thread's own CPU time during the call."""

    raw: ctypes.Array  # what the engine filled: tasks × len(PHASES) phase times, the wall time, the workers
    tasks: int
    caller_ns: int = 0  # CPU time of the calling thread during the call (it may run tasks itself: in `phase_ns` too)

    @property
    def phase_ns(self) -> torch.Tensor:
        """`(tasks, len(PHASES))` int64 nanoseconds."""
        return torch.tensor(self.raw[: self.tasks * len(PHASES)], dtype=torch.int64).view(self.tasks, len(PHASES))

    @property
    def wall_ns(self) -> int:
        return int(self.raw[self.tasks * len(PHASES)])

    @property
    def workers(self) -> int:
        return int(self.raw[self.tasks * len(PHASES) + 1])


@contextmanager
def recording() -> Iterator[list[CallProfile]]:
    """Collect a `CallProfile` per native `select` call made on this thread while the block runs."""
    calls: list[CallProfile] = []
    previous = getattr(_local, "calls", None)
    _local.calls = calls
    try:
        yield calls
    finally:
        _local.calls = previous


def buffer(tasks: int) -> ctypes.Array | None:
    """The int64 buffer a call of `tasks` tasks fills (`tasks · len(PHASES)` phase times, the wall time, the
    workers; a ctypes array, so that profiling adds next to nothing to the call), or None outside `recording()`."""
    if getattr(_local, "calls", None) is None:
        return None
    return (ctypes.c_int64 * (tasks * len(PHASES) + 2))()


def record(filled: ctypes.Array | None, tasks: int, caller_ns: int = 0) -> None:
    """File a buffer the engine filled, with the calling thread's CPU nanoseconds during the call (no-op for None)."""
    if filled is not None:
        _local.calls.append(CallProfile(filled, tasks, caller_ns))


def cpu_seconds(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Run `call(*args)` on this thread; returns its result and the host CPU seconds it took: this thread's own CPU
    time outside the native engine plus every engine call's per-task CPU time (its worker threads included, which
    a thread clock alone would miss). Torch's own intra-op threads are not counted (the engine uses its own)."""
    start = time.thread_time_ns()
    with recording() as calls:
        result = call(*args)
    own = time.thread_time_ns() - start - sum(profile.caller_ns for profile in calls)
    engine = sum(sum(profile.raw[: profile.tasks * len(PHASES)]) for profile in calls)
    return result, (max(own, 0) + engine) / 1e9
