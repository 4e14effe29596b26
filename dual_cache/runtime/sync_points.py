"""Counting the points where the host waits for the device, on any machine (docs/design.md §5).

On a CUDA device a scalar read (`.item()`, `.tolist()`, `bool(tensor)`, `int(tensor)`), a device→host copy
(`.cpu()`, `.numpy()`, a blocking copy to host memory), an output of unknown size (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`) or a comparison answered on the host (`torch.equal`) stalls the launching thread until
every queued kernel has run, and so does waiting on an event from the host. `SyncCounter` counts these operations on
the thread that enters it, whatever the device: on a CPU machine the same code makes the same calls, so a test there
catches a decode step that would synchronize on a GPU. It counts every such call on that thread, on host tensors
too (a host-side scalar read costs nothing on CPU but cannot be told apart from a device read without a device), so
the decode loop keeps its host bookkeeping in Python numbers and lists. A generic `.to(device)` cannot be told apart
on CPU either (the model's device is the host): the project reads device tensors on the host only through
`streams.to_host` (counted) or asynchronous copies into pinned staging fenced by events, and its host waits on those
events from the launching thread go through `count_host_wait`. Other threads (retrieval workers, which may wait on
the device freely) are not counted.

    with SyncCounter() as counter:
        ...  # one decode step
    counter.total, counter.by_op  # e.g. 1, {"Tensor.tolist": 1}
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

# the torch functions whose result the host needs at once (a device→host transfer and a wait)
_SYNCING = {
    torch.Tensor.item: "Tensor.item",
    torch.Tensor.tolist: "Tensor.tolist",
    torch.Tensor.__bool__: "bool(Tensor)",
    torch.Tensor.__int__: "int(Tensor)",
    torch.Tensor.__float__: "float(Tensor)",
    torch.Tensor.__index__: "Tensor.__index__",
    torch.Tensor.cpu: "Tensor.cpu",
    torch.Tensor.numpy: "Tensor.numpy",
    torch.Tensor.nonzero: "nonzero",
    torch.nonzero: "nonzero",
    torch.Tensor.masked_select: "masked_select",
    torch.masked_select: "masked_select",
    torch.unique: "unique",
    torch.Tensor.unique: "unique",
    torch.equal: "torch.equal",
    torch.Tensor.any: None,  # counted only when its result is read (bool), which the entries above catch
}

_active = threading.local()


class SyncCounter(TorchFunctionMode):
    """Counts host-synchronizing torch calls (and `count_host_wait` calls) on the thread that enters it.

    Attributes:
        by_op: `Counter` of counted calls by operation name.
        total: their sum.
    """

    def __init__(self) -> None:
        super().__init__()
        self.by_op: Counter = Counter()
        self._thread = threading.get_ident()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def reset(self) -> None:
        """Forget what was counted so far."""
        self.by_op.clear()

    def __enter__(self):
        _active.counter = self
        return super().__enter__()

    def __exit__(self, *exc_info):
        _active.counter = None
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if threading.get_ident() == self._thread and not getattr(_active, "paused", False):
            name = _SYNCING.get(func)
            if name is not None:
                self.by_op[name] += 1
            elif func is torch.Tensor.__getitem__ and _bool_index(args[1] if len(args) > 1 else None):
                self.by_op["boolean-mask indexing"] += 1
        return func(*args, **kwargs)


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Calls on this thread inside the block are not counted (a read already counted by its helper)."""
    before = getattr(_active, "paused", False)
    _active.paused = True
    try:
        yield
    finally:
        _active.paused = before


def count_host_wait(what: str) -> None:
    """Record, in the `SyncCounter` active on this thread (if any), a host wait for the device (`what` names it):
    an event waited on, a blocking read."""
    counter = getattr(_active, "counter", None)
    if counter is not None and threading.get_ident() == counter._thread and not getattr(_active, "paused", False):
        counter.by_op[f"host wait: {what}"] += 1
