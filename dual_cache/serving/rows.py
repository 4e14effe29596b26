"""One request inside the decode loop (`Row`): its prompt, its tokens, its own cache while it prefills, its
speculation state, and how it picks and stops on its tokens (per-request sampling and stop conditions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from ..cache.cache import DualDecoderCache
from ..generate.sampling import StepSampler
from .logprobs import token_logprobs
from .requests import RequestHandle
from .sessions import Session


PROMPT_LOGITS_CHUNK = 256  # prompt tokens per prefill forward when every position's logits are kept (prompt_logprobs)
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (dividing logits by them overflows); as vLLM does


@dataclass(eq=False)
class Row:
    """A request from admission to its end.

    Attributes:
        handle: the client's handle. session: its `Session` (None without one).
        cache: its own `DualDecoderCache` while it prefills (a fresh one, or its session's); None once it joined the
            running batch (then its sequence is a row of the batch's cache). None for dense rows.
        stored: prompt positions its cache held before its prefill (a session's conversation, a cached prefix).
        prefilled: prompt positions fed so far (the stored ones count as fed).
        prefix_end: where its prefill pauses so the prefix cache copies its prompt's whole blocks (0: it does not).
        ids: `(P + max_tokens + 1,)` int64 buffer of the prompt + generated tokens (the first `length`); the last one
            (`pending`) is not fed yet. Preallocated, so a decode step copies no sequence.
        guess: its speculated slot's guess in the last forward for the token after `speculated` (`speculate`: the
            argmax, or a coupled sample); None before its first decode step (the speculator then starts from prompt lookup, as
            `generate()` does on its first step).
        speculated: the speculated token fed with `pending` in the last forward, or None.
        last_hit: whether that speculated token equalled the real one; None before its first decode step.
        generator: its own random generator when it samples (seeded by `GenerationOptions.seed` when given).
        coupled: coupled sampling (`DualDecoderConfig.coupled_sampling`): the guess for its next token is drawn with
            the noise that will draw that token (`sampling.StepSampler`); False: `torch.multinomial` per token.
    """

    handle: RequestHandle
    session: Session | None = None
    cache: DualDecoderCache | None = None
    stored: int = 0
    prefilled: int = 0
    prefix_end: int = 0
    length: int = 0
    guess: int | None = None
    speculated: int | None = None
    last_hit: bool | None = None
    generator: torch.Generator | None = None
    coupled: bool = True

    def __post_init__(self) -> None:
        prompt = self.handle.prompt
        self.ids = torch.empty(prompt.numel() + self.handle.options.max_tokens + 1, dtype=torch.long)
        self.ids[:prompt.numel()] = prompt
        self.length = prompt.numel()
        options = self.handle.options
        self.processors = LogitsProcessorList()
        if options.temperature >= GREEDY_BELOW:
            self.processors.append(TemperatureLogitsWarper(float(options.temperature)))
            if options.top_p < 1:
                self.processors.append(TopPLogitsWarper(float(options.top_p)))
            self.generator = torch.Generator()
            if options.seed is not None:
                self.generator.manual_seed(options.seed)
            else:
                self.generator.seed()
        self.sampler = StepSampler(self.generator is not None, self.coupled, self.generator)

    @property
    def prompt_len(self) -> int:
        return self.handle.prompt.numel()

    @property
    def tokens(self) -> torch.Tensor:
        """`(length,)` int64 view: the prompt and the tokens generated so far."""
        return self.ids[:self.length]

    @property
    def pending(self) -> int:
        """The newest token (not fed to the model yet)."""
        return int(self.ids[self.length - 1])

    @property
    def done(self) -> bool:
        return self.handle.done

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from `(V,)` float32 logits: argmax when greedy, else a sample after the request's
        temperature and top-p (transformers' logits warpers, as `generate()` applies them; with `coupled`, drawn
        with the noise its guess was drawn with, `speculate`). With `options.logprobs`, its log-probability under
        `logits` is recorded in `handle.token_logprobs`."""
        scores = logits[None] if self.generator is None else self.processors(self.tokens[None], logits[None])
        token = int(self.sampler.real(scores)[0])
        top = self.handle.options.logprobs
        if top is not None:
            self.handle.token_logprobs += token_logprobs(logits[None], torch.tensor([token]), top)
        return token

    def speculate(self, logits: torch.Tensor) -> int:
        """The guess for the token after `speculated` from the speculated slot's `(V,)` float32 logits: their argmax
        when greedy, else (coupled) a sample of its processed scores drawn with the noise the next `pick` uses."""
        if self.generator is None:
            return int(logits.argmax())
        context = torch.cat([self.tokens, torch.tensor([self.speculated], dtype=torch.long)])
        return int(self.sampler.speculated(self.processors(context[None], logits[None]))[0])

    @property
    def wants_prompt_logits(self) -> bool:
        """Whether its prefill must keep the logits of every prompt position (`options.prompt_logprobs`)."""
        return self.handle.options.prompt_logprobs is not None

    def prefill_tokens(self, chunk: int) -> int:
        """Prompt tokens its next prefill forward may take: `chunk`, or at most `PROMPT_LOGITS_CHUNK` when every
        position's logits are kept (a `(tokens, vocabulary)` tensor)."""
        return min(chunk, PROMPT_LOGITS_CHUNK) if self.wants_prompt_logits else chunk

    def take_prompt_logits(self, logits: torch.Tensor, start: int) -> None:
        """Record the prompt tokens' log-probabilities from one prefill chunk's logits.

        Args:
            logits: `(n, V)` logits of prompt positions `start .. start + n - 1`; position `i` predicts prompt token
                `i + 1` (the last position of the prompt predicts the first generated token: not recorded here).
            start: the chunk's first position.
        """
        prompt = self.handle.prompt
        n = min(logits.shape[0], prompt.numel() - 1 - start)
        if n > 0:
            self.handle.prompt_logprobs += token_logprobs(logits[:n], prompt[start + 1:start + 1 + n],
                                                          self.handle.options.prompt_logprobs)

    def emit(self, token: int, decode: Callable[[list[int]], str] | None, eos_ids: set[int]) -> None:
        """Take a new token: stream it to the client, then finish the request if it stops here."""
        self.ids[self.length] = token
        self.length += 1
        self.handle.emit_token(token)
        reason = stop_reason(self.handle, decode, eos_ids)
        if reason is not None:
            self.handle.finish(reason)


def stop_reason(handle: RequestHandle, decode: Callable[[list[int]], str] | None, eos_ids: set[int]) -> str | None:
    """Why the request ends after its newest token, or None: cancellation, an end-of-sequence token, a stop string
    in the text of its last tokens (`decode`: the tokenizer's), its max_tokens."""
    new = handle.token_ids
    if handle.cancel_requested:
        return "cancelled"
    if new and new[-1] in eos_ids:
        return "stop"
    if handle.options.stop and decode is not None:
        longest = max(len(s) for s in handle.options.stop)
        tail = decode(new[-(longest + 4):])
        if any(s in tail for s in handle.options.stop):
            return "stop"
    if len(new) >= handle.options.max_tokens:
        return "length"
    return None
