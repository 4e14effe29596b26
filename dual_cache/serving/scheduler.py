"""The request scheduler: a FIFO queue, admission by batch rows and host memory, cohorts that take turns.

    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 256}, max_batch=8)
    handle = scheduler.add_request(tokenizer("Hello", return_tensors="pt").input_ids[0],
                                   GenerationOptions(max_tokens=32, temperature=0))
    text = tokenizer.decode(list(handle.tokens()))
    scheduler.stop()

A dispatcher thread admits queued requests whenever rows are free: the oldest admissible request and the queued
requests that can share its batch (same sampling settings, no session) form a `Cohort`, up to `max_batch` rows in
all. Cohorts take turns on the model one prefill chunk or decode step at a time (`cohort.py`). A request that names a
session runs alone on that session's cache, which then idles in host memory until the session's next request
(`sessions.py`). Tokens stream through each request's `RequestHandle`. With `prefix_block`, when every request of a
new dual cohort starts with the same whole blocks of `prefix_block` tokens (`prefix.py`: chained block hashes), that
prefix is prefilled and stored once, and the cohort's batch continues it (`DualDecoderCache` sharing one stored
sequence).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch
from transformers import StoppingCriteriaList

from ..cache import DualDecoderCache
from ..config import DualDecoderConfig
from ..decoding import cache_kwarg_name
from ..host_memory import format_bytes
from ..layer_types import SLIDING_ATTENTION, resolve_layer_types
from ..selectors import SELECTORS
from .cohort import Cohort, CohortStreamer, PrefixStreamer, RowStops, Turnstile
from .prefix import shared_prefix_length
from .requests import GenerationOptions, RequestHandle
from .sessions import Session, SessionStore

RATE_WINDOW_S = 10.0  # tokens/s is measured over this many recent seconds


class Scheduler:
    """Serve many requests at once on one model (see the module docstring).

    Args:
        model: a transformers causal LM; tokenizer: its tokenizer (stop strings, padding id), or None.
        cache_config: `DualDecoderConfig` or its dict for every request's `DualDecoderCache`; ignored when `dense`.
        dense: serve with transformers' default `DynamicCache` instead (the benchmark's dense rows; no sessions).
        max_batch: batch rows decoding at once, all cohorts together.
        max_host_bytes: host bytes the running requests and idle sessions may hold in all (None: each cache checks
            the memory available when its request begins). Idle sessions are evicted least recently used past it.
        prefix_block: tokens per block when looking for a prefix shared by every request of a new cohort (stored
            once when at least one whole block is shared); 0 (the default) turns the search off. Admission still
            counts host bytes as if nothing were shared (an upper bound). At full budget each request's tokens
            equal its solo run; at a partial budget they may not: the padding between the prefix and a shorter
            request's own tokens counts as positions of its local window (docs/serving.md).

    Raises:
        ValueError: for a bad option (before any thread starts).
    """

    def __init__(self, model, tokenizer=None, cache_config: DualDecoderConfig | dict | None = None,
                 dense: bool = False, max_batch: int = 8, max_host_bytes: int | None = None,
                 prefix_block: int = 0) -> None:
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}.")
        if isinstance(prefix_block, bool) or not isinstance(prefix_block, int) or prefix_block < 0:
            raise ValueError(f"prefix_block must be an integer >= 0 (0: no shared-prefix search), got "
                             f"{prefix_block!r}.")
        if max_host_bytes is not None and max_host_bytes < 1:
            raise ValueError(f"max_host_bytes must be >= 1 or None, got {max_host_bytes!r}.")
        self.model, self.tokenizer, self.dense = model, tokenizer, dense
        self.dual_config = None if dense else (
            cache_config if isinstance(cache_config, DualDecoderConfig)
            else DualDecoderConfig.from_dict(cache_config or {}))
        self.max_batch, self.max_host_bytes, self.prefix_block = max_batch, max_host_bytes, prefix_block
        self.max_positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.sessions = SessionStore(max_host_bytes)
        self.turnstile = Turnstile()
        self.pad_id = self._pad_id()
        eos = model.generation_config.eos_token_id
        self.eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        self._cond = threading.Condition()
        self._queue: deque[RequestHandle] = deque()
        self._running: dict[Cohort, int] = {}  # cohort -> its host-byte estimate
        self._caches: dict[Cohort, DualDecoderCache] = {}
        self._stopping = False
        self._recent: deque[tuple[float, int]] = deque()
        self.counters = {"requests": 0, "finished": 0, "output_tokens": 0, "prefilled_tokens": 0, "spec_hits": 0,
                         "spec_steps": 0, "cohorts": 0, "session_resumes": 0, "cancelled": 0,
                         "shared_prefix_tokens": 0}
        self.started = time.perf_counter()
        self.started_at = int(time.time())  # wall clock, for OpenAI's `created`
        self._dispatcher = threading.Thread(target=self._dispatch, name="dual-scheduler", daemon=True)
        self._dispatcher.start()

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
                the dense server. RuntimeError: the scheduler was stopped.
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
        handle = RequestHandle(ids.to(torch.long).cpu(), options, session, on_event)
        with self._cond:
            if self._stopping:
                raise RuntimeError("The scheduler was stopped; start a new one.")
            self._queue.append(handle)
            self.counters["requests"] += 1
            self._cond.notify_all()
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request: a queued one leaves the queue, a running one stops after its current step."""
        with self._cond:
            if handle in self._queue:
                self._queue.remove(handle)
                handle.finish("cancelled")
                self.counters["cancelled"] += 1
                return
        handle.cancel_requested = True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running (every cache released to its session or closed); False on
        timeout. A request's handle is done before its batch ends, so use this before reading idle sessions."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout)

    def stop(self, timeout: float | None = 60.0) -> None:
        """Cancel every queued and running request, wait for the threads to end, close every cache (idempotent)."""
        with self._cond:
            self._stopping = True
            queued, self._queue = list(self._queue), deque()
            for cohort in self._running:
                for handle in cohort.handles:
                    handle.cancel_requested = True
            self._cond.notify_all()
        for handle in queued:
            handle.finish("cancelled")
        self.counters["cancelled"] += len(queued)
        self._dispatcher.join(timeout)
        for cohort in list(self._running):
            cohort.thread.join(timeout)
        self.sessions.close()

    # --- admission -----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and self._admit() is None:
                    self._cond.wait()
                if self._stopping:
                    return

    def _admit(self) -> Cohort | None:
        """Form and start one cohort from the queue if rows (and host memory) allow; called holding the lock."""
        rows = sum(len(c.handles) for c in self._running)
        if rows >= self.max_batch or not self._queue or any(not c.started for c in self._running):
            return None  # (a cohort waiting for its first turn takes in what arrives meanwhile: `_join`)
        for head in list(self._queue):
            session = None
            if head.session is not None:
                session = self.sessions.acquire(head.session)
                if session is None:
                    continue  # its previous request still runs
                members = [head]
            else:
                members = [head] + [h for h in self._queue if h is not head and h.session is None and
                                    h.options.sampling_key == head.options.sampling_key][:self.max_batch - rows - 1]
            cache = None if self.dense else self._cache_for(members, session)
            needed = 0 if cache is None else self._host_bytes(cache, members)
            if self.max_host_bytes is not None:
                held = sum(self._running.values()) + self.sessions.totals()["host_bytes"]
                if held + needed > self.max_host_bytes:  # idle sessions make room first
                    held -= self.sessions.make_room(held + needed - self.max_host_bytes)
                if held + needed > self.max_host_bytes:
                    if session is not None:
                        self.sessions.release(session, session.cache)
                    if cache is not None and (session is None or cache is not session.cache):
                        cache.close()
                    if not self._running:  # it can never fit
                        self._queue.remove(head)
                        head.finish("error", f"The request needs {format_bytes(needed)} of host memory; the server "
                                             f"allows {format_bytes(self.max_host_bytes)} (--max-host-bytes).")
                    return None
            for member in members:
                self._queue.remove(member)
            cohort = Cohort(members, lambda c, s=session: self._run(c, s), self.turnstile, self._cohort_exit,
                            on_start=self._join)
            self._running[cohort] = needed
            if cache is not None:
                self._caches[cohort] = cache
            self.counters["cohorts"] += 1
            cohort.start()
            return cohort
        return None

    def _join(self, cohort: Cohort) -> None:
        """At a cohort's first turn: the queued requests that can share its batch join it (rows and host memory
        allowing), so requests arriving during another cohort's step are batched together."""
        with self._cond:
            head = cohort.handles[0]
            rows = sum(len(c.handles) for c in self._running)
            joining = [] if head.session is not None else [  # a session's request runs alone on its cache
                h for h in self._queue if h.session is None and
                h.options.sampling_key == head.options.sampling_key][:max(0, self.max_batch - rows)]
            if joining and self.max_host_bytes is not None:
                cache = self._caches[cohort]
                needed = self._host_bytes(cache, cohort.handles + joining)
                held = sum(v for c, v in self._running.items() if c is not cohort)
                if held + self.sessions.totals()["host_bytes"] + needed > self.max_host_bytes:
                    joining = []
                else:
                    self._running[cohort] = needed
            for handle in joining:
                self._queue.remove(handle)
            cohort.handles.extend(joining)
            cohort.started = True
            self._cond.notify_all()

    def _cache_for(self, members: list[RequestHandle], session: Session | None) -> DualDecoderCache:
        if session is not None and session.cache is not None:
            cache, prompt = session.cache, members[0].prompt
            stored = cache.get_seq_length()
            held = cache.token_ids
            if held is not None and prompt.numel() > stored and torch.equal(held[0, :stored], prompt[:stored]):
                return cache
            cache.close()  # the conversation changed before the stored end: start it over
            session.cache = None
        return DualDecoderCache(self.model.config, dual_config=self.dual_config)

    def _host_bytes(self, cache: DualDecoderCache, members: list[RequestHandle]) -> int:
        prompt = max(h.prompt.numel() for h in members)
        tokens = prompt + max(h.options.max_tokens for h in members) + 1
        stored = cache.get_seq_length()
        if stored:
            return cache.host_bytes_needed(1, tokens - stored, self.model.dtype, prompt_tokens=prompt - stored)
        return cache.host_bytes_needed(len(members), tokens, self.model.dtype, prompt_tokens=prompt)

    # --- one cohort (on its own thread, holding the turn) ----------------------------------------------------
    def _run(self, cohort: Cohort, session: Session | None) -> None:
        handles = cohort.handles
        cache = self._caches.get(cohort)
        keep = False
        try:
            stored = 0 if cache is None else cache.get_seq_length()
            shared = 0
            sharing = cache is not None and not stored and SELECTORS[self.dual_config.selector].shares_prefix
            if sharing and self.prefix_block:
                shared = shared_prefix_length([h.prompt for h in handles], self.prefix_block)
                shared = shared if shared >= self.dual_config.n_sink else 0  # the sink lies in the prefix
                own = [h.prompt.numel() - shared for h in handles]
                total = shared + max(own) + max(h.options.max_tokens for h in handles) + 1
                if max(own) != min(own) and SLIDING_ATTENTION in resolve_layer_types(cache.text_config, total):
                    shared = 0  # a sliding window counts the pads after the prefix: a row would see fewer tokens
            width = shared + max(h.prompt.numel() - shared for h in handles)
            ids = torch.full((len(handles), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros(len(handles), width, dtype=torch.long)
            for row, handle in enumerate(handles):  # [shared prefix | left-padded rest of each prompt]
                own = handle.prompt.numel() - shared
                ids[row, :shared], mask[row, :shared] = handle.prompt[:shared], 1
                ids[row, width - own:], mask[row, width - own:] = handle.prompt[shared:], 1
            if stored:
                self.counters["session_resumes"] += 1
            for handle in handles:
                handle.prefilled_tokens = handle.prompt.numel() - stored - shared
                self.counters["prefilled_tokens"] += handle.prefilled_tokens
            if shared:
                self.counters["prefilled_tokens"] += shared
                self.counters["shared_prefix_tokens"] += shared
            options = handles[0].options
            decode = None if self.tokenizer is None else (lambda t: self.tokenizer.decode(t, skip_special_tokens=True))
            kwargs: dict[str, Any] = dict(
                attention_mask=mask, max_new_tokens=max(h.options.max_tokens for h in handles),
                streamer=CohortStreamer(cohort), pad_token_id=self.pad_id, return_dict_in_generate=True,
                stopping_criteria=StoppingCriteriaList([RowStops(handles, width, decode, self.eos_ids)]),
            )
            if options.temperature == 0:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            else:
                kwargs.update(do_sample=True, temperature=float(options.temperature), top_p=float(options.top_p),
                              top_k=None)
                if options.seed is not None:
                    torch.manual_seed(options.seed)
            if cache is not None:
                kwargs[cache_kwarg_name(self.model)] = cache
            if all(h.cancel_requested for h in handles):
                return
            if shared:  # the shared prefix, prefilled and stored once; the batch continues it
                # layer types (sliding windows served as full attention or not) are fixed for the whole cohort
                cache.max_cache_len = width + kwargs["max_new_tokens"] + 1
                self.model.generate(
                    ids[:1, :shared], attention_mask=mask[:1, :shared], max_new_tokens=1, do_sample=False,
                    temperature=None, top_p=None, top_k=None, streamer=PrefixStreamer(cohort),
                    pad_token_id=self.pad_id, **{cache_kwarg_name(self.model): cache})
                if all(h.cancel_requested for h in handles):
                    return
            self.model.generate(ids, **kwargs)
            keep = session is not None
        finally:
            if cache is not None:
                stats = cache.stats()
                with self._cond:
                    self.counters["spec_hits"] += int(stats["spec_hits"])
                    self.counters["spec_steps"] += int(stats["spec_steps"])
            if session is not None:
                self.sessions.release(session, cache if keep else None)
            if cache is not None and not keep:
                cache.close()

    def _cohort_exit(self, cohort: Cohort) -> None:
        now = time.perf_counter()
        tokens = sum(len(h.token_ids) for h in cohort.handles)
        with self._cond:
            self._running.pop(cohort, None)
            self._caches.pop(cohort, None)
            self.counters["finished"] += len(cohort.handles)
            self.counters["cancelled"] += sum(h.finish_reason == "cancelled" for h in cohort.handles)
            self.counters["output_tokens"] += tokens
            self._recent.append((now, tokens))
            self._cond.notify_all()

    # --- accounting ----------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Counters and gauges: running / queued requests, output tokens and tokens/s (last `RATE_WINDOW_S`
        seconds, counted when a cohort ends), device and host bytes of running requests and idle sessions,
        speculation hit rate, sessions, evictions."""
        now = time.perf_counter()
        with self._cond:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            window = min(RATE_WINDOW_S, now - self.started)
            running = [h for c in self._running for h in c.handles if not h.done]
            caches = list(self._caches.values())
            out = dict(self.counters)
            out.update(running_requests=len(running), queued_requests=len(self._queue),
                       tokens_per_second=sum(n for _, n in self._recent) / window if window > 0 else 0.0)
        device = host = 0
        for cache in caches:
            device += cache.held_device_bytes
            host += int(cache.stats()["host_bytes"])
        sessions = self.sessions.totals()
        out.update(device_bytes=device + sessions["device_bytes"], host_bytes=host + sessions["host_bytes"],
                   sessions=sessions["sessions"], idle_sessions=sessions["idle_sessions"],
                   evicted_sessions=self.sessions.evicted,
                   spec_hit_rate=out["spec_hits"] / out["spec_steps"] if out["spec_steps"] else float("nan"))
        return out
