"""A request of the serving scheduler: its generation options, and the handle its tokens stream through."""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .logprobs import MAX_TOP, TokenLogprob

_ids = itertools.count(1)

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class GenerationOptions:
    """Per-request generation options (the OpenAI completion fields the scheduler serves).

    Attributes:
        max_tokens: new tokens at most (≥ 1).
        temperature: 0 (or below 1e-5) = greedy decoding; otherwise samples from the softmax at this temperature.
        top_p: nucleus sampling mass in (0, 1] (used when sampling).
        stop: strings that end the request when the generated text contains one (the text is cut before it).
        seed: seeds torch's generator when the request's batch starts (reproducible when it runs alone).
        logprobs: record each generated token's log-probability with this many most likely alternatives (0 to
            `MAX_TOP`) in `RequestHandle.token_logprobs`; None records nothing.
        prompt_logprobs: record the log-probability of every prompt token after the first, with this many
            alternatives, in `RequestHandle.prompt_logprobs` (computed from the prefill's logits at every position,
            exact: the prefill attends densely); None records nothing. A session's or a cached prefix's stored tokens
            are not prefilled, so such a request neither continues a session nor copies a cached prefix.

    Raises:
        ValueError: for a value out of range (at construction, before any work).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            problems.append(f"stop must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            problems.append(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP):
                problems.append(f"{name} must be None or an integer in [0, {MAX_TOP}], got {value!r}")
        if problems:
            raise ValueError("; ".join(problems) + ".")


@dataclass(eq=False)
class RequestHandle:
    """One request: what it asked for, and its tokens as they are generated.

    Events, in order, go to `on_event` (called from the scheduler's threads) or, when it is None, to a queue read
    by `tokens()`: `("token", id)` for each new token, then one `("done", finish_reason)`.

    Attributes:
        prompt: `(P,)` int64 token ids. options: `GenerationOptions`. session: session name or None.
        token_ids: the tokens generated so far. finish_reason: one of `FINISH_REASONS` once done, else None.
        error: the message of a request that failed (`finish_reason == "error"`).
        arrived / first_token / finished: `time.perf_counter()` seconds (None until they happen).
        prefilled_tokens: tokens this request prefilled (fewer than the prompt when a session continued).
        token_logprobs: one `TokenLogprob` per generated token when `options.logprobs` is set.
        prompt_logprobs: one `TokenLogprob` per prompt token after the first when `options.prompt_logprobs` is set.
    """

    prompt: torch.Tensor
    options: GenerationOptions
    session: str | None = None
    on_event: Callable[[tuple], None] | None = None
    id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    finished: float | None = None
    prefilled_tokens: int = 0
    cancel_requested: bool = False
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._events: queue.Queue = queue.Queue()
        self._done = threading.Event()

    def emit_token(self, token: int) -> None:
        if self.first_token is None:
            self.first_token = time.perf_counter()
        self.token_ids.append(token)
        self._send(("token", token))

    def finish(self, reason: str, error: str | None = None) -> None:
        """Mark the request done (idempotent: the first reason stays)."""
        if self.finish_reason is not None:
            return
        self.finish_reason, self.error, self.finished = reason, error, time.perf_counter()
        self._send(("done", reason))
        self._done.set()

    def _send(self, event: tuple) -> None:
        (self.on_event or self._events.put)(event)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request is done; False on timeout."""
        return self._done.wait(timeout)

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """The new tokens as they come (when no `on_event` was given); ends when the request is done.

        Raises:
            TimeoutError: no event within `timeout` seconds.
        """
        while True:
            try:
                kind, value = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no token within {timeout} s") from None
            if kind == "done":
                return
            yield value
