"""Transfer schedule (docs/design.md §2, steps 1 and 3): retrieval jobs on a pool of host threads, their deltas copied
into layer-scoped device buffers `lookahead` layers before the layer needs them, every transfer ordered by streams
and events (`runtime/streams.py`), never by a host wait on the launching thread.

Per decode step every full-attention layer `l` with a budget takes one delta: the entries its step wants resident
that its resident set (`resident_set.py`) does not hold yet. Its retrieval job (the selector's choice, the resident
set's plan, the gather of the delta's K/V into the layer's host staging) is submitted during the previous step,
right after the layer's attention, with the speculated token's query on its way to the host (`query_to_host`:
pinned staging, copy stream, an event the job waits on), together with what that step hands the next (its
`chooser`: the query that chose, what the real token attended); it runs on one of `threads` host threads, so
several layers' jobs are in flight at once (each touches only its own layer's store, index, resident mirror and
staging, so the result does not depend on which thread runs it or when). Its host→device copy — the delta's rows
only, a contiguous prefix of each staging tensor — is enqueued on the copy stream when layer `l - lookahead`
(cyclically, across steps) acquires its own, into the next buffer of the ring of its capacity (`layers_in_flight`
buffers, fixed in address for the request), after the event that marks the buffer's previous use as done; the
compute stream waits for the copy's event when layer `l` acquires. The launching thread waits only for a retrieval
job to finish (a host thread, not the device). On a CPU device the "device" is host memory and `HostStreams` makes
every copy immediate; `SimulatedStreams` runs the same code with asynchronous copies (tests).

Counted per request: bytes copied, the entries wanted and how many of them were resident already, and the host CPU
time of the jobs (`retrieval_cpu_seconds`: the job thread's own time plus the native engine's worker threads',
`engine.profiling`), the core-seconds the host spends per step.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from ..engine import profiling
from ..runtime.streams import elapsed_ms, make_streams
from .delta import Delta


_Record = dict  # timeline entry of one (step, layer): seconds since the schedule started, bytes, slot


class TransferSchedule:
    """Retrieval on host threads, delta copies `lookahead` layers ahead into per-capacity rings of `layers_in_flight`
    device buffers, ordered by streams and events.

    Args:
        device: where attention runs.
        layer_order: the layers that retrieve, in the order the model runs them.
        layers_in_flight: device delta buffers per ring (one ring per distinct staging capacity among the layers).
        lookahead: layers between issuing a selection's copy and the layer that uses it; `< layers_in_flight`.
        threads: 0 runs each job synchronously at `submit` (the reference path); N ≥ 1 runs jobs on a pool of N
            host threads. With N ≥ 2 each pool thread runs its torch ops single-threaded (parallelism comes from
            the jobs; torch's intra-op thread count is per thread), with N = 1 at torch's intra-op thread count.
        record_timeline: keep a per-(step, layer) record of every phase (`timeline()`).

    Raises:
        ValueError: if `lookahead >= layers_in_flight` (a slot would be overwritten before it is used).
        KeyError: from `acquire` when no job was submitted for that layer.
    """

    def __init__(
        self,
        device: torch.device,
        layer_order: Sequence[int],
        layers_in_flight: int,
        lookahead: int,
        threads: int,
        record_timeline: bool = False,
    ) -> None:
        if not 0 <= lookahead < layers_in_flight:
            raise ValueError(
                f"`lookahead` ({lookahead}) must be smaller than `layers_in_flight` ({layers_in_flight}): copies "
                "issued ahead need their own device slots. Raise layers_in_flight or lower lookahead."
            )
        self.device = torch.device(device)
        self.order = list(layer_order)
        self._next_in_order = {layer: self.order[(i + 1) % len(self.order)] for i, layer in enumerate(self.order)}
        self.layers_in_flight = layers_in_flight
        self.lookahead = lookahead
        self.record_timeline = record_timeline
        self._pin = self.device.type == "cuda"
        self.streams = make_streams(self.device)
        self._executor = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dual-retriever",
                               initializer=torch.set_num_threads if threads > 1 else None,
                               initargs=(1,) if threads > 1 else ())
            if threads > 0 else None
        )
        # layer -> (future or None, record, chooser): a submitted job not yet copied
        self._pending: dict[int, tuple[Future | None, _Record, Any]] = {}
        self._issued: dict[int, tuple[Delta, _Record, object, Any]] = {}  # layer -> (device delta, record, ready, chooser)
        self._staging: dict[int, Delta] = {}
        self._staging_free: dict[int, object] = {}  # layer -> event: the copy out of its staging buffer is done
        self._queries: dict[tuple[int, str], torch.Tensor] = {}  # (layer, use) -> pinned host query buffer
        self._rings: dict[int, list[Delta]] = {}  # capacity -> its device buffers
        self._ring_next: dict[int, int] = {}
        self._slot_free: dict[tuple[int, int], object] = {}  # (capacity, buffer) -> event: its last use is done
        self._in_use: dict[int, tuple[tuple[int, int], _Record]] = {}  # layer -> (buffer key, record)
        self._repair_staging: Delta | None = None  # host staging of synchronous repairs (one at a time)
        self._repair_device: Delta | None = None
        self._repair_free = None
        self._last_repaired_step: int | None = None
        self._t0 = time.perf_counter()
        self._timeline: list[_Record] = []
        self.steps = 0
        self.bytes_copied = 0
        self.retrieval_seconds = 0.0
        self.copy_seconds = 0.0
        self.wait_seconds = 0.0
        self.repairs = 0
        self.repaired_steps = 0
        self.repair_seconds = 0.0
        self.drift_repairs = 0  # layers repaired for a drifted query
        self.entries_wanted = 0  # entries the steps wanted resident (distinct per sequence and KV head)
        self.entries_resident = 0  # of them, already resident (not copied)
        self.retrieval_cpu_seconds = 0.0  # host CPU time of every retrieval and repair job
        # device clock (CUDA events; the simulated clock of `SimulatedStreams`; nothing on a CPU device): per step,
        # a timing event where its first layer enters `acquire`; per layer, (step, entry, before) around the launch
        # thread's host waits (nothing is queued on the compute stream between the two, so their gap is the device
        # idling) and (step, before, after) around the compute stream's wait for the copy; the same around
        # synchronous host jobs. `step` indexes `_step_marks`: only steps the next step's mark closes are read
        self._step_marks: list = []
        self._stalls: list = []
        self._starved: list = []
        self.device_wait_seconds = 0.0  # the compute stream's time spent waiting for selection copies
        self.device_starved_seconds = 0.0  # its time without work while the launch thread waited on host selection
        self.device_step_seconds = 0.0  # the compute stream's time from one step's first layer to the next's
        self.closed = False

    def query_to_host(self, layer_idx: int, query: torch.Tensor, use: str = "prefetch"):
        """Start copying `query` `(B, H_q, D)` (any float dtype, on the device) to a float32 host buffer of the
        layer's (page-locked on CUDA; one per layer and `use`, reused every step), on the copy stream after the
        compute stream's work so far; an integer tensor (positions) keeps its dtype. Returns `(buffer, ready)`: read the buffer after `ready.synchronize()`.
        The launching thread does not wait."""
        dtype = torch.float32 if query.is_floating_point() else query.dtype  # positions stay int64
        if not self.streams.asynchronous:  # a CPU device: the query is in host memory already
            return query.detach().to(dtype), self.streams.record("copy")
        key = (layer_idx, use)
        buffer = self._queries.get(key)
        if buffer is None or buffer.shape != query.shape or buffer.dtype != dtype:
            buffer = torch.empty(query.shape, dtype=dtype, pin_memory=self._pin)
            self._queries[key] = buffer
        source = query.detach()
        if source.dtype != dtype:
            source = source.to(dtype)
        self.streams.wait(self.streams.record("compute"), "copy")
        self.streams.copy(buffer, source)
        return buffer, self.streams.record("copy")

    # --- host side -----------------------------------------------------------------------------------
    def submit(self, layer_idx: int, job: Callable[[Delta], Any], capacity: int, dim: int, dtype: torch.dtype,
               chooser: Any = None) -> None:
        """Schedule `job` for the next use of `layer_idx`.

        Args:
            job: fills the given host staging `Delta` (its leading rows, setting `count`) and returns the plan it
                made (`resident_set.Plan`: its `wanted` and `resident` counts are added up), or None.
            capacity: rows of that staging (the most a step can copy); dim: head dim; dtype: K/V dtype.
            chooser: what the step that submits hands the step that acquires (`acquire` returns it; `pending` reads
                it while unacquired).
        """
        staging = self._staging.get(layer_idx)
        if staging is None or staging.capacity != capacity or staging.keys.shape[1] != dim or staging.keys.dtype != dtype:
            staging = Delta.empty(capacity, dim, dtype, "cpu", pin=self._pin)
            self._staging[layer_idx] = staging
        record = _Record(layer=layer_idx)
        free = self._staging_free.get(layer_idx)

        def run() -> None:
            if free is not None:
                free.synchronize()  # the previous copy out of this staging buffer has finished
            start = time.perf_counter()
            with torch.inference_mode():  # buffers are inference tensors (allocated under generate's mode)
                plan, cpu = profiling.cpu_seconds(job, staging)
            end = time.perf_counter()
            record.update(retrieval_start=start - self._t0, retrieval_end=end - self._t0, retrieval_cpu=cpu,
                          wanted=getattr(plan, "wanted", 0), resident=getattr(plan, "resident", 0))

        if self._executor is None:
            idle_from = self.streams.timed("compute")
            run()
            self._starved_since(idle_from)
            self.wait_seconds += record["retrieval_end"] - record["retrieval_start"]  # the compute side ran it
            self._pending[layer_idx] = (None, record, chooser)
        else:
            self._pending[layer_idx] = (self._executor.submit(run), record, chooser)

    def pending(self, layer_idx: int) -> Any:
        """The chooser submitted with `layer_idx`'s job that no step has acquired yet, or None."""
        entry = self._pending.get(layer_idx)
        if entry is None:
            entry = self._issued.get(layer_idx)
            return None if entry is None else entry[3]
        return entry[2]

    # --- compute side --------------------------------------------------------------------------------
    def acquire(self, layer_idx: int) -> tuple[Delta, Any]:
        """The device delta of `layer_idx` for the running step (its `count` leading rows, ready on the compute
        stream) and the chooser its job was submitted with; issues the copies `lookahead` layers ahead.

        Raises:
            KeyError: when no job was submitted for `layer_idx`.
        """
        if layer_idx == self.order[0]:
            self.steps += 1
        entry = self.streams.timed("compute")  # before any host wait below: the device may run dry from here
        if layer_idx not in self._issued:
            self._issue_copy(layer_idx)
        ahead = layer_idx
        for _ in range(self.lookahead):
            ahead = self._next_in_order[ahead]
            if ahead in self._pending and ahead not in self._issued:
                self._issue_copy(ahead)
        delta, record, ready, chooser = self._issued.pop(layer_idx)
        before = self.streams.timed("compute")
        self.streams.wait(ready, "compute")  # the device waits for the copy, not the host
        if before is not None:
            if layer_idx == self.order[0]:
                self._step_marks.append(entry)
            step = len(self._step_marks) - 1
            self._starved.append((step, entry, before))
            self._stalls.append((step, before, self.streams.timed("compute")))
        record.update(step=self.steps, attention_start=time.perf_counter() - self._t0)
        self._in_use[layer_idx] = (record["slot_key"], record)
        return delta, chooser

    def repair(self, layer_idx: int, job: Callable[[Delta], Any], rows: list[int], capacity: int, dim: int,
               dtype: torch.dtype, drifted: bool = False) -> Delta:
        """Run a repair's `job` now, on the calling thread, and return its delta on the device (copied on the compute
        stream, after the layer's prefetched delta and before its attention).

        Miss repair: the rows whose prefetched entries were chosen with a mis-speculated token's query get the entries
        of the real token's query instead. Synchronous by nature (that query exists only now): the compute side
        waits for the job and the copy, both counted in `wait_seconds`, `repair_seconds` and `bytes_copied`.

        Args:
            job: fills a host staging `Delta` of `capacity` rows (as `submit`'s job) for `rows`.
            rows: the sequences repaired (indices into the batch, ascending).
            capacity, dim, dtype: of the staging. drifted: a repair for a drifted query (`drift_repairs`).

        Raises:
            KeyError: if `layer_idx` has no acquired (unreleased) delta.
        """
        _, record = self._in_use[layer_idx]
        idle_from = self.streams.timed("compute")
        if self._repair_free is not None:
            self._repair_free.synchronize()  # the previous repair's copy out of the staging buffers has finished
        staging = self._repair_staging
        if staging is None or staging.capacity < capacity or staging.keys.shape[1] != dim or staging.keys.dtype != dtype:
            staging = self._repair_staging = Delta.empty(capacity, dim, dtype, "cpu", pin=self._pin)
            self._repair_device = Delta.empty(capacity, dim, dtype, self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            plan, cpu = profiling.cpu_seconds(job, staging)
        self._starved_since(idle_from)
        copy_start = time.perf_counter()
        device = self._repair_device
        device.count = staging.count
        for dst, src in zip(device.fields(), staging.fields()):  # on the compute stream, in order
            dst.copy_(src, non_blocking=self._pin)
        self._repair_free = self.streams.record("compute")
        end = time.perf_counter()
        if record["step"] != self._last_repaired_step:
            self.repaired_steps += 1
            self._last_repaired_step = record["step"]
        self.repairs += 1
        self.drift_repairs += int(drifted)
        self.repair_seconds += end - start
        self.retrieval_seconds += copy_start - start
        self.retrieval_cpu_seconds += cpu
        self.copy_seconds += end - copy_start
        self.wait_seconds += end - start
        self.bytes_copied += staging.nbytes
        self._count(plan)
        record.update(repaired_rows=len(rows), repair_seconds=end - start,
                      bytes=record.get("bytes", 0) + staging.nbytes, waited=record.get("waited", 0.0) + end - start)
        return Delta(*device.fields(), count=device.count)

    def _count(self, plan: Any) -> None:
        self.entries_wanted += getattr(plan, "wanted", 0)
        self.entries_resident += getattr(plan, "resident", 0)

    def release(self, layer_idx: int) -> None:
        """`layer_idx`'s delta has been applied (queued on the compute stream); its buffer may be reused after it."""
        slot_key, record = self._in_use.pop(layer_idx)
        self._slot_free[slot_key] = self.streams.record("compute")
        record["attention_end"] = time.perf_counter() - self._t0
        if self.record_timeline:
            self._timeline.append(record)

    def _starved_since(self, mark) -> None:
        """The launch thread waited on the host since timing event `mark` (None without a device clock) and queued
        nothing on the compute stream meanwhile: record the gap to now, the device's idle time for want of work."""
        if mark is not None:
            self._starved.append((len(self._step_marks) - 1, mark, self.streams.timed("compute")))

    def _issue_copy(self, layer_idx: int) -> None:
        future, record, chooser = self._pending.pop(layer_idx)
        start = time.perf_counter()
        if future is not None:
            future.result()  # re-raises a failed job here, on the compute side (a host thread, not the device)
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        self.retrieval_seconds += record["retrieval_end"] - record["retrieval_start"]
        self.retrieval_cpu_seconds += record["retrieval_cpu"]
        self.entries_wanted += record["wanted"]
        self.entries_resident += record["resident"]
        staging = self._staging[layer_idx]
        slot_key, slot = self._slot(staging)
        copy_start = time.perf_counter()
        free = self._slot_free.get(slot_key)
        if free is not None:
            self.streams.wait(free, "copy")  # the buffer's previous delta has been applied
        slot.count = staging.count
        if staging.count:
            for dst, src in zip(slot.fields(), staging.fields()):
                self.streams.copy(dst, src)
        ready = self.streams.record("copy")
        self._staging_free[layer_idx] = ready
        copy_end = time.perf_counter()
        self.copy_seconds += copy_end - copy_start
        if not self.streams.asynchronous:
            self.wait_seconds += copy_end - copy_start  # a copy on a CPU device blocks the compute side
        self.bytes_copied += staging.nbytes
        record.update(
            waited=waited, copy_start=copy_start - self._t0, copy_end=copy_end - self._t0, slot=slot_key[1],
            slot_key=slot_key, bytes=staging.nbytes,
        )
        self._issued[layer_idx] = (Delta(*slot.fields(), count=slot.count), record, ready, chooser)

    def _slot(self, like: Delta) -> tuple[tuple[int, int], Delta]:
        """The next device buffer of the ring of `like`'s capacity (`layers_in_flight` of them, made on first use and
        kept, fixed in address, until `close`)."""
        capacity = like.capacity
        ring = self._rings.get(capacity)
        if ring is None:
            ring = [Delta.empty(capacity, like.keys.shape[1], like.keys.dtype, self.device)
                    for _ in range(self.layers_in_flight)]
            self._rings[capacity] = ring
            self._ring_next[capacity] = 0
        index = self._ring_next[capacity]
        self._ring_next[capacity] = (index + 1) % self.layers_in_flight
        return (capacity, index), ring[index]

    # --- accounting ----------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes of the device delta buffers (slots, positions, K, V): `layers_in_flight` per distinct staging
        capacity, independent of context and layer count (the resident sets are the layers')."""
        buffers = [slot for ring in self._rings.values() for slot in ring]
        if self._repair_device is not None:
            buffers.append(self._repair_device)
        return sum(t.nbytes for buffer in buffers for t in buffer.fields(buffer.capacity))

    def _read_device_clock(self) -> None:
        """Sum the timing event pairs of the steps the next step's mark closes (all but the last) into
        `device_wait_seconds`, `device_starved_seconds` and `device_step_seconds`, so the idle time and the step
        time cover the same steps.

        Only pairs the compute stream has passed are read (after a request's last read, all of them); on a request
        that ended in an error the others are dropped, and all of them when the device cannot answer (a CUDA error):
        reading the clock must never replace the error that ended the request (`elapsed_time` on an event not yet
        reached raises)."""
        closed = len(self._step_marks) - 1
        pairs = {"device_wait_seconds": [(a, b) for step, a, b in self._stalls if 0 <= step < closed],
                 "device_starved_seconds": [(a, b) for step, a, b in self._starved if 0 <= step < closed],
                 "device_step_seconds": list(zip(self._step_marks, self._step_marks[1:]))}
        self._stalls, self._starved, self._step_marks = [], [], []
        try:
            seconds = {name: sum(elapsed_ms(a, b) for a, b in found if a.query() and b.query()) / 1e3
                       for name, found in pairs.items()}
        except RuntimeError:  # the device is in an error state: the request's error is what matters
            return
        for name, value in seconds.items():
            setattr(self, name, getattr(self, name) + value)

    def timeline(self) -> list[dict]:
        """Per-(step, layer) records: `step`, `layer`, `slot`, `bytes`, `waited` (s) and `retrieval_start/end`,
        `copy_start/end`, `attention_start/end` in seconds since the schedule started (host clock; on CUDA the
        copy and attention times are when they were issued); a miss-repaired record adds `repaired_rows` and
        `repair_seconds` (included in `waited`, its bytes in `bytes`). Empty unless `record_timeline`."""
        return [dict(r) for r in self._timeline]

    # --- lifecycle -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop pending jobs and issued copies (waiting for a running job); keep the slots."""
        for future, _, _ in self._pending.values():
            if future is not None:
                future.cancel()
                if not future.cancelled():
                    future.exception()  # waits; a failed job must not leak into the next use
        self._pending.clear()
        self._issued.clear()
        self._in_use.clear()

    def close(self) -> None:
        """Stop the host threads, drain the copy stream, free the device slots and staging buffers. Idempotent; safe
        on any exit path."""
        if self.closed:
            return
        self.closed = True
        try:
            self.reset()
        finally:
            try:
                if self._executor is not None:
                    self._executor.shutdown(wait=True, cancel_futures=True)
                    self._executor = None
            finally:
                self.streams.close()  # in-flight copies still read the staging buffers
                self._read_device_clock()
                self._rings.clear()
                self._staging.clear()
                self._staging_free.clear()
                self._queries.clear()
                self._repair_staging = self._repair_device = None
                self._repair_free = None
                self._slot_free.clear()
