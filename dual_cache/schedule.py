"""Transfer schedule (docs/design.md §2, steps 1 and 3): retrieval jobs on a pool of host threads, their results copied
into a layer-scoped device buffer pool `lookahead` layers before the layer needs them.

Per decode step every full-attention layer `l` with a budget uses one selection. Its retrieval job (the selector's
choice, gather into the layer's host staging buffer) is submitted during the previous step and runs on one of
`threads` host threads, so several layers' jobs are in flight at once (each job touches only its own layer's
store, index and staging buffer, so the result does not depend on which thread runs it or when); its host→device copy
is issued when layer `l - lookahead` (cyclically, across steps) acquires its own selection, into the next slot of a
pool of `layers_in_flight` device slots taken round-robin in order of use; the compute side waits for that copy only
when layer `l` acquires. A slot is overwritten only after the attention of its previous user was queued
(`release`). On CUDA the copies run on a dedicated copy stream ordered by events (slot "free" events recorded on the
compute stream, "ready" events recorded on the copy stream); the staging buffers are pinned and a retrieval job
waits for the previous copy out of its layer's staging buffer before overwriting it. On CPU the "device" is host
memory, the copy is a plain copy and the ordering is program order; everything else is shared.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


@dataclass
class Selection:
    """Entries chosen for one (step, layer).

    Attributes:
        indices: `(B, H_kv, k)` int64 positions, ascending.
        valid: `(B, H_kv, k)` bool; False for padding slots.
        keys, values: `(B, H_kv, k, D)` gathered K/V (host staging before the copy, device after).
    """

    indices: torch.Tensor
    valid: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the payload that crosses host→device (K, V, indices and validity)."""
        return sum(t.nbytes for t in (self.indices, self.valid, self.keys, self.values))

    @classmethod
    def empty(cls, batch: int, kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, device, pin: bool = False):
        """Uninitialised buffers of `tokens` entries per (sequence, KV head)."""
        return cls(
            torch.empty(batch, kv_heads, tokens, dtype=torch.long, device=device, pin_memory=pin),
            torch.empty(batch, kv_heads, tokens, dtype=torch.bool, device=device, pin_memory=pin),
            torch.empty(batch, kv_heads, tokens, dim, dtype=dtype, device=device, pin_memory=pin),
            torch.empty(batch, kv_heads, tokens, dim, dtype=dtype, device=device, pin_memory=pin),
        )

    def narrow(self, tokens: int) -> "Selection":
        """Views of the first `tokens` entries."""
        return Selection(
            self.indices[..., :tokens], self.valid[..., :tokens], self.keys[..., :tokens, :],
            self.values[..., :tokens, :],
        )

    def copy_from(self, other: "Selection", non_blocking: bool = False) -> None:
        for dst, src in zip((self.indices, self.valid, self.keys, self.values),
                            (other.indices, other.valid, other.keys, other.values)):
            dst.copy_(src, non_blocking=non_blocking)


_Record = dict  # timeline entry of one (step, layer): seconds since the schedule started, bytes, slot


