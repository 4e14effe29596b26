"""A cohort: requests admitted together and decoded as one left-padded `generate()` batch on a thread of its own.

Cohorts take turns on the model through a `Turnstile`: a cohort holds the turn for one prefill chunk or one decode
step, then passes it to the next waiting cohort (round robin), so a new request's prefill interleaves with the
decode steps of the running ones. The turn passes inside `generate()`'s streamer (`CohortStreamer`): after each
prefill chunk (the dual decode loop's `prefill_chunk_done` hook) and after each token. Each row stops on its own
options (`RowStops`, a transformers `StoppingCriteria`); a stopped row is done for its client at once, and its
batch row is freed when the whole cohort ends (a `DualDecoderCache` cannot drop rows after prefill).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Sequence

import torch
from transformers import StoppingCriteria

from .requests import RequestHandle


class Turnstile:
    """One holder at a time, granted in the order the cohorts asked (first come, first served)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: deque = deque()
        self._holder = None

    def enter(self, who) -> None:
        """Block until `who` holds the turn."""
        with self._cond:
            self._waiting.append(who)
            self._cond.wait_for(lambda: self._holder is None and self._waiting[0] is who)
            self._waiting.popleft()
            self._holder = who

    def leave(self, who) -> None:
        """Give the turn up (idempotent for a non-holder)."""
        with self._cond:
            if self._holder is who:
                self._holder = None
                self._cond.notify_all()

    def pass_turn(self, who) -> None:
        """Let every cohort that is waiting run once, then hold the turn again."""
        if not self._waiting:
            return
        self.leave(who)
        self.enter(who)


class RowStops(StoppingCriteria):
    """Per-row stop conditions of a cohort: cancellation, an end-of-sequence token, a stop string, max_tokens.

    Args:
        handles: the cohort's requests, one per batch row. input_len: the padded prompt length of the batch.
        decode: `token ids → text` (the tokenizer's), for stop strings; eos_ids: end-of-sequence token ids.
    """

    def __init__(self, handles: Sequence[RequestHandle], input_len: int, decode: Callable[[list[int]], str] | None,
                 eos_ids: Sequence[int]) -> None:
        self.handles = list(handles)
        self.input_len = input_len
        self.decode = decode
        self.eos_ids = set(eos_ids)

    def reason(self, handle: RequestHandle, new: list[int]) -> str | None:
        if handle.cancel_requested:
            return "cancelled"
        if new and new[-1] in self.eos_ids:
            return "stop"
        if handle.options.stop and self.decode is not None:
            longest = max(len(s) for s in handle.options.stop)
            tail = self.decode(new[-(longest + 4):])
            if any(s in tail for s in handle.options.stop):
                return "stop"
        if len(new) >= handle.options.max_tokens:
            return "length"
        return None

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row, handle in enumerate(self.handles):
            if not handle.done:
                reason = self.reason(handle, handle.token_ids)
                if reason is not None:
                    handle.finish(reason)
            done[row] = handle.done
        return done


class CohortStreamer:
    """`generate()` streamer of a cohort: hands each row's new token to its request, then passes the turn."""

    def __init__(self, cohort: "Cohort") -> None:
        self.cohort = cohort
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        for handle, token in zip(self.cohort.handles, value.reshape(-1).tolist()):
            if not handle.done:
                handle.emit_token(int(token))
        self.cohort.turnstile.pass_turn(self.cohort)

    def prefill_chunk_done(self) -> None:
        self.cohort.turnstile.pass_turn(self.cohort)

    def end(self) -> None:
        pass


class PrefixStreamer:
    """`generate()` streamer of a cohort's shared-prefix prefill: passes the turn after each prefill chunk and
    drops the one token that call decodes (no client sees it)."""

    def __init__(self, cohort: "Cohort") -> None:
        self.cohort = cohort

    def put(self, value: torch.Tensor) -> None:
        pass

    def prefill_chunk_done(self) -> None:
        self.cohort.turnstile.pass_turn(self.cohort)

    def end(self) -> None:
        pass


class Cohort:
    """Requests decoded as one batch by `generate()` on a thread of its own (see the module docstring).

    Args:
        handles: the requests, one per row (all with the same `GenerationOptions.sampling_key`).
        run: `run(cohort)` calls `generate()` for them (the scheduler's; it builds inputs, cache and criteria).
        turnstile: shared by every cohort of the scheduler. on_exit: called once from the thread when it ends.
        on_start: called on the thread when the cohort first holds the turn, before `run` (it may add handles).
    """

    def __init__(self, handles: Sequence[RequestHandle], run: Callable[["Cohort"], None], turnstile: Turnstile,
                 on_exit: Callable[["Cohort"], None], on_start: Callable[["Cohort"], None] | None = None) -> None:
        self.handles = list(handles)
        self.turnstile = turnstile
        self.started = False
        self._run, self._on_exit, self._on_start = run, on_exit, on_start
        self.thread = threading.Thread(target=self._main, name=f"dual-cohort-{self.handles[0].id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        self.turnstile.enter(self)
        try:
            if self._on_start is not None:  # its first turn: requests queued meanwhile may still join
                self._on_start(self)
            self.started = True
            self._run(self)
            for handle in self.handles:  # generate() returned: every row is done
                handle.finish("length")
        except BaseException as error:  # noqa: BLE001 - reported to every client of the cohort
            message = f"{type(error).__name__}: {error}"
            for handle in self.handles:
                handle.finish("error", message)
        finally:
            self.turnstile.leave(self)
            self._on_exit(self)
