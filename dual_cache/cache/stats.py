"""A cache's accounting: the transfer schedule's counters summed over requests, the bytes its layers hold on the
device and the host, the pipeline's overlap, and the per-(step, layer) timeline records (`DualDecoderCache.stats`,
`timeline`, `dump_timeline`).
"""

from __future__ import annotations

import json
import math
from typing import Any, Sequence

from ..layer.layer import DualLayer

SCHEDULE_COUNTERS = ("steps", "bytes_copied", "retrieval_seconds", "retrieval_cpu_seconds", "copy_seconds",
                     "wait_seconds", "repairs", "repaired_steps", "repair_seconds", "drift_repairs", "entries_wanted",
                     "entries_resident", "device_wait_seconds", "device_starved_seconds", "device_step_seconds")


def add_counters(totals: dict[str, float], schedule: Any) -> dict[str, float]:
    """Add a `TransferSchedule`'s counters (`SCHEDULE_COUNTERS`) to `totals`, in place; returns `totals`."""
    for name in SCHEDULE_COUNTERS:
        totals[name] += getattr(schedule, name)
    return totals


def overlap_ratio(counters: dict) -> float:
    """The pipeline's overlap from schedule counters (`TransferSchedule` attributes, or their sums over requests):
    with a device clock `1 − (device_wait_seconds + device_starved_seconds) / device_step_seconds`, else
    `1 − wait_seconds / (retrieval_seconds + copy_seconds)`; clamped at 0, nan before any decode step."""
    if counters["device_step_seconds"] > 0:
        idle = counters["device_wait_seconds"] + counters["device_starved_seconds"]
        return max(0.0, 1.0 - idle / counters["device_step_seconds"])
    busy = counters["retrieval_seconds"] + counters["copy_seconds"]
    return float("nan") if busy == 0 else max(0.0, 1.0 - counters["wait_seconds"] / busy)


def layer_device_bytes(layer: DualLayer) -> int:
    """Bytes of a full-attention layer's device tiers: sink, window ring, resident set, what the selector keeps there
    (the Quest baseline's page metadata); delta buffers are pooled and counted by the schedule."""
    tensors = (layer.sink_keys, layer.sink_values, layer.ring_keys, layer.ring_values)
    selector = 0 if layer.selector is None else layer.selector.device_bytes
    resident = 0 if layer.resident is None else layer.resident.nbytes
    return sum(t.nbytes for t in tensors if t is not None) + selector + resident


def layer_host_bytes(layer: DualLayer) -> int:
    """Host bytes of a full-attention layer's store and of its selector's host state (an index, a key copy)."""
    if layer.host is None:
        return 0
    return layer.host.nbytes + (0 if layer.selector is None else layer.selector.host_bytes)


def layer_dense_bytes(layer: DualLayer) -> int:
    """Bytes a `DynamicCache` layer would hold for the same tokens as a full-attention layer."""
    if layer.host is None:
        return 0
    batch, kv_heads = layer.host.shape_prefix
    return 2 * batch * kv_heads * layer.host.length * layer.host.head_dim * layer.host.element_size


def host_and_dense_bytes(layers: Sequence[Any]) -> tuple[int, int]:
    """`(host bytes, dense-equivalent bytes)` of a cache's `layers`: the full-attention layers' stores and selector
    host state; the bytes a `DynamicCache` would hold on the device for the same tokens (sliding windows included)."""
    host = dense = 0
    for layer in layers:
        if isinstance(layer, DualLayer):
            host += layer_host_bytes(layer)
            dense += layer_dense_bytes(layer)
        elif layer.is_initialized and layer.keys is not None:
            dense += layer.keys.nbytes + layer.values.nbytes
    return host, dense


