"""The control channel of a tensor-parallel server: what rank 0 tells the other ranks each scheduler turn, over
`torch.distributed` (docs/serving.md, "Past one GPU: tensor parallelism").

Every rank of a tensor-parallel server runs the same scheduler on its shard of the model (`tp_scheduler.py`). Before
each turn the ranks meet in `TPGroup.exchange`: one MAX all-reduce of four int64 on a gloo group (CPU) carries the
number of items rank 0 has to send (requests that arrived, cancellations), whether any rank asks to stop, and each
rank's digest of its scheduler state after the previous turn (as `d` and `-d`, so one MAX gives both the largest
and the smallest digest: equal iff every rank holds the same state, sampled tokens included). Only when rank 0 has
items does a `broadcast_object_list` follow. A rank that died breaks the collective on the others (gloo sees the
closed connection), which `exchange` raises as `GroupLost`.

The model's own forwards synchronise through transformers' tensor-parallel collectives on the default group (NCCL on
CUDA, gloo on CPU); this group is separate and always gloo, as transformers' continuous batching does for its
decisions, so a CUDA job's control messages never queue behind kernels.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class GroupLost(RuntimeError):
    """A collective of the control group failed: a rank died or stopped answering within the timeout."""


@dataclass(frozen=True)
class Exchange:
    """What every rank learns at a turn boundary.

    Attributes:
        items: rank 0's items, in the order rank 0 queued them (empty on every rank when it had none).
        stop: some rank asked the group to stop.
        diverged: the ranks' state digests differ (every rank sees the same value).
    """

    items: list
    stop: bool
    diverged: bool


def digest(values: list[int]) -> int:
    """A 56-bit digest of a list of ints (blake2b; the same on every rank, unlike Python's `hash`)."""
    h = hashlib.blake2b(digest_size=7)
    for value in values:
        h.update(struct.pack("<q", int(value)))
    return int.from_bytes(h.digest(), "little")


class TPGroup:
    """The ranks of one tensor-parallel server and the control messages between them (rank 0 sends).

    Create it in every rank, after `torch.distributed` is initialised (creating the group is a collective).

    Args:
        timeout_s: seconds a collective of this group waits for the slowest rank before it fails (a rank that
            died fails it at once; this bounds a rank that hangs).

    Attributes:
        rank, size: this process's rank and the number of ranks (the whole `torch.distributed` world).

    Raises:
        RuntimeError: `torch.distributed` is not initialised. ValueError: a timeout that is not positive.
    """

    def __init__(self, timeout_s: float = 1800.0) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TPGroup needs torch.distributed initialised (run under torchrun).")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}.")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._header = torch.zeros(4, dtype=torch.int64)

    @property
    def is_driver(self) -> bool:
        """Whether this rank receives the requests and sends the decisions (rank 0)."""
        return self.rank == 0

    def exchange(self, items: list, stop: bool, state: int) -> Exchange:
        """The turn boundary: every rank calls it once per scheduler turn, in the same order.

        Args:
            items: what rank 0 sends (picklable); ignored on the other ranks.
            stop: whether this rank asks the group to stop.
            state: this rank's digest of its state (`digest`), 0 <= state < 2**62.

        Raises:
            GroupLost: a rank died or the timeout passed.
        """
        count = len(items) if self.is_driver else 0
        self._header.copy_(torch.tensor([count, int(stop), state, -state], dtype=torch.int64))
        try:
            dist.all_reduce(self._header, op=dist.ReduceOp.MAX, group=self.group)
            count, stop_flag, high, negative_low = self._header.tolist()
            diverged = high != -negative_low
            received: list = []
            if count and not diverged:
                holder = [items if self.is_driver else None]
                dist.broadcast_object_list(holder, src=0, group=self.group)
                received = holder[0]
        except (RuntimeError, ValueError) as error:  # gloo: connection closed by a peer, or timed out
            raise GroupLost(f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}") \
                from error
        return Exchange(received, bool(stop_flag), diverged)

    def gather(self, value: Any) -> list:
        """Every rank's `value` (picklable), in rank order, on every rank.

        Raises:
            GroupLost: a rank died or the timeout passed.
        """
        out: list = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.group)
        except (RuntimeError, ValueError) as error:
            raise GroupLost(f"{type(error).__name__}: {error}") from error
        return out

    def minimum(self, value: int) -> int:
        """The smallest of the ranks' `value` (int64), on every rank.

        Raises:
            GroupLost: a rank died or the timeout passed.
        """
        tensor = torch.tensor([int(value)], dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        except (RuntimeError, ValueError) as error:
            raise GroupLost(f"{type(error).__name__}: {error}") from error
        return int(tensor.item())

    def close(self) -> None:
        """Destroy the control group (idempotent; the default process group is the caller's)."""
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except (RuntimeError, ValueError):  # the default group is already gone
                pass
            self.group = None
