"""The request scheduler: a FIFO queue, admission by batch rows and host memory, and continuous batching.

    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 256}, max_batch=8)
    handle = scheduler.add_request(tokenizer("Hello", return_tensors="pt").input_ids[0],
                                   GenerationOptions(max_tokens=32, temperature=0))
    text = tokenizer.decode(list(handle.tokens()))
    scheduler.stop()

One thread (`dual-scheduler`) runs the model. Each turn of its loop it admits queued requests while rows and host
memory allow (`admission.py`), then decides the turn (`plan_turn`, `turn_plan.py`) and carries it out (`run_turn`):
one prefill chunk of the oldest admitted request (on a cache of its own), a regroup of the running batch when rows
finished or prefilled requests wait to join (`batch.py`), and one decode step of every running row. So a new
request's prefill interleaves with the decode steps of the running ones, a finished row leaves at once, and a
prefilled request joins the batch at the next step, whatever its length. Each row samples and stops on its own
options. A request that names a session continues that session's cache (only its new tokens are prefilled); when it
ends the session keeps its sequence in host memory (`sessions.py`). With `prefix_block`, prompts that start with
the same whole blocks of tokens as an earlier one copy its prefilled prefix instead of prefilling it again
(`prefix.py`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Callable, Sequence

import torch
from transformers.utils import logging

from ..cache.cache import DualDecoderCache
from ..config import DualDecoderConfig
from . import turn_plan
from .admission import Admission, check_request
from .batch import DualBatch
from .dense_batch import DenseBatch
from .openmp_pool import release_openmp_pool
from .prefix import PrefixCache
from .requests import GenerationOptions, RequestHandle
from .rows import Row
from .sessions import SessionStore

logger = logging.get_logger(__name__)
RATE_WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


class Scheduler:
    """Serve many requests at once on one model (see the module docstring).

    Args:
        model: a transformers causal LM; tokenizer: its tokenizer (stop strings, padding id), or None.
        cache_config: `DualDecoderConfig` or its dict for every request's `DualDecoderCache`; ignored when `dense`.
        dense: serve with transformers' default `DynamicCache` rows instead (the benchmark's dense rows; no
            sessions, no prefix cache).
        max_batch: requests admitted at once (decoding or prefilling).
        max_host_bytes: host bytes the admitted requests, idle sessions and cached prefixes may hold in all (None:
            each cache checks the memory available when its request begins). Idle sessions and cached prefixes are
            evicted least recently used past it.
        prefix_block: tokens per block of the prefix cache: a prompt that starts with whole blocks an earlier prompt
            started with copies that prefix's stored K/V instead of prefilling it; 0 (the default) turns it off.
        step_probe: an object whose `step(cache)` returns a context manager the loop thread enters around each
            decode step of the running batch (not its prefill chunks or regroups), given the batch's cache (a
            `DualDecoderCache`, or a `DynamicCache` for dense rows); e.g. the serving benchmark's per-step
            synchronization points and blocked time (`eval/throughput/launch_thread.py`). None (the default): none.

    Creating a scheduler frees the calling thread's idle OpenMP worker threads (`openmp_pool.py`): with them alive,
    torch runs several times slower per small operator on the loop thread of a CPU-only host. Create it on the
    thread that ran torch (usually the main thread, which loaded the model) and leave the model's CPU work to the
    scheduler while it serves; a scheduler for a CPU model created on another thread logs a warning, since the
    pool of a thread that ran parallel torch operators can be freed only by that thread.

    Raises:
        ValueError: for a bad option (before any thread starts).
    """

    def __init__(self, model, tokenizer=None, cache_config: DualDecoderConfig | dict | None = None,
                 dense: bool = False, max_batch: int = 8, max_host_bytes: int | None = None,
                 prefix_block: int = 0, step_probe=None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}.")
        if isinstance(prefix_block, bool) or not isinstance(prefix_block, int) or prefix_block < 0:
            raise ValueError(f"prefix_block must be an integer >= 0 (0: no prefix cache), got {prefix_block!r}.")
        if max_host_bytes is not None and max_host_bytes < 1:
            raise ValueError(f"max_host_bytes must be >= 1 or None, got {max_host_bytes!r}.")
        self.model, self.tokenizer, self.dense = model, tokenizer, dense
        self.dual_config = None if dense else (
            cache_config if isinstance(cache_config, DualDecoderConfig)
            else DualDecoderConfig.from_dict(cache_config or {}))
        self.max_batch, self.max_host_bytes, self.step_probe = max_batch, max_host_bytes, step_probe
        self.prefix_block = 0 if dense else prefix_block
        self.max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.sessions = SessionStore(max_host_bytes)
        self.prefixes = PrefixCache(self.prefix_block)
        self.pad_id = self._pad_id()
        self._probe = None if dense else DualDecoderCache(model.config, dual_config=self.dual_config)  # for estimates
        if self._probe is not None:
            self._probe.check_model(model)  # estimates for the KV heads this rank holds (tensor parallelism)
        self.admission = Admission(self._probe, model.dtype, max_batch, max_host_bytes, self.sessions, self.prefixes,
                                   self.dual_config)
        eos = model.generation_config.eos_token_id
        eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        decode = None if tokenizer is None else (lambda t: tokenizer.decode(t, skip_special_tokens=True))
        self.batch = DenseBatch(model, self.pad_id, eos_ids, decode) if dense else \
            DualBatch(model, self.dual_config, self.pad_id, eos_ids, decode)
        self._cond = threading.Condition()
        self._queue: deque[RequestHandle] = deque()
        self._prefilling: list[Row] = []  # admitted, prefilling in order (the first one feeds a chunk per turn)
        self._ready: list[Row] = []  # prefilled, waiting to join the batch
        self._estimates = self.admission.estimates  # host bytes planned for each admitted row (the same dict)
        self._stopping = False
        self._settled = True  # the loop is between turns (the gauges describe what it holds)
        self._gauges = {"device_bytes": 0, "host_bytes": 0, "cached_prefixes": 0, "spec_hits": 0, "spec_steps": 0}
        self._recent: deque[tuple[float, int]] = deque()
        self.counters = {"requests": 0, "finished": 0, "output_tokens": 0, "prefilled_tokens": 0,
                         "decode_steps": 0, "regroups": 0, "session_resumes": 0, "cancelled": 0,
                         "prefix_hit_tokens": 0}
        self.started = time.perf_counter()
        self.started_at = int(time.time())  # wall clock, for OpenAI's `created`
        release_openmp_pool()  # the caller's idle OpenMP threads would slow the loop thread's torch (openmp_pool.py)
        if threading.current_thread() is not threading.main_thread() and \
                next(model.parameters()).device.type == "cpu":
            logger.warning("A Scheduler for a CPU model was created on a thread other than the main thread: if the "
                           "main thread ran torch's parallel operators (loading the model does), its idle OpenMP "
                           "threads slow the scheduler's decode steps (docs/serving.md, 'The loop thread and "
                           "OpenMP'). Create the Scheduler on the main thread.")
        self._loop = threading.Thread(target=self._run, name="dual-scheduler", daemon=True)
        self._loop.start()

    def _pad_id(self) -> int:
        for candidate in (getattr(self.tokenizer, "pad_token_id", None), self.model.generation_config.pad_token_id,
                          self.model.generation_config.eos_token_id):
            if isinstance(candidate, (list, tuple)):
                candidate = candidate[0] if candidate else None
            if candidate is not None:
                return int(candidate)
        return 0

    # --- the client side -----------------------------------------------------------------------------------
    def add_request(self, input_ids: torch.Tensor | Sequence[int], options: GenerationOptions | None = None,
                    session: str | None = None, on_event: Callable[[tuple], None] | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once (tokens stream through it).

        Args:
            input_ids: `(P,)` or `(1, P)` int token ids of the prompt (for a session: the whole conversation so
                far, whose stored prefix is not prefilled again).
            options: generation options (default `GenerationOptions()`); session: a session name or None.
            on_event: called with each event instead of queueing it (`RequestHandle`).

        Raises:
            ValueError: empty or non-integer ids, a prompt + max_tokens past the model's positions, a session on
                the dense server or asking for its prompt's logprobs. RuntimeError: the scheduler was stopped.
        """
        options = options or GenerationOptions()
        ids = check_request(input_ids, options, session, self.max_positions, self.dense)
        handle = RequestHandle(ids, options, session, on_event)
        self._enqueue(handle)
        return handle

    def _enqueue(self, handle: RequestHandle) -> None:
        """Append a validated request to the queue (the tensor-parallel scheduler calls it at a turn boundary).

        Raises:
            RuntimeError: the scheduler was stopped.
        """
        with self._cond:
            if self._stopping:
                raise RuntimeError("The scheduler was stopped; start a new one.")
            self._queue.append(handle)
            self.counters["requests"] += 1
            self._cond.notify_all()

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request: a queued one leaves the queue, a running one stops after its current step."""
        with self._cond:
            if handle in self._queue:
                self._queue.remove(handle)
                handle.finish("cancelled")
                self.counters["cancelled"] += 1
                self.counters["finished"] += 1
                return
            handle.cancel_requested = True
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running (every cache released to its session or closed); False on
        timeout. A request's handle is done before its row leaves the batch, so use this before reading idle
        sessions."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._estimates and self._settled, timeout)

    def stop(self, timeout: float | None = 60.0) -> None:
        """Cancel every queued and running request, wait for the loop thread to end, close every cache
        (idempotent)."""
        self.cancel_all()
        self._loop.join(timeout)
        self.sessions.close()
        self.prefixes.close()

    def cancel_all(self) -> None:
        """Refuse new requests, finish the queued ones as cancelled and make the running ones stop after their
        current step; returns at once (safe from a signal handler). `stop()` then waits and closes."""
        with self._cond:
            self._stopping = True
            queued, self._queue = list(self._queue), deque()
            for row in self._estimates:
                row.handle.cancel_requested = True
            self._cond.notify_all()
        for handle in queued:
            handle.finish("cancelled")
        with self._cond:
            self.counters["cancelled"] += len(queued)
            self.counters["finished"] += len(queued)

    # --- the loop ------------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._admit()
                    while not self._stopping and not self._estimates:
                        self._cond.wait()
                        self._admit()
                    if self._stopping:
                        return
                self._turn()
        finally:
            self._shut_down()

    def _turn(self) -> None:
        """One prefill chunk, a regroup when rows finished or wait to join, one decode step; then the gauges."""
        with self._cond:
            self._settled = False
        try:
            self.run_turn(self.plan_turn())
        finally:
            caches = [row.cache for row in self._prefilling + self._ready if row.cache is not None]
            gauges = self.batch.memory(caches)
            gauges["host_bytes"] += self.prefixes.host_bytes
            gauges.update(cached_prefixes=len(self.prefixes), spec_hits=self.batch.spec_hits,
                          spec_steps=self.batch.spec_steps)
            with self._cond:
                self._gauges, self._settled = gauges, True
                self._cond.notify_all()

    def plan_turn(self) -> turn_plan.TurnPlan:
        """This turn's decisions from the scheduler's lists of rows (`turn_plan.plan_turn`); on the loop thread."""
        return turn_plan.plan_turn(self._prefilling, self._ready, self.batch.rows, self.prefix_block)

    def run_turn(self, plan: turn_plan.TurnPlan) -> None:
        """Carry out `plan` on the loop thread: the cancelled rows leave, one prefill chunk, the regroup, one decode
        step. A failed prefill fails its request alone; a failed regroup or decode step fails the batch's."""
        for row in plan.dropped:
            kept = None
            if row in self._prefilling:  # its prefill stops midway: a session starts over
                self._prefilling.remove(row)
            else:  # prefilled: a session keeps its prompt
                self._ready.remove(row)
                kept, row.cache = (row.cache, None) if row.session is not None else (None, row.cache)
            self._retire(row, kept)
        for row in plan.cancelled:
            row.handle.finish("cancelled")  # leaves at a regroup
        batch = plan.batch
        if plan.prefill is not None and self._prefill_chunk(plan.prefill, plan.copy_prefix):
            batch = turn_plan.plan_batch(self.batch.rows, self._ready, self._prefilling)
        if batch.regroup and not self._regroup(batch.joining):
            return
        if batch.decode and any(not r.done for r in self.batch.rows):
            try:
                with contextlib.nullcontext() if self.step_probe is None else self.step_probe.step(self.batch.cache):
                    self.batch.step()
            except Exception as error:  # noqa: BLE001 - the batch is lost: every row of it fails
                self._fail_batch(self.batch.rows, error)
                return
            self.counters["decode_steps"] += 1

    def _prefill_chunk(self, row: Row, copy_prefix: bool) -> bool:
        """Feed the oldest prefilling row one chunk (first copying its cached prefix when `copy_prefix`); True
        when it left the prefilling list: its prompt is prefilled (it waits to join the batch, or its first token
        ended it) or its request failed."""
        try:
            if copy_prefix:  # after the requests before it added their prefixes
                with self._cond:
                    others = [h.prompt for h in self._queue] + [r.handle.prompt for r in self._prefilling[1:]]
                hit = self.prefixes.start(row, others)
                with self._cond:
                    self.counters["prefix_hit_tokens"] += hit
            status = self.batch.prefill_chunk(row)
            if status == "prefix":
                self.prefixes.add(row.handle.prompt[:row.prefilled], row.cache)
            if status != "done":
                return False
            self._prefilling.pop(0)  # its prompt is stored and its first token out
            row.handle.prefilled_tokens = row.prefilled - row.stored
            with self._cond:
                self.counters["prefilled_tokens"] += row.handle.prefilled_tokens
            if row.handle.done:  # its first token ended it (max_tokens 1, an end-of-sequence token, a stop string)
                cache, row.cache = row.cache, None
                self._retire(row, cache if isinstance(cache, DualDecoderCache) else None)
            else:  # it waits to join the batch
                self._ready.append(row)
        except Exception as error:  # noqa: BLE001 - reported to this request's client
            self._prefilling.pop(0)
            row.handle.finish("error", f"{type(error).__name__}: {error}")
            self._retire(row, None)
        return True

    def _regroup(self, joining: tuple[Row, ...]) -> bool:
        """Rebuild the batch: finished rows leave, `joining` rows join (`batch.regroup`); False when the batch is
        lost (every row of it and every joining row failed)."""
        self._ready = [r for r in self._ready if r not in joining]
        rows = self.batch.rows
        try:
            left, failed = self.batch.regroup(list(joining))
        except Exception as error:  # noqa: BLE001 - even the rows that regroup alone failed together
            self._fail_batch(rows + list(joining), error)
            return False
        self.counters["regroups"] += 1
        for row, cache in left:
            self._retire(row, cache)
        for row, message in failed:  # rows the regroup could not carry: their requests fail alone
            row.handle.finish("error", message)
            self._retire(row, None)
        return True

    def _fail_batch(self, rows: list[Row], error: Exception) -> None:
        """The batch is lost: `rows` fail with `error`, and the batch is closed."""
        message = f"{type(error).__name__}: {error}"
        for row in rows:
            row.handle.finish("error", message)
            self._retire(row, None)
        self.batch.close()

    def _admit(self) -> None:
        """Admit queued requests to the prefilling list (`Admission.admit`); called holding the lock."""
        self.admission.admit(self._queue, self._prefilling, self.counters)

    def _retire(self, row: Row, cache: DualDecoderCache | None) -> None:
        """A row is out of the scheduler: its session keeps `cache` (or starts over without one), its own cache
        (an unfinished prefill) is closed, its counts are added."""
        handle = row.handle
        if not handle.done:
            handle.finish("cancelled" if handle.cancel_requested else "length")
        if isinstance(row.cache, DualDecoderCache):
            row.cache.close()
        row.cache = None
        if row.session is not None:
            self.sessions.release(row.session, cache)
        elif cache is not None:
            cache.close()
        now = time.perf_counter()
        with self._cond:
            self._estimates.pop(row, None)
            self.counters["finished"] += 1
            self.counters["cancelled"] += handle.finish_reason == "cancelled"
            self.counters["output_tokens"] += len(handle.token_ids)
            self._recent.append((now, len(handle.token_ids)))
            self._cond.notify_all()

    def _shut_down(self) -> None:
        """On the loop thread's exit: cancel and release everything it holds."""
        rows = self._prefilling + self._ready + self.batch.rows
        self._prefilling, self._ready = [], []
        self.batch.close()
        for row in rows:
            row.handle.cancel_requested = True
            self._retire(row, None)
        with self._cond:
            self._stopping = True
            for handle in self._queue:
                handle.finish("cancelled")
            self.counters["cancelled"] += len(self._queue)
            self.counters["finished"] += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()

    # --- accounting ----------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and gauges: running / queued requests, output tokens and tokens/s (last `RATE_WINDOW_S`
        seconds, counted when a request ends), device and host bytes of running requests, idle sessions and cached
        prefixes, speculation hit rate, sessions, evictions."""
        now = time.perf_counter()
        with self._cond:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            window = min(RATE_WINDOW_S, now - self.started)
            out = dict(self.counters)
            out.update(running_requests=sum(not row.done for row in self._estimates),
                       queued_requests=len(self._queue),
                       tokens_per_second=sum(n for _, n in self._recent) / window if window > 0 else 0.0)
            gauges = dict(self._gauges)
        sessions = self.sessions.totals()
        out["spec_hits"], out["spec_steps"] = gauges["spec_hits"], gauges["spec_steps"]
        out.update(device_bytes=gauges["device_bytes"] + sessions["device_bytes"],
                   host_bytes=gauges["host_bytes"] + sessions["host_bytes"],
                   sessions=sessions["sessions"], idle_sessions=sessions["idle_sessions"],
                   evicted_sessions=self.sessions.evicted, cached_prefixes=gauges["cached_prefixes"],
                   spec_hit_rate=out["spec_hits"] / out["spec_steps"] if out["spec_steps"] else float("nan"))
        return out
