"""The request scheduler: a FIFO queue, admission by batch rows and host memory, and continuous batching.

    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 256}, max_batch=8)
    handle = scheduler.add_request(tokenizer("Hello", return_tensors="pt").input_ids[0],
                                   GenerationOptions(max_tokens=32, temperature=0))
    text = tokenizer.decode(list(handle.tokens()))
    scheduler.stop()

One thread (`dual-scheduler`) runs the model. Each turn of its loop it admits queued requests while rows and host
memory allow, feeds one prefill chunk of the oldest admitted request (on a cache of its own), regroups the running
batch when rows finished or prefilled requests wait to join (`batch.py`), and runs one decode step of every running
row. So a new request's prefill interleaves with the decode steps of the running ones, a finished row leaves at
once, and a prefilled request joins the batch at the next step, whatever its length. Each row samples and stops
on its own options. A request that names a session continues that session's cache (only its new tokens are
prefilled); when it ends the session keeps its sequence in host memory (`sessions.py`). With `prefix_block`, prompts
that start with the same whole blocks of tokens as an earlier one copy its prefilled prefix instead of prefilling
it again (`prefix.py`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Callable, Sequence

import torch
from transformers.utils import logging

from ..cache import DualDecoderCache
from ..config import DualDecoderConfig
from ..host_memory import format_bytes
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
        eos = model.generation_config.eos_token_id
        eos_ids = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        decode = None if tokenizer is None else (lambda t: tokenizer.decode(t, skip_special_tokens=True))
        self.batch = DenseBatch(model, self.pad_id, eos_ids, decode) if dense else \
            DualBatch(model, self.dual_config, self.pad_id, eos_ids, decode)
        self._cond = threading.Condition()
        self._queue: deque[RequestHandle] = deque()
        self._prefilling: list[Row] = []  # admitted, prefilling in order (the first one feeds a chunk per turn)
        self._ready: list[Row] = []  # prefilled, waiting to join the batch
        self._estimates: dict[Row, int] = {}  # host bytes planned for each admitted row
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
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be a non-empty (P,) or (1, P) integer tensor, got {tuple(ids.shape)} "
                             f"{ids.dtype}.")
        if self.max_positions is not None and ids.numel() + options.max_tokens > self.max_positions:
            raise ValueError(f"The prompt ({ids.numel()} tokens) plus max_tokens ({options.max_tokens}) exceeds the "
                             f"model's {self.max_positions} positions; shorten the prompt or lower max_tokens.")
        if session is not None and (self.dense or not isinstance(session, str) or not session):
            raise ValueError("session must be a non-empty string, and sessions need the dual cache (not --dense).")
        if session is not None and options.prompt_logprobs is not None:
            raise ValueError("A session request cannot return its prompt's logprobs (echo): the session's stored "
                             "tokens are not prefilled again.")
        handle = RequestHandle(ids.to(torch.long).cpu(), options, session, on_event)
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
            self._work()
        finally:
            caches = [row.cache for row in self._prefilling + self._ready if row.cache is not None]
            gauges = self.batch.memory(caches)
            gauges["host_bytes"] += self.prefixes.host_bytes
            gauges.update(cached_prefixes=len(self.prefixes), spec_hits=self.batch.spec_hits,
                          spec_steps=self.batch.spec_steps)
            with self._cond:
                self._gauges, self._settled = gauges, True
                self._cond.notify_all()

    def _work(self) -> None:
        for row in [r for r in self._prefilling + self._ready if r.handle.cancel_requested]:
            kept = None
            if row in self._prefilling:  # its prefill stops midway: a session starts over
                self._prefilling.remove(row)
            else:  # prefilled: a session keeps its prompt
                self._ready.remove(row)
                kept, row.cache = (row.cache, None) if row.session is not None else (None, row.cache)
            self._retire(row, kept)
        for row in self.batch.rows:
            if row.handle.cancel_requested:
                row.handle.finish("cancelled")  # leaves at this turn's regroup
        if self._prefilling:
            row = self._prefilling[0]
            try:
                if self.prefix_block and row.cache is None and row.prefilled == 0 and not row.wants_prompt_logits:
                    # its prefill starts now (a request asking for its prompt's logprobs prefills it all), after
                    # the requests before it added their prefixes: copy the longest one its prompt starts with
                    with self._cond:
                        others = [h.prompt for h in self._queue] + [r.handle.prompt for r in self._prefilling[1:]]
                    hit = self.prefixes.start(row, others)
                    with self._cond:
                        self.counters["prefix_hit_tokens"] += hit
                status = self.batch.prefill_chunk(row)
                if status == "prefix":
                    self.prefixes.add(row.handle.prompt[:row.prefilled], row.cache)
                elif status == "done":
                    self._prefilling.pop(0)
                    self._prefilled(row)
            except Exception as error:  # noqa: BLE001 - reported to this request's client
                self._prefilling.pop(0)
                row.handle.finish("error", f"{type(error).__name__}: {error}")
                self._retire(row, None)
        rows = self.batch.rows
        live = sum(not r.done for r in rows)
        # prefilled requests join together (one regroup) once no other request is prefilling, or two are ready
        joining = list(self._ready) if not self._prefilling or not live or len(self._ready) >= 2 else []
        finished = [r for r in rows if r.done]
        # a regroup copies the rows' host K/V: rows that finished leave when others join, when they are half the
        # batch, or at once when a session keeps the sequence (a finished row is fed pad tokens until it leaves)
        if joining or (finished and (2 * len(finished) >= len(rows) or any(r.session for r in finished))):
            self._ready = [r for r in self._ready if r not in joining]
            try:
                left, failed = self.batch.regroup(joining)
            except Exception as error:  # noqa: BLE001 - even the rows that regroup alone failed together
                message = f"{type(error).__name__}: {error}"
                for row in rows + joining:
                    row.handle.finish("error", message)
                    self._retire(row, None)
                self.batch.close()
                return
            self.counters["regroups"] += 1
            for row, cache in left:
                self._retire(row, cache)
            for row, message in failed:  # rows the regroup could not carry: their requests fail alone
                row.handle.finish("error", message)
                self._retire(row, None)
        if any(not r.done for r in self.batch.rows):
            try:
                probe = self.step_probe
                with contextlib.nullcontext() if probe is None else probe.step(self.batch.cache):
                    self.batch.step()
            except Exception as error:  # noqa: BLE001 - the batch is lost: every row of it fails
                message = f"{type(error).__name__}: {error}"
                for row in self.batch.rows:
                    row.handle.finish("error", message)
                    self._retire(row, None)
                self.batch.close()
                return
            self.counters["decode_steps"] += 1

    def _prefilled(self, row: Row) -> None:
        """A row's prompt is stored and its first token out: it waits to join the batch, or ends here."""
        handle = row.handle
        handle.prefilled_tokens = row.prefilled - row.stored
        with self._cond:
            self.counters["prefilled_tokens"] += handle.prefilled_tokens
        if handle.done:  # its first token ended it (max_tokens 1, an end-of-sequence token, a stop string)
            cache, row.cache = row.cache, None
            self._retire(row, cache if isinstance(cache, DualDecoderCache) else None)
        else:
            self._ready.append(row)

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

    # --- admission -----------------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Move queued requests (FIFO; a session's waits while its previous request runs) to the prefilling list
        while rows and host memory allow; called holding the lock."""
        for handle in list(self._queue):
            if sum(not row.done for row in self._estimates) >= self.max_batch:  # finished rows leave when it joins
                return
            session = None
            if handle.session is not None:
                session = self.sessions.acquire(handle.session)
                if session is None:
                    continue  # its previous request still runs
            row = None
            try:  # nothing about one request may stop the loop: it fails alone
                row = Row(handle, session, coupled=self.dual_config is None or self.dual_config.coupled_sampling)
                if session is not None and session.cache is not None:
                    self._continue_session(row)
                needed = self._host_bytes(row)
            except Exception as error:  # noqa: BLE001 - reported to this request's client
                self._queue.remove(handle)
                handle.finish("error", f"{type(error).__name__}: {error}")
                self.counters["finished"] += 1
                if session is not None:  # the session keeps what it stored
                    self.sessions.release(session, row.cache if row is not None and row.cache else session.cache)
                continue
            if self.max_host_bytes is not None:
                held = sum(self._estimates.values()) + self.sessions.totals()["host_bytes"] + self.prefixes.host_bytes
                if held + needed > self.max_host_bytes:  # idle sessions and cached prefixes make room first
                    held -= self.prefixes.make_room(held + needed - self.max_host_bytes)
                if held + needed > self.max_host_bytes:
                    held -= self.sessions.make_room(held + needed - self.max_host_bytes)
                if held + needed > self.max_host_bytes:
                    if session is not None:
                        self.sessions.release(session, row.cache)
                    elif row.cache is not None:
                        row.cache.close()
                    if not self._estimates:  # it can never fit
                        self._queue.remove(handle)
                        handle.finish("error", f"The request needs {format_bytes(needed)} of host memory; the server "
                                               f"allows {format_bytes(self.max_host_bytes)} (--max-host-bytes).")
                        self.counters["finished"] += 1
                        continue
                    return
            self._queue.remove(handle)
            self._estimates[row] = needed
            self._prefilling.append(row)

    def _continue_session(self, row: Row) -> None:
        """A session request continues its session's cache when its prompt extends the stored tokens; otherwise the
        session starts over (its cache is closed)."""
        cache, prompt = row.session.cache, row.handle.prompt
        stored, held = cache.get_seq_length(), cache.token_ids
        if held is not None and prompt.numel() > stored and torch.equal(held[0, :stored], prompt[:stored]):
            row.cache, row.session.cache = cache, None
            self.counters["session_resumes"] += 1
        else:
            cache.close()
            row.session.cache = None

    def _host_bytes(self, row: Row) -> int:
        """Host bytes the row's cache will hold (its prompt + max_tokens + 1), not counting a session's stored
        tokens (already counted as the session's); 0 for dense rows."""
        if self.dense:
            return 0
        prompt, options = row.prompt_len, row.handle.options
        cache = row.cache or self._probe
        stored = cache.get_seq_length()
        tokens = prompt + options.max_tokens + 1
        if stored:
            return cache.host_bytes_needed(1, tokens - stored, self.model.dtype, prompt_tokens=prompt - stored)
        return cache.host_bytes_needed(1, tokens, self.model.dtype, prompt_tokens=prompt)

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