class TransferSchedule:
    """Retrieval on a host thread, copies `lookahead` layers ahead into `layers_in_flight` pooled device slots.

    Args:
        device: where attention runs.
        layer_order: the layers that retrieve, in the order the model runs them.
        slot_tokens: entries per (sequence, KV head) of each device slot: the largest layer budget.
        layers_in_flight: device slots of the pool.
        lookahead: layers between issuing a copy and using it; `< layers_in_flight`.
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
        slot_tokens: int,
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
        self.slot_tokens = slot_tokens
        self.layers_in_flight = layers_in_flight
        self.lookahead = lookahead
        self.record_timeline = record_timeline
        self._cuda = self.device.type == "cuda"
        self._executor = (
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dual-retriever",
                               initializer=torch.set_num_threads if threads > 1 else None,
                               initargs=(1,) if threads > 1 else ())
            if threads > 0 else None
        )
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._pending: dict[int, tuple[Future | None, _Record]] = {}
        self._issued: dict[int, tuple[Selection, _Record, object]] = {}  # layer -> (device view, record, ready)
        self._staging: dict[int, Selection] = {}
        self._staging_free: dict[int, torch.cuda.Event] = {}
        self._slots: list[Selection] = []
        self._slot_free: list[torch.cuda.Event | None] = [None] * layers_in_flight
        self._next_slot = 0
        self._in_use: dict[int, tuple[int, _Record, Selection]] = {}  # layer -> (slot, record, device view)
        self._repair_buffers: list[torch.Tensor] = []  # flat host buffers behind `repair` staging views
        self._repair_free: torch.cuda.Event | None = None
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
        self.closed = False

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
            staging = Selection.empty(*shape, dtype=dtype, device="cpu", pin=self._cuda)
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
            run()
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
        if layer_idx not in self._issued:
            self._issue_copy(layer_idx)
        ahead = layer_idx
        for _ in range(self.lookahead):
            ahead = self._next_in_order[ahead]
            if ahead in self._pending and ahead not in self._issued:
                self._issue_copy(ahead)
        view, record, ready = self._issued.pop(layer_idx)
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(ready)
        record.update(step=self.steps, attention_start=time.perf_counter() - self._t0)
        self._in_use[layer_idx] = (record["slot"], record, view)
        return view

    def repair(self, layer_idx: int, job: Callable[[Selection], None], rows: torch.Tensor) -> None:
        """Replace some sequences' entries of `layer_idx`'s acquired selection now, on the calling thread.

        Miss repair: the rows whose prefetched selection was chosen with a mis-speculated token's query get the
        selection of the real token's query instead. Synchronous by nature (that query exists only now): the
        compute side waits for the job and the copy, both counted in `wait_seconds`, `repair_seconds` and
        `bytes_copied`. On CUDA the copy is queued on the compute stream, after the prefetched copy and before
        the layer's attention.

        Args:
            job: fills a host staging `Selection` of the acquired selection's shape `(B, H_kv, k[, D])`, every row.
            rows: `(B,)` bool on the host; True for the sequences whose entries are replaced.

        Raises:
            KeyError: if `layer_idx` has no acquired (unreleased) selection.
        """
        _, record, view = self._in_use[layer_idx]
        if self._repair_free is not None:
            self._repair_free.synchronize()  # the previous repair's copy out of the staging buffers has finished
        staging = self._repair_staging(view)
        start = time.perf_counter()
        job(staging)
        copy_start = time.perf_counter()
        row_ids = rows.nonzero().flatten()
        if len(row_ids) == len(rows):
            view.copy_from(staging, non_blocking=self._cuda)
            copied = staging.nbytes
        else:
            device_rows = row_ids.to(self.device)
            copied = 0
            for dst, src in zip((view.indices, view.valid, view.keys, view.values),
                                (staging.indices, staging.valid, staging.keys, staging.values)):
                picked = src.index_select(0, row_ids)
                dst.index_copy_(0, device_rows, picked.to(self.device, non_blocking=self._cuda))
                copied += picked.nbytes
        if self._cuda:
            self._repair_free = torch.cuda.Event()
            self._repair_free.record(torch.cuda.current_stream(self.device))
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
        record.update(repaired_rows=len(row_ids), repair_seconds=end - start, bytes=record.get("bytes", 0) + copied,
                      waited=record.get("waited", 0.0) + end - start)

    def _repair_staging(self, like: Selection) -> Selection:
        """Host staging (pinned on CUDA) of `like`'s shape: contiguous views of flat buffers that grow to the
        largest selection repaired, shared by every layer (repairs run one at a time)."""
        shapes = [like.indices.shape, like.valid.shape, like.keys.shape, like.values.shape]
        dtypes = [like.indices.dtype, like.valid.dtype, like.keys.dtype, like.values.dtype]
        numels = [int(torch.Size(shape).numel()) for shape in shapes]
        if not self._repair_buffers or any(b.numel() < n for b, n in zip(self._repair_buffers, numels)):
            self._repair_buffers = [
                torch.empty(n, dtype=d, pin_memory=self._cuda) for n, d in zip(numels, dtypes)
            ]
        return Selection(*(b[:n].view(shape) for b, n, shape in zip(self._repair_buffers, numels, shapes)))

    def release(self, layer_idx: int) -> None:
        """`layer_idx`'s attention is queued on the compute stream; its slot may be reused after it."""
        slot_idx, record, _ = self._in_use.pop(layer_idx)
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._slot_free[slot_idx] = event
        record["attention_end"] = time.perf_counter() - self._t0
        if self.record_timeline:
            self._timeline.append(record)

    def _issue_copy(self, layer_idx: int) -> None:
        future, record = self._pending.pop(layer_idx)
        start = time.perf_counter()
        if future is not None:
            future.result()  # re-raises a failed job here, on the compute side
        waited = time.perf_counter() - start
        self.wait_seconds += waited
        self.retrieval_seconds += record["retrieval_end"] - record["retrieval_start"]
        staging = self._staging[layer_idx]
        slot_idx = self._next_slot
        self._next_slot = (self._next_slot + 1) % self.layers_in_flight
        view = self._slot(slot_idx, staging).narrow(staging.keys.shape[2])
        copy_start = time.perf_counter()
        ready = None
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                if self._slot_free[slot_idx] is not None:
                    self._copy_stream.wait_event(self._slot_free[slot_idx])
                view.copy_from(staging, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
            self._staging_free[layer_idx] = ready
        else:
            view.copy_from(staging)
        copy_end = time.perf_counter()
        self.copy_seconds += copy_end - copy_start
        if not self._cuda:
            self.wait_seconds += copy_end - copy_start  # a CPU copy blocks the compute side
        self.bytes_copied += staging.nbytes
        record.update(
            waited=waited, copy_start=copy_start - self._t0, copy_end=copy_end - self._t0, slot=slot_idx,
            bytes=staging.nbytes,
        )
        self._issued[layer_idx] = (view, record, ready)

    def _slot(self, slot_idx: int, like: Selection) -> Selection:
        if not self._slots:
            batch, kv_heads, _, dim = like.keys.shape
            self._slots = [
                Selection.empty(batch, kv_heads, self.slot_tokens, dim, like.keys.dtype, self.device)
                for _ in range(self.layers_in_flight)
            ]
        slot = self._slots[slot_idx]
        if slot.keys.shape[2] < like.keys.shape[2] or slot.keys.shape[:2] != like.keys.shape[:2]:
            raise ValueError(
                f"A selection of shape {tuple(like.keys.shape)} does not fit the device slots "
                f"{tuple(slot.keys.shape)}; every layer's budget must be <= slot_tokens and the batch fixed."
            )
        return slot

    # --- accounting ----------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> int:
        """Bytes of the device slot pool (K, V, indices and validity): independent of context and layer count."""
        return sum(s.nbytes for s in self._slots)

    def overlap_ratio(self) -> float:
        """`1 − waited / (retrieval + copy)`: 1 when retrieval and copies hide behind compute; nan before any."""
        busy = self.retrieval_seconds + self.copy_seconds
        return float("nan") if busy == 0 else max(0.0, 1.0 - self.wait_seconds / busy)

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
        self._next_slot = 0

    def close(self) -> None:
        """Stop the host thread, free the device slots and staging buffers. Idempotent; safe on any exit path."""
        if self.closed:
            return
        self.closed = True
        try:
            self.reset()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None
            if self._cuda and self._copy_stream is not None:
                self._copy_stream.synchronize()  # in-flight copies still read the staging buffers
            self._slots = []
            self._staging.clear()
            self._staging_free.clear()
            self._repair_buffers = []
            self._repair_free = None
            self._slot_free = [None] * self.layers_in_flight
