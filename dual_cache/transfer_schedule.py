"""Transfer schedule (docs/design.md §2, steps 1 and 3): retrieval jobs on a pool of host threads, their results copied
into layer-scoped device slots `lookahead` layers before the layer needs them, every transfer ordered by streams and
events (`streams.py`), never by a host wait on the launching thread.

Per decode step every full-attention layer `l` with a budget uses one selection. Its retrieval job (the selector's
choice, gather into the layer's host staging buffer) is submitted during the previous step, right after the layer's
attention, with the speculated token's query on its way to the host (`query_to_host`: pinned staging, copy stream,
an event the job waits on); it runs on one of `threads` host threads, so several layers' jobs are in flight at once
(each touches only its own layer's store, index and staging, so the result does not depend on which thread runs it
or when). Its host→device copy is enqueued on the copy stream when layer `l - lookahead` (cyclically, across steps)
acquires its own selection, into the next slot of the ring of slots of its budget (`layers_in_flight` contiguous
slots of exactly that budget, fixed in address for the request), after the event that marks the slot's previous
user's attention as done; the compute stream waits for the copy's event when layer `l` acquires. The launching
thread waits only for a retrieval job to finish (a host thread, not the device). On a CPU device the "device" is
host memory and `HostStreams` makes every copy immediate; `SimulatedStreams` runs the same code with asynchronous
copies (tests).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import torch

from .selection import Selection, selection_fields
from .streams import elapsed_ms, make_streams


_Record = dict  # timeline entry of one (step, layer): seconds since the schedule started, bytes, slot


class TransferSchedule:
    """Retrieval on host threads, copies `lookahead` layers ahead into per-budget rings of `layers_in_flight` device
    slots, ordered by streams and events.

    Args:
        device: where attention runs.
        layer_order: the layers that retrieve, in the order the model runs them.
        layers_in_flight: device slots per ring (one ring per distinct budget among the layers).
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
        self._pending: dict[int, tuple[Future | None, _Record]] = {}
        self._issued: dict[int, tuple[Selection, _Record, object]] = {}  # layer -> (device slot, record, ready)
        self._staging: dict[int, Selection] = {}
        self._staging_free: dict[int, object] = {}  # layer -> event: the copy out of its staging buffer is done
        self._queries: dict[tuple[int, str], torch.Tensor] = {}  # (layer, use) -> pinned host query buffer
        self._rings: dict[int, list[Selection]] = {}  # budget -> its device slots
        self._ring_next: dict[int, int] = {}
        self._slot_free: dict[tuple[int, int], object] = {}  # (budget, slot) -> event: its last attention is done
        self._in_use: dict[int, tuple[tuple[int, int], _Record, Selection]] = {}  # layer -> (slot key, record, slot)
        self._repair_buffers: list[torch.Tensor] = []  # flat host buffers behind `repair` staging views
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
    def submit(
        self, layer_idx: int, job: Callable[[Selection], None], shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> None:
        """Schedule `job` for the next use of `layer_idx`.

        Args:
            job: fills the given host staging `Selection` (indices, valid, keys, values) in place.
            shape: `(B, H_kv, k, D)` of that selection; dtype: K/V dtype.
        """
        staging = self._staging.get(layer_idx)
        if staging is None or tuple(staging.keys.shape) != tuple(shape) or staging.keys.dtype != dtype:
            staging = Selection.empty(*shape, dtype=dtype, device="cpu", pin=self._pin)
            self._staging[layer_idx] = staging
        record = _Record(layer=layer_idx)
        free = self._staging_free.get(layer_idx)

        def run() -> None:
            if free is not None:
                free.synchronize()  # the previous copy out of this staging buffer has finished
            start = time.perf_counter()
            with torch.inference_mode():  # buffers are inference tensors (allocated under generate's mode)
                job(staging)
            end = time.perf_counter()
            record.update(retrieval_start=start - self._t0, retrieval_end=end - self._t0)

        if self._executor is None:
            idle_from = self.streams.timed("compute")
            run()
            self._starved_since(idle_from)
            self.wait_seconds += record["retrieval_end"] - record["retrieval_start"]  # the compute side ran it
            self._pending[layer_idx] = (None, record)
        else:
            self._pending[layer_idx] = (self._executor.submit(run), record)

    # --- compute side --------------------------------------------------------------------------------
    def acquire(self, layer_idx: int) -> Selection:
        """The device selection of `layer_idx` for the running step; issues the copies `lookahead` layers ahead.

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
        view, record, ready = self._issued.pop(layer_idx)
        before = self.streams.timed("compute")
        self.streams.wait(ready, "compute")  # the device waits for the copy, not the host
        if before is not None:
            if layer_idx == self.order[0]:
                self._step_marks.append(entry)
            step = len(self._step_marks) - 1
            self._starved.append((step, entry, before))
            self._stalls.append((step, before, self.streams.timed("compute")))
        record.update(step=self.steps, attention_start=time.perf_counter() - self._t0)
        self._in_use[layer_idx] = (record["slot_key"], record, view)
        return view

    def repair(self, layer_idx: int, job: Callable[[Selection], None], rows: list[int]) -> None:
        """Replace some sequences' entries of `layer_idx`'s acquired selection now, on the calling thread.

        Miss repair: the rows whose prefetched selection was chosen with a mis-speculated token's query get the
        selection of the real token's query instead. Synchronous by nature (that query exists only now): the
        compute side waits for the job and the copy, both counted in `wait_seconds`, `repair_seconds` and
        `bytes_copied`. On CUDA the copy is queued on the compute stream, after the prefetched copy and before
        the layer's attention.

        Args:
            job: fills a host staging `Selection` of the acquired selection's shape `(B, H_kv, k[, D])`, every row.
            rows: the sequences whose entries are replaced (indices into the batch, ascending).

        Raises:
            KeyError: if `layer_idx` has no acquired (unreleased) selection.
        """
        _, record, view = self._in_use[layer_idx]
        idle_from = self.streams.timed("compute")
        if self._repair_free is not None:
            self._repair_free.synchronize()  # the previous repair's copy out of the staging buffers has finished
        staging = self._repair_staging(view)
        start = time.perf_counter()
        job(staging)
        self._starved_since(idle_from)
        copy_start = time.perf_counter()
        # on the compute stream: after the prefetched copy (the stream waited for it at `acquire`), before attention
        if len(rows) == view.keys.shape[0]:
            for dst, src in zip(selection_fields(view), selection_fields(staging)):
                dst.copy_(src, non_blocking=self._pin)
            copied = staging.nbytes
        else:
            row_ids = torch.tensor(rows, dtype=torch.long)
            device_rows = row_ids.to(self.device, non_blocking=self._pin)
            copied = 0
            for dst, src in zip(selection_fields(view), selection_fields(staging)):
                picked = src.index_select(0, row_ids)
                dst.index_copy_(0, device_rows, picked.to(self.device, non_blocking=self._pin))
                copied += picked.nbytes
        self._repair_free = self.streams.record("compute")
        end = time.perf_counter()
        if record["step"] != self._last_repaired_step:
            self.repaired_steps += 1
            self._last_repaired_step = record["step"]
        self.repairs += 1
        self.repair_seconds += end - start
        self.retrieval_seconds += copy_start - start
        self.copy_seconds += end - copy_start
        self.wait_seconds += end - start
        self.bytes_copied += copied
        record.update(repaired_rows=len(rows), repair_seconds=end - start, bytes=record.get("bytes", 0) + copied,
                      waited=record.get("waited", 0.0) + end - start)

    def _repair_staging(self, like: Selection) -> Selection:
        """Host staging (pinned on CUDA) of `like`'s shape: contiguous views of flat buffers that grow to the
        largest selection repaired, shared by every layer (repairs run one at a time)."""
        shapes = [like.indices.shape, like.valid.shape, like.keys.shape, like.values.shape]
        dtypes = [like.indices.dtype, like.valid.dtype, like.keys.dtype, like.values.dtype]
        numels = [int(torch.Size(shape).numel()) for shape in shapes]
        if not self._repair_buffers or any(b.numel() < n for b, n in zip(self._repair_buffers, numels)):
            self._repair_buffers = [
                torch.empty(n, dtype=d, pin_memory=self._pin) for n, d in zip(numels, dtypes)
            ]
        return Selection(*(b[:n].view(shape) for b, n, shape in zip(self._repair_buffers, numels, shapes)))

    def release(self, layer_idx: int) -> None:
        """`layer_idx`'s attention is queued on the compute stream; its slot may be reused after it."""
        slot_key, record, _ = self._in_use.pop(layer_idx)
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
        future, record = self._pending.pop(layer_idx)
        start = time.perf_counter()
        if future is not None:
            future.result()  # re-raises a failed job here, on the compute side (a host thread, not the device)
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        self.retrieval_seconds += record["retrieval_end"] - record["retrieval_start"]
        staging = self._staging[layer_idx]
        slot_key, slot = self._slot(staging)
        copy_start = time.perf_counter()
        free = self._slot_free.get(slot_key)
        if free is not None:
            self.streams.wait(free, "copy")  # the slot's previous attention has read it
        for dst, src in zip(selection_fields(slot), selection_fields(staging)):
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
        self._issued[layer_idx] = (slot, record, ready)

    def _slot(self, like: Selection) -> tuple[tuple[int, int], Selection]:
        """The next slot of the ring of `like`'s budget: `(B, H_kv, budget[, D])` contiguous device buffers, made on
        first use and kept (fixed addresses) until `close`."""
        budget = like.keys.shape[2]
        ring = self._rings.get(budget)
        if ring is None:
            batch, kv_heads, _, dim = like.keys.shape
            ring = [Selection.empty(batch, kv_heads, budget, dim, like.keys.dtype, self.device)
                    for _ in range(self.layers_in_flight)]
            self._rings[budget] = ring
            self._ring_next[budget] = 0
        index = self._ring_next[budget]
        self._ring_next[budget] = (index + 1) % self.layers_in_flight
        return (budget, index), ring[index]

    # --- accounting ----------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes of the device slots (K, V, indices and validity): `layers_in_flight` per distinct layer budget,
        independent of context and layer count."""
        return sum(slot.nbytes for ring in self._rings.values() for slot in ring)

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
        for future, _ in self._pending.values():
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
                self._repair_buffers = []
                self._repair_free = None
                self._slot_free.clear()
