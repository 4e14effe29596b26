"""Repeated timings of the benchmarks: the run order that interleaves the methods, the median and range of each
cell, and a warning when other work loads the host.

A benchmark runs every cell `--repeats` times, round by round: each round runs every cell once, and within a group of
cells compared with each other (the methods at one context and batch) the order rotates by one each round, so a
change in the host's load reaches every method alike and no method always runs first. A cell reports the median of
its runs and their min–max; one run is a number without a spread, which a ratio between two cells cannot be trusted
from (the same command twice on a loaded host gave dual ×dense 6.74 and 0.64).
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Callable, Hashable, Sequence, TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], round_: int, group: Callable[[T], Hashable]) -> list[T]:
    """`items` in round `round_`'s order: each run of consecutive items with the same `group(item)` rotated left by
    `round_` (round 0: the order given).

    Args:
        items: the cells, in the order of round 0. round_: the round, >= 0. group: the key of the cells compared
            with each other (e.g. `(context, batch)`).
    """
    out: list[T] = []
    start = 0
    while start < len(items):
        end = start
        while end < len(items) and group(items[end]) == group(items[start]):
            end += 1
        block = list(items[start:end])
        shift = round_ % len(block)
        out += block[shift:] + block[:shift]
        start = end
    return out


def summary(values: Sequence[float]) -> dict[str, float]:
    """`{"median", "min", "max", "runs"}` of the finite `values` (NaN for each when none is finite).

    Args:
        values: one number per run (seconds, tokens/s, ...); NaN and None (a run that measured nothing) are left out.
    """
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "runs": 0}
    return {"median": statistics.median(finite), "min": min(finite), "max": max(finite), "runs": len(finite)}


def merge_runs(runs: list[dict], timed: Sequence[str]) -> dict:
    """One row for a cell run several times: the first run's row with each `timed` field replaced by the median of
    the runs, plus `<field>_min`, `<field>_max` and `repeats` (runs without an error). A run that failed makes the
    cell's row that run's (its `error` set).

    Args:
        runs: the rows of one cell, one per run (dicts with an `error` key, None when the run succeeded).
        timed: the fields that vary between runs (timings); every other field is taken from the first run.
    """
    failed = [row for row in runs if row.get("error") is not None]
    if failed:
        return dict(failed[0])
    row = dict(runs[0])
    for field in timed:
        if field in row:
            stats = summary([run.get(field) for run in runs])
            row[field], row[f"{field}_min"], row[f"{field}_max"] = stats["median"], stats["min"], stats["max"]
    row["repeats"] = len(runs)
    return row


def with_range(row: dict, field: str, fmt: str = "{:.2f}") -> str:
    """A table cell: the median, then `(min–max)` when the row has several runs that differ; "—" when missing."""
    value = row.get(field)
    if value is None or not math.isfinite(value):
        return "—"
    low, high = row.get(f"{field}_min"), row.get(f"{field}_max")
    text = fmt.format(value)
    if row.get("repeats", 1) > 1 and low is not None and high is not None and math.isfinite(low) and low != high:
        text += f" ({fmt.format(low)}–{fmt.format(high)})"
    return text


def load_average() -> float:
    """The host's 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return math.nan


def load_warning(load: float | None = None, cores: int | None = None) -> str | None:
    """A warning line when the 1-minute load average (`load`, default now) exceeds the host's cores, else None:
    other work then shares the cores and the timings are slower and spread wider than on an idle host."""
    load = load_average() if load is None else load
    cores = cores or os.cpu_count() or 1
    if not math.isfinite(load) or load <= cores:
        return None
    return (f"warning: the 1-minute load average reached {load:.1f} on {cores} cores: other work shared the host, so "
            "the timings are slower and spread wider than on an idle host (compare medians of interleaved runs only)")
