"""Where one native engine call's time goes: per (sequence, KV head) task, the CPU time of each phase.

`recording()` asks every native `select` call made on this thread inside it to time its phases (a few clock reads
per task; without a recording the engine reads no clock). Used by `dual_cache.eval.selection.profile_selection`.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

# the engine's phases, in its order (`Phase` in selection_engine.cpp)
PHASES = ("scan_setup", "scan_sample", "scan_main", "shortlist", "exact_reads", "exact_topk", "gather")

_local = threading.local()


@dataclass
class CallProfile:
    """One engine call: per (sequence, KV head) task and phase, the CPU nanoseconds of the thread that ran it (time
    spent waiting for memory counts, time the thread was descheduled does not, so other load on the host inflates it
    less than wall time); the call's wall time inside the engine (threads started and joined included); the threads
    it ran on."""

    raw: ctypes.Array  # what the engine filled: tasks × len(PHASES) phase times, the wall time, the workers
    tasks: int

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


def record(filled: ctypes.Array | None, tasks: int) -> None:
    """File a buffer the engine filled (no-op for None)."""
    if filled is not None:
        _local.calls.append(CallProfile(filled, tasks))
