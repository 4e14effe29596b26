"""Streams and events for the decode step's transfers (docs/design.md §5): CUDA's, or their CPU stand-ins.

The decode step orders every transfer with streams and events, never with a host wait on the launching thread:
new K/V and queries go device→host into pinned staging on a side ("copy") stream, the chosen entries go host→device
into fixed device slots on that stream, and each consumer waits on an event — the compute stream on the device, a
retrieval worker on the host. `Streams` is that contract:

- `record(on)`: an event that completes once everything enqueued so far on stream `on` ("compute" or "copy") has
  run;
- `wait(event, on)`: what stream `on` runs after this waits for `event` (on CUDA the device waits, not the host);
- `copy(dst, src)`: enqueue `dst.copy_(src)` on the copy stream (after what it already holds);
- `Event.synchronize()`: the calling (host) thread waits for the event.

Three implementations: `CudaStreams` (a CUDA device: `torch.cuda.Stream` / `Event`, non-blocking copies),
`HostStreams` (a CPU device, the default there: nothing is asynchronous, copies run at once, events are complete when
recorded) and `SimulatedStreams` (a CPU device under `simulated_streams()`: the copy stream is a thread of its own
that runs its queue in order after a random delay per operation, and the compute stream is the launching thread,
which blocks in `wait` — so a missing wait or a buffer reused too early shows up as wrong data in the CPU tests,
as it would on a GPU).

`to_host(tensor)` is the project's one blocking device→host read on the launching thread (counted by
`sync_points.SyncCounter`).
"""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from typing import Iterator

import torch

from .sync_points import count_host_wait, uncounted

STREAMS = ("compute", "copy")


