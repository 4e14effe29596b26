"""Transfer schedule: runs retrieval jobs on a host thread and lands their results in a layer-scoped device pool.

The device holds `layers_in_flight` selection slots, not one per layer. Layer `l` uses slot
`l % layers_in_flight`; its copy is issued on a dedicated copy stream that first waits for the slot's previous
user to finish (a "free" event recorded after that layer's attention), and the compute stream waits on the
copy's "ready" event only when layer `l` needs it. On CPU the "device" is host memory, events are no-ops and the
copy is a plain copy; the logic is shared.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

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
        """Bytes of the K/V payload (what crosses host→device)."""
        return self.keys.nbytes + self.values.nbytes


class TransferSchedule:
    """Retrieval jobs in layer order on one host thread, results copied into `layers_in_flight` device slots.

    Args:
        device: where attention runs.
        layers_in_flight: number of device slots.
        threads: 0 runs each job synchronously at `submit` (the reference path); 1 runs jobs on a host thread.

    Raises:
        KeyError: from `acquire` when no job was submitted for that layer.
    """

    def __init__(self, device: torch.device, layers_in_flight: int, threads: int) -> None:
        self.device = torch.device(device)
        self.layers_in_flight = layers_in_flight
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="dual-retriever") if threads > 0 else None
        )
        self._pending: dict[int, Future | Selection] = {}
        self._slots: list[Selection | None] = [None] * layers_in_flight
        self._cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._free_events: list[torch.cuda.Event | None] = [None] * layers_in_flight
        self.bytes_copied = 0
        self.peak_device_bytes = 0
        self.closed = False

    def submit(self, layer_idx: int, job: Callable[[], Selection]) -> None:
        """Schedule `job` (returns a host `Selection`) for the next use of `layer_idx`."""
        if self._executor is None:
            self._pending[layer_idx] = job()
        else:
            self._pending[layer_idx] = self._executor.submit(job)

    def acquire(self, layer_idx: int) -> Selection:
        """Wait for `layer_idx`'s job, copy its result into the layer's device slot; return the device views."""
        pending = self._pending.pop(layer_idx)
        host = pending.result() if isinstance(pending, Future) else pending
        slot_idx = layer_idx % self.layers_in_flight
        slot = self._slot(slot_idx, host)
        k = host.indices.shape[-1]
        view = Selection(
            slot.indices[..., :k], slot.valid[..., :k], slot.keys[..., :k, :], slot.values[..., :k, :]
        )
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                if self._free_events[slot_idx] is not None:
                    self._copy_stream.wait_event(self._free_events[slot_idx])
                for dst, src in zip(
                    (view.indices, view.valid, view.keys, view.values),
                    (host.indices, host.valid, host.keys, host.values),
                ):
                    dst.copy_(src, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
            torch.cuda.current_stream(self.device).wait_event(ready)
        else:
            for dst, src in zip(
                (view.indices, view.valid, view.keys, view.values),
                (host.indices, host.valid, host.keys, host.values),
            ):
                dst.copy_(src)
        self.bytes_copied += host.nbytes
        return view

    def release(self, layer_idx: int) -> None:
        """Mark `layer_idx`'s slot reusable once the work queued so far on the compute stream is done."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._free_events[layer_idx % self.layers_in_flight] = event

    def _slot(self, slot_idx: int, like: Selection) -> Selection:
        slot = self._slots[slot_idx]
        if slot is None or slot.keys.shape[-2] < like.keys.shape[-2] or slot.keys.shape[:2] != like.keys.shape[:2]:
            if self._cuda and self._free_events[slot_idx] is not None:
                self._free_events[slot_idx].synchronize()  # only on (re)allocation, never per step
            slot = Selection(
                torch.empty(like.indices.shape, dtype=like.indices.dtype, device=self.device),
                torch.empty(like.valid.shape, dtype=like.valid.dtype, device=self.device),
                torch.empty(like.keys.shape, dtype=like.keys.dtype, device=self.device),
                torch.empty(like.values.shape, dtype=like.values.dtype, device=self.device),
            )
            self._slots[slot_idx] = slot
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        return slot

    @property
    def device_bytes(self) -> int:
        """Bytes held by the device slots (K, V, indices and validity)."""
        return sum(
            s.keys.nbytes + s.values.nbytes + s.indices.nbytes + s.valid.nbytes for s in self._slots if s is not None
        )

    def reset(self) -> None:
        """Drop pending jobs (waiting for running ones); keep the slots."""
        for pending in self._pending.values():
            if isinstance(pending, Future):
                pending.cancel()
                if not pending.cancelled():
                    pending.exception()  # waits; a failed job must not leak into the next use
        self._pending.clear()

    def close(self) -> None:
        """Stop the host thread and free the device slots. Idempotent; safe on any exit path."""
        if self.closed:
            return
        self.closed = True
        self.reset()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self._slots = [None] * self.layers_in_flight
        self._free_events = [None] * self.layers_in_flight
