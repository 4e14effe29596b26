"""Where one native engine call's time goes: per (sequence, KV head) task, the CPU time of each phase.

`recording()` asks every native `select` call made on this thread inside it to time its phases (a few clock reads
per task; without a recording the engine reads no clock). Used by `dual_cache.eval.selection.profile_selection`.
"""

from __future__ import annotations

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
    """One engine call: `phase_ns` `(tasks, len(PHASES))` int64 CPU nanoseconds of the thread that ran each
    (sequence, KV head) task, per phase (time spent waiting for memory counts, time the thread was descheduled does
    not, so other load on the host inflates it less than wall time), `wall_ns` the call's wall time inside the engine
    (threads started and joined included), `workers` the threads it ran on."""

    phase_ns: torch.Tensor
    wall_ns: int
    workers: int


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


def buffer(tasks: int) -> torch.Tensor | None:
    """The int64 buffer a call of `tasks` tasks fills (`tasks · len(PHASES)` phase times, the wall time, the
    workers), or None outside `recording()`."""
    if getattr(_local, "calls", None) is None:
        return None
    return torch.zeros(tasks * len(PHASES) + 2, dtype=torch.int64)


def record(filled: torch.Tensor | None, tasks: int) -> None:
    """File a buffer the engine filled (no-op for None)."""
    if filled is not None:
        _local.calls.append(CallProfile(filled[: tasks * len(PHASES)].view(tasks, len(PHASES)).clone(),
                                        int(filled[-2]), int(filled[-1])))