@contextlib.contextmanager
def _deliberate(tensor: torch.Tensor) -> Iterator[None]:
    """A read the decode loop makes on purpose: allowed under `torch.cuda.set_sync_debug_mode("error")`, which
    `eval/gpu_check.py` sets to catch every other synchronization of a decode step."""
    mode = torch.cuda.get_sync_debug_mode() if tensor.is_cuda else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def elapsed_ms(start, end) -> float:
    """Device time between two completed timing events of one `Streams` (`timed`), in milliseconds."""
    if isinstance(start, _SimEvent):
        return (end.at - start.at) * 1e3
    return start.elapsed_time(end)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`: a blocking device→host read, counted as a host synchronization point (on a CPU
    tensor, a copy)."""
    count_host_wait("to_host")
    with _deliberate(tensor):
        return tensor.detach().to("cpu", copy=True)


def to_host_list(tensor: torch.Tensor) -> list:
    """`tensor` as (nested) Python numbers: one blocking device→host read, counted once."""
    count_host_wait("to_host")
    with uncounted(), _deliberate(tensor):
        return tensor.detach().tolist()


def to_device(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python numbers (or a host tensor) on `device` without a host wait: staged through page-locked memory and
    copied with `non_blocking=True` on CUDA (a copy from pageable memory would wait for the stream); as they are on a
    CPU device."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _DoneEvent:
    """An event complete from the start (`HostStreams`)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class HostStreams:
    """CPU device, nothing asynchronous: copies run when enqueued, events are complete when recorded."""

    asynchronous = False

    def record(self, on: str) -> _DoneEvent:
        return _DoneEvent()

    def timed(self, on: str) -> None:
        """No device clock: None (see `CudaStreams.timed`)."""
        return None

    def wait(self, event, on: str) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def close(self) -> None:
        pass


class CudaStreams:
    """A CUDA device: the current stream computes, a dedicated stream copies; events fence them.

    Args:
        device: the CUDA device.
    """

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._copy = torch.cuda.Stream(self.device)

    def _stream(self, on: str):
        return self._copy if on == "copy" else torch.cuda.current_stream(self.device)

    def record(self, on: str) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self._stream(on))
        return event

    def wait(self, event: torch.cuda.Event, on: str) -> None:
        self._stream(on).wait_event(event)

    def timed(self, on: str) -> torch.cuda.Event:
        """A timing event recorded on stream `on`: `elapsed_ms(a, b)` between two of them is device time."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(self._stream(on))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue `dst.copy_(src)` on the copy stream; a device `src` made on the compute stream is kept alive for
        it (`record_stream`). The caller has made the copy stream wait for `src` to be ready."""
        if src.device.type == "cuda":
            src.record_stream(self._copy)
        with torch.cuda.stream(self._copy):
            dst.copy_(src, non_blocking=True)

    def close(self) -> None:
        self._copy.synchronize()  # in-flight copies still read staging buffers the caller is about to free


class _SimEvent:
    """An event of `SimulatedStreams`: set when the copy thread reaches it (or at once on the compute stream); `at`
    is when (`time.perf_counter()`), the simulated device clock."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.at = 0.0

    def _set(self) -> None:
        self.at = time.perf_counter()
        self._done.set()

    def synchronize(self) -> None:
        if not self._done.is_set():
            count_host_wait("simulated event")
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()


class SimulatedStreams:
    """A CPU device behaving like a GPU with a copy engine: the copy stream's operations run on a thread of their
    own, in order, each after a random delay of up to `max_delay_s`; the compute stream is the launching thread (its
    work has run when it records an event; `wait(event, "compute")` blocks it until the event completes, as the
    device would).

    Args:
        max_delay_s: the largest random delay before each copy-stream operation (seconds).
        seed: seed of the delays.
    """

    asynchronous = True

    def __init__(self, max_delay_s: float = 0.002, seed: int = 0) -> None:
        self.max_delay_s = max_delay_s
        self._random = random.Random(seed)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dual-simulated-copy-stream", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with torch.inference_mode():  # the decode step's buffers are inference tensors
            self._loop()

    def _loop(self) -> None:
        while True:
            operation = self._queue.get()
            if operation is None:
                return
            kind, first, second, delay = operation
            try:
                if kind == "copy":
                    time.sleep(delay)
                    first.copy_(second)
                elif kind == "wait":
                    first._done.wait()
                else:  # record
                    first._set()
            except BaseException as error:  # noqa: BLE001 - surfaced by close()
                self._error = error
                if kind == "record":
                    first._set()

    def record(self, on: str) -> _SimEvent:
        event = _SimEvent()
        if on == "copy":
            self._queue.put(("record", event, None, 0.0))
        else:
            event._set()
        return event

    def timed(self, on: str) -> _SimEvent:
        """A timing event (as `record`; its completion time is the simulated device clock)."""
        return self.record(on)

    def wait(self, event: _SimEvent, on: str) -> None:
        if on == "copy":
            self._queue.put(("wait", event, None, 0.0))
        else:
            event._done.wait()  # the compute stream is this thread: the device waiting, not a host sync

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._queue.put(("copy", dst, src, self._random.random() * self.max_delay_s))

    def close(self) -> None:
        """Run what is queued, stop the copy thread (a host wait, as `CudaStreams.close`'s synchronize); re-raises an
        error a copy raised."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
            count_host_wait("copy stream drained")  # counted once stopped: a strict counter raising leaks no thread
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_simulation: dict | None = None


@contextlib.contextmanager
def simulated_streams(max_delay_s: float = 0.002, seed: int = 0) -> Iterator[None]:
    """Within this block, caches on a CPU device order their transfers with `SimulatedStreams` (tests of the CUDA
    ordering on CPU)."""
    global _simulation
    previous, _simulation = _simulation, {"max_delay_s": max_delay_s, "seed": seed}
    try:
        yield
    finally:
        _simulation = previous


def make_streams(device: torch.device):
    """The streams for a request on `device`: `CudaStreams` on CUDA, `SimulatedStreams` on CPU inside
    `simulated_streams()`, else `HostStreams`."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaStreams(device)
    if _simulation is not None:
        return SimulatedStreams(**_simulation)
    return HostStreams()
