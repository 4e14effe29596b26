"""The scheduler of a tensor-parallel server: one copy per rank, rank 0's decisions, forwards in lockstep.

Each rank holds its shard of the model (its KV heads, its slice of every projection) and a `TPScheduler` whose
`DualBatch` runs that shard's forwards; transformers' collectives inside each forward need every rank to run the same
forward at the same time. So every rank runs the same scheduler code on the same inputs, and the inputs are rank
0's: only rank 0 serves HTTP, and what its clients do — a request arrives, a client cancels or disconnects, the
server stops — is queued and sent to every rank at the next turn boundary (`distributed.TPGroup.exchange`), where
all ranks apply it in the same order. From the same inputs each rank's scheduler takes the same decisions
(admissions, prefill chunks, joins and leaves of the running batch, evictions), and the forwards give every rank the
same logits (transformers gathers them), so each rank picks the same tokens: greedy ones by argmax, sampled ones
from the request's own generator, seeded by rank 0 (a request without a seed gets one drawn on rank 0). Rank 0's
tokens are the reference: at every turn boundary the ranks compare a digest of their state (every row's token count,
last token and finish reason, the queue, sessions and cached prefixes), and a rank whose state differs stops the
group with a log line naming the first difference, before another forward runs.

This is the shape of transformers' continuous batching under tensor parallelism (its TP driver broadcasts new
requests and cancellations; every rank schedules) and of SGLang's scheduler per TP rank; vLLM instead sends one
scheduler's output to N workers. A rank that dies breaks the next collective on the others; they stop, log why and
exit, and rank 0's HTTP server exits with them (`on_exit`).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import weakref
from typing import Callable

from transformers.utils import logging

from ..config import DualDecoderConfig
from ..host.memory import available_host_bytes, format_bytes
from ..model.tensor_parallel import ranks_per_host, shard_of, tp_size_of
from .distributed import GroupLost, TPGroup, digest
from .requests import FINISH_REASONS, RequestHandle
from .rows import GREEDY_BELOW
from .scheduler import Scheduler

logger = logging.get_logger(__name__)
HEARTBEAT_S = 0.5  # an idle rank 0 meets the other ranks this often (they block in the collective meanwhile)
_REASON_CODES = {reason: i + 1 for i, reason in enumerate(FINISH_REASONS)}


def _drop(event: tuple) -> None:
    """Events of the requests mirrored on ranks other than 0 (nobody reads them)."""


class TPScheduler(Scheduler):
    """A `Scheduler` that runs on every rank of a tensor-parallel group, with rank 0's inputs (module docstring).

    Create one on every rank, with the same arguments, after `torch.distributed` is initialised and the model is
    loaded with tensor parallelism (`tensor_parallel.load_kwargs`). Rank 0 takes requests (`add_request`), cancels
    them (`cancel`) and stops (`cancel_all`, `stop`); those calls return at once and act on every rank at the next
    turn boundary. On the other ranks those calls are refused, except `cancel_all`, which asks the group to stop.

    Args:
        model, tokenizer, cache_config, dense, max_batch, prefix_block: as `Scheduler` (the same on every rank).
        group: the ranks' `TPGroup` (its world is the model's tensor-parallel group).
        max_host_bytes: as `Scheduler`; None = 90% of the host memory available at start on the rank that has least,
            divided among the ranks of one host (every rank needs the same allowance to take the same decisions).
            Each request's `DualDecoderCache` gets the same allowance unless `cache_config.max_host_bytes` is set.
        on_exit: called on the scheduler's thread when its loop ends, with None after a stop or a message saying
            why the group failed (rank 0's server uses it to exit).

    Attributes:
        failure: None, or why the loop ended other than by a stop (a rank died, the ranks diverged, an error).

    Raises:
        ValueError: a bad option, a group whose size is not the model's tensor-parallel degree, a tensor-parallel
            plan that cannot split the model's heads (`tensor_parallel.shard_of`), or ranks started with different
            options. GroupLost: a rank died during the start.
    """

    def __init__(self, model, tokenizer=None, cache_config: DualDecoderConfig | dict | None = None,
                 dense: bool = False, max_batch: int = 8, max_host_bytes: int | None = None, prefix_block: int = 0,
                 *, group: TPGroup, on_exit: Callable[[str | None], None] | None = None) -> None:
        if tp_size_of(model) != group.size:
            raise ValueError(f"The model is split over {tp_size_of(model)} tensor-parallel rank(s) but the group has "
                             f"{group.size}: load it with tensor_parallel.load_kwargs({group.size}) in every rank.")
        shard = shard_of(model)  # refuses an uneven split before anything else
        config = cache_config if isinstance(cache_config, DualDecoderConfig) else \
            DualDecoderConfig.from_dict(cache_config or {})
        options = {"cache_config": dataclasses.asdict(config), "dense": dense, "max_batch": max_batch,
                   "max_host_bytes": max_host_bytes, "prefix_block": prefix_block, "kv_heads": shard.kv_heads}
        every = group.gather(options)
        differing = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
        if differing:
            raise ValueError(f"Ranks {differing} were started with other options than rank 0 ({every[differing[0]]} vs "
                             f"{every[0]}); start every rank with the same command line.")
        if max_host_bytes is None:  # the same allowance on every rank, or the ranks could admit differently
            share = int(0.9 * available_host_bytes() / ranks_per_host(group.size))
            max_host_bytes = group.minimum(share)
            if group.is_driver:
                logger.warning(f"Tensor-parallel serving: each rank may use {format_bytes(max_host_bytes)} of host "
                               f"memory (--max-host-bytes; the least any rank had at start).")
        if config.max_host_bytes is None:
            config = config.replace(max_host_bytes=max_host_bytes)
        self.group, self.on_exit, self.failure = group, on_exit, None
        self._inbox: list[tuple] = []  # rank 0: what clients did since the last turn boundary, in order
        self._stop_asked = False
        self._wake = threading.Event()
        self._handles: weakref.WeakValueDictionary[int, RequestHandle] = weakref.WeakValueDictionary()
        self.turns = 0
        super().__init__(model, tokenizer, cache_config=config, dense=dense, max_batch=max_batch,
                         max_host_bytes=max_host_bytes, prefix_block=prefix_block)

    # --- the client side (rank 0) --------------------------------------------------------------------------
    def _enqueue(self, handle: RequestHandle) -> None:
        """`add_request` on rank 0: the validated request waits for the next turn boundary (every rank queues it
        then). A sampling request without a seed gets one here, so every rank samples the same tokens."""
        if not self.group.is_driver:
            raise RuntimeError(f"Rank {self.group.rank} does not take requests: send them to rank 0's server.")
        options = handle.options
        if options.temperature >= GREEDY_BELOW and options.seed is None:
            handle.options = dataclasses.replace(options, seed=secrets.randbits(63))
        with self._cond:
            if self._stopping or self._stop_asked:
                raise RuntimeError("The scheduler was stopped; start a new one.")
            self._inbox.append(("add", handle))
            self._cond.notify_all()
        self._wake.set()

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request (rank 0): at the next turn boundary, every rank cancels it (a queued one leaves the
        queue, a running one stops after that turn's step)."""
        if not self.group.is_driver:
            raise RuntimeError(f"Rank {self.group.rank} does not cancel requests; rank 0 does.")
        with self._cond:
            self._inbox.append(("cancel", handle.id))
        self._wake.set()

    def cancel_all(self) -> None:
        """Ask the group to stop (any rank; safe from a signal handler): at the next turn boundary every rank
        refuses new requests, cancels the queued and running ones and ends its loop."""
        self._stop_asked = True
        self._wake.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """As `Scheduler.wait_idle`, counting requests that wait for the next turn boundary."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._inbox and not self._queue and not self._estimates
                                       and self._settled, timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the loop to end (after a stop or a failure); False on timeout."""
        self._loop.join(timeout)
        return not self._loop.is_alive()

    def metrics(self) -> dict[str, float]:
        """`Scheduler.metrics` of this rank (bytes are its shard's), with requests waiting for the next turn
        boundary counted as queued and `turns` (turn boundaries the ranks met at)."""
        out = super().metrics()
        with self._cond:
            out["queued_requests"] += sum(kind == "add" for kind, _ in self._inbox)
        out["turns"] = self.turns
        return out

    # --- the loop (every rank) -----------------------------------------------------------------------------
    def _run(self) -> None:
        sent: dict[int, RequestHandle] = {}  # rank 0: the requests of this exchange, by id, until applied
        try:
            while True:
                self._wake.clear()
                with self._cond:
                    items, self._inbox = self._inbox, []
                sent = {value.id: value for kind, value in items if kind == "add"}
                items = [(kind, value if kind == "cancel" else self._wire(value)) for kind, value in items]
                state = self._state()
                try:
                    got = self.group.exchange(items, self._stop_asked, digest(state))
                except GroupLost as error:
                    self._fail(f"rank {self.group.rank}: the tensor-parallel group lost a rank ({error}); stopping")
                    return
                self.turns += 1
                if got.diverged:
                    self._diverged(state)
                    return
                for kind, value in got.items:
                    self._apply(kind, value, sent)
                sent = {}
                if got.stop:
                    Scheduler.cancel_all(self)
                    return
                with self._cond:
                    self._admit()
                    busy = bool(self._estimates)
                    self._cond.notify_all()
                if busy:
                    self._turn()
                elif self.group.is_driver:
                    self._wake.wait(HEARTBEAT_S)
        except Exception as error:  # noqa: BLE001 - logged; the other ranks see this rank leave
            self._fail(f"rank {self.group.rank}: the scheduler loop failed ({type(error).__name__}: {error})")
            logger.exception("tensor-parallel scheduler loop")
        finally:
            if self.failure is not None:  # the clients learn why (a stop would finish them as cancelled)
                for handle in [r.handle for r in self._prefilling + self._ready + self.batch.rows] + list(self._queue):
                    handle.finish("error", self.failure)
            self._shut_down()
            with self._cond:
                left = list(sent.values()) + [value for kind, value in self._inbox if kind == "add"]
                self._inbox = []
            for handle in left:  # never reached the other ranks
                handle.finish("error" if self.failure else "cancelled", self.failure)
            if self.on_exit is not None:
                self.on_exit(self.failure)

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            logger.error(message)

    @staticmethod
    def _wire(handle: RequestHandle) -> tuple:
        return handle.id, handle.prompt, handle.options, handle.session

    def _apply(self, kind: str, value, sent: dict[int, RequestHandle]) -> None:
        """One of rank 0's items, applied in order on every rank (holding no lock); `sent`: rank 0's handles of
        the requests in this exchange (the others make a mirror of each)."""
        if kind == "add":
            request_id, prompt, options, session = value
            handle = sent.pop(request_id, None)
            if handle is None:
                handle = RequestHandle(prompt, options, session, _drop, id=request_id)
            self._handles[request_id] = handle
            try:
                Scheduler._enqueue(self, handle)
            except RuntimeError:  # stopping
                handle.finish("cancelled")
        elif kind == "cancel":
            handle = self._handles.get(value)
            if handle is not None:
                Scheduler.cancel(self, handle)

    def _state(self) -> list[int]:
        """This rank's scheduler state as ints (the digest's input): queue, rows with their tokens and finish
        reasons, sessions, cached prefixes, counters."""
        values = [self.turns, len(self.sessions), len(self.prefixes), self.counters["requests"],
                  self.counters["finished"], self.counters["cancelled"]]
        values += [-1] + [h.id for h in self._queue]
        for rows in (self._prefilling, self._ready, self.batch.rows):
            values.append(-2)
            for row in rows:
                handle = row.handle
                values += [handle.id, row.prefilled, len(handle.token_ids),
                           handle.token_ids[-1] if handle.token_ids else -1,
                           _REASON_CODES.get(handle.finish_reason, 0)]
        return values

    def _diverged(self, state: list[int]) -> None:
        """The ranks' states differ: find the first difference (one more collective), log it, stop."""
        try:
            every = self.group.gather(state)
        except GroupLost as error:
            self._fail(f"rank {self.group.rank}: the ranks' states differ and a rank left ({error}); stopping")
            return
        where = next((rank for rank, theirs in enumerate(every) if theirs != every[0]), None)
        detail = ""
        if where is not None:
            mine, theirs = every[0], every[where]
            index = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            detail = (f": rank {where} differs from rank 0 at state entry {index} ({theirs[index:index + 5]} vs "
                      f"{mine[index:index + 5]})")
        self._fail(f"rank {self.group.rank}: the tensor-parallel ranks' scheduler states differ after turn "
                   f"{self.turns}{detail}; a decision or a token was not the same on every rank; stopping")