def device_bytes(layers: Sequence[Any], schedule: Any | None) -> int:
    """Device bytes held now: the running request's selection pool (`schedule`, None between requests), the full
    layers' tiers (and Quest metadata) and the sliding layers' windows."""
    device = 0 if schedule is None else schedule.device_bytes
    for layer in layers:
        if isinstance(layer, DualLayer):
            device += layer_device_bytes(layer)
        elif layer.is_initialized and layer.keys is not None:
            device += layer.keys.nbytes + layer.values.nbytes
    return device


def selection_counts(layers: Sequence[Any]) -> dict[str, float]:
    """`selections_scanned`, `selections_pooled` and `scan_share` over the full-attention layers' selectors (those
    that carry pools between scans count them; see `CacheAccounting.stats`)."""
    scanned = pooled = 0
    for layer in layers:
        selector = getattr(layer, "selector", None) if isinstance(layer, DualLayer) else None
        scanned += getattr(selector, "tasks_scanned", 0)
        pooled += getattr(selector, "tasks_pooled", 0)
    total = scanned + pooled
    return {"selections_scanned": scanned, "selections_pooled": pooled,
            "scan_share": scanned / total if total else float("nan")}


def dump_timeline(path: str, stats: dict, timeline: list[dict]) -> None:
    """Write `{"stats": stats, "timeline": timeline}` as JSON to `path`."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"stats": stats, "timeline": timeline}, handle, indent=1)


class CacheAccounting:
    """What a cache counts over its requests, and its stats once closed.

    Attributes:
        spec_hits, spec_steps: speculated tokens that equalled the real one / speculated tokens.
        row_counts: the running request's `[hits, steps]` per sequence (row); rows_done: those of the ended requests.
        finished: schedule counters (`SCHEDULE_COUNTERS`) of the requests that ended; records: their timelines.
        decoding_device_bytes: device bytes the last ended request held while decoding.
        final: the stats `close()` froze; None while the cache is open.
    """

    def __init__(self) -> None:
        self.spec_hits = 0
        self.spec_steps = 0
        self.row_counts: list[list[int]] = []
        self.rows_done: list[list[int]] = []
        self.finished = dict.fromkeys(SCHEDULE_COUNTERS, 0)
        self.records: list[dict] = []
        self.decoding_device_bytes = 0
        self.final: dict | None = None

    def record_speculation(self, outcomes: Sequence[bool | None]) -> None:
        """One decode step's speculation outcomes, per sequence: hit (True), miss (False), or None where the sequence
        was not speculated for (finished)."""
        while len(self.row_counts) < len(outcomes):
            self.row_counts.append([0, 0])
        for counts, outcome in zip(self.row_counts, outcomes):
            if outcome is not None:
                counts[0] += bool(outcome)
                counts[1] += 1
                self.spec_hits += bool(outcome)
                self.spec_steps += 1

    def end_rows(self) -> None:
        """The request ended: its rows' counts join those of the ended requests."""
        self.rows_done.extend(self.row_counts)
        self.row_counts = []

    def row_rates(self) -> dict[str, float]:
        """`spec_rows` (sequences of every request so far with a speculated step), `spec_row_hit_rate_mean` and
        `spec_row_hit_rate_min` (their hit rates' mean and the worst; nan without any)."""
        rates = [hits / steps for hits, steps in self.rows_done + self.row_counts if steps]
        return {"spec_rows": len(rates), "spec_row_hit_rate_mean": sum(rates) / len(rates) if rates else math.nan,
                "spec_row_hit_rate_min": min(rates) if rates else math.nan}

    def end_schedule(self, schedule: Any) -> None:
        """A request's `TransferSchedule` closed: add its counters and timeline records."""
        add_counters(self.finished, schedule)
        self.records.extend(schedule.timeline())

    def stats(self, layers: Sequence[Any], schedule: Any | None, seq_length: int, requests: int,
              shard: Any) -> dict[str, float]:
        """The cache's stats (`DualDecoderCache.stats`): the frozen ones once closed, else computed from its `layers`,
        the running request's `schedule` (None between requests), the tokens stored (`seq_length`), the requests
        begun (`requests`) and the KV heads it holds (`shard`, a `tensor_parallel.TensorShard`).

        Returns a dict with:
            device_bytes: bytes resident on the compute device (while a request decodes: sink + window tiers and
                resident sets of full layers, Quest page metadata, the delta buffers; the windows of sliding layers);
            host_bytes: bytes of the host stores and the selectors' host state;
            dense_equivalent_bytes: bytes a `DynamicCache` would hold on the device for the same tokens;
            bytes_copied: host→device bytes of the deltas so far (K, V, slots, positions);
            entries_wanted, entries_resident, resident_share: entries the steps wanted resident (per sequence, KV
                head and layer), how many of them already were, and their ratio (nan before any);
            retrieval_cpu_seconds: host CPU time of the retrieval jobs (selection, plan, gather; every thread of
                the native engine counted);
            spec_hits, spec_steps: speculated tokens that equalled the real one / speculated tokens;
            spec_rows, spec_row_hit_rate_mean, spec_row_hit_rate_min: sequences (per request: a batch of B counts B)
                with a speculated step, and the mean and the worst of their own hit rates (nan without any);
            seq_length: tokens stored; steps: decode forward passes; requests: requests begun;
            retrieval_seconds, copy_seconds: host time spent selecting + gathering, and issuing copies;
            wait_seconds: time the launching thread waited for selections (all of it on the synchronous path);
            device_wait_seconds, device_starved_seconds, device_step_seconds: on CUDA (device clock: timing
                events; under `simulated_streams()` the simulated one; 0 on a CPU device), over the finished
                requests: the compute stream's time waiting for selection copies (an event wait); its time with no
                work queued because the launch thread was waiting on host selection (a retrieval job not finished
                when its layer acquires, a synchronous or miss-repair job); and its time from one step's first
                layer to the next's. The device's idle time for selections is the first two together;
            overlap_ratio: on CUDA `1 − (device_wait + device_starved) / device_step` (the share of the device's
                step time it was not idle for selections); elsewhere `1 − wait / (retrieval + copy)` (nan before
                the first decode step);
            repairs, repaired_steps, repair_seconds: (step, layer) selections redone by miss repair (misses and
                drift), the decode steps in which any was, and the time they took;
            drift_repairs: those of the `repairs` made for drifted queries on hit steps (`repair_drift`);
            selections_scanned, selections_pooled, scan_share: with `selector="carried"`, its (sequence, KV head,
                layer) selections through the carried schedule that scanned every key's code and those that
                rescored a carried pool, and the scanned share (nan without any; 0, 0 with the other selectors,
                with `rescan_interval=1`, and where a selection takes every candidate);
            tp_rank, tp_size, kv_heads: under tensor parallelism every figure above is this rank's alone (its
                `kv_heads` of the model's KV heads); tp_size 1 without it.
        """
        if self.final is not None:
            return dict(self.final)
        host, dense = host_and_dense_bytes(layers)
        counters = dict(self.finished) if schedule is None else add_counters(dict(self.finished), schedule)
        device = device_bytes(layers, schedule) if schedule is not None else self.decoding_device_bytes
        return {
            "device_bytes": device,
            "host_bytes": host,
            "dense_equivalent_bytes": dense,
            "spec_hits": self.spec_hits,
            "spec_steps": self.spec_steps,
            **self.row_rates(),
            "seq_length": seq_length,
            "requests": requests,
            **counters,
            "overlap_ratio": overlap_ratio(counters),
            "resident_share": counters["entries_resident"] / counters["entries_wanted"] if counters["entries_wanted"]
            else float("nan"),
            **selection_counts(layers),
            "tp_rank": shard.rank,
            "tp_size": shard.size,
            "kv_heads": shard.kv_heads,
        }

    def timeline(self, schedule: Any | None) -> list[dict]:
        """Per-(step, layer) pipeline records of every ended request, then of the running one (`schedule`; see
        `TransferSchedule.timeline`)."""
        running = [] if schedule is None else schedule.timeline()
        return [dict(record) for record in self.records] + running
