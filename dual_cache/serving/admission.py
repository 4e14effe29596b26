"""Which requests the serving scheduler takes: a new request's prompt and options checked before it is queued
(`check_request`), and queued requests admitted first in, first out while batch rows and host memory allow
(`Admission`), each with the host bytes its cache will hold.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch

from ..config import DualDecoderConfig
from ..host.memory import format_bytes
from .prefix import PrefixCache
from .requests import GenerationOptions, RequestHandle
from .rows import Row
from .sessions import SessionStore


class RequestError(ValueError):
    """A request refused before it is queued; `param` names the request field to change (OpenAI's error `param`):
    `"prompt"`, `"max_tokens"` or `"session"`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _tokens(count: int) -> str:
    return f"{count} token{'' if count == 1 else 's'}"


def check_request(input_ids: torch.Tensor | Sequence[int], options: GenerationOptions, session: str | None,
                  max_positions: int | None, dense: bool) -> torch.Tensor:
    """A new request's prompt as `(P,)` int64 on the host, checked with its options before anything is queued.

    Args:
        input_ids: `(P,)` or `(1, P)` int token ids. options: its generation options. session: a session name or
            None. max_positions: the model's positions (None: unknown). dense: the scheduler serves dense rows.

    Raises:
        RequestError: (a `ValueError`) empty or non-integer ids, or a prompt that fills the model's positions alone
            (`param` "prompt"); a prompt + max_tokens past the model's positions ("max_tokens"); a session on the
            dense server or asking for its prompt's logprobs ("session").
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise RequestError(f"input_ids must be a non-empty (P,) or (1, P) integer tensor, got {tuple(ids.shape)} "
                           f"{ids.dtype}.", "prompt")
    if max_positions is not None and ids.numel() >= max_positions:
        raise RequestError(f"The prompt ({_tokens(ids.numel())}) leaves no room for a new token in the model's "
                           f"{max_positions} positions; shorten it to at most {max_positions - 1} tokens.", "prompt")
    if max_positions is not None and ids.numel() + options.max_tokens > max_positions:
        raise RequestError(f"max_tokens ({options.max_tokens}) plus the prompt ({_tokens(ids.numel())}) exceeds the "
                           f"model's {max_positions} positions; lower max_tokens to at most "
                           f"{max_positions - ids.numel()} or shorten the prompt.", "max_tokens")
    if session is not None and (dense or not isinstance(session, str) or not session):
        raise RequestError("session must be a non-empty string, and sessions need the dual cache (not --dense).",
                           "session")
    if session is not None and options.prompt_logprobs is not None:
        raise RequestError("A session request cannot return its prompt's logprobs (echo): the session's stored "
                           "tokens are not prefilled again.", "session")
    return ids.to(torch.long).cpu()


class Admission:
    """The scheduler's admission control: which queued requests become rows, and the host bytes each one's cache
    will hold (`estimates`).

    Args:
        probe: a `DualDecoderCache` of the served model that holds nothing, for the estimates (None: dense rows,
            which hold no host bytes). dtype: the model's dtype.
        max_batch: requests admitted at once (decoding or prefilling). max_host_bytes: host bytes the admitted
            requests, idle sessions and cached prefixes may hold in all (None: no limit here).
        sessions, prefixes: the scheduler's idle sessions and prefix cache (evicted least recently used to make
            room). dual_config: the rows' `DualDecoderConfig` (None: dense rows; they sample coupled).
    """

    def __init__(self, probe, dtype: torch.dtype, max_batch: int, max_host_bytes: int | None, sessions: SessionStore,
                 prefixes: PrefixCache, dual_config: DualDecoderConfig | None) -> None:
        self.probe, self.dtype, self.max_batch, self.max_host_bytes = probe, dtype, max_batch, max_host_bytes
        self.sessions, self.prefixes = sessions, prefixes
        self.coupled = dual_config is None or dual_config.coupled_sampling
        self.estimates: dict[Row, int] = {}  # host bytes planned for each admitted row, until it is retired

    def admit(self, queue: deque[RequestHandle], prefilling: list[Row], counters: dict[str, int]) -> None:
        """Move queued requests (first in, first out; a session's waits while its previous request runs) to
        `prefilling` as rows while rows and host memory allow; called holding the scheduler's lock.

        A request that cannot be admitted (its row or estimate fails, or it needs more host memory than the
        allowance when nothing else is admitted) is finished with an error and counted in `counters`.
        """
        for handle in list(queue):
            if sum(not row.done for row in self.estimates) >= self.max_batch:  # finished rows leave when it joins
                return
            session = None
            if handle.session is not None:
                session = self.sessions.acquire(handle.session)
                if session is None:
                    continue  # its previous request still runs
            row = None
            try:  # nothing about one request may stop the loop: it fails alone
                row = Row(handle, session, coupled=self.coupled)
                if session is not None and session.cache is not None:
                    self._continue_session(row, counters)
                needed = self._host_bytes(row)
            except Exception as error:  # noqa: BLE001 - reported to this request's client
                queue.remove(handle)
                handle.finish("error", f"{type(error).__name__}: {error}")
                counters["finished"] += 1
                if session is not None:  # the session keeps what it stored
                    self.sessions.release(session, row.cache if row is not None and row.cache else session.cache)
                continue
            if self.max_host_bytes is not None:
                held = sum(self.estimates.values()) + self.sessions.totals()["host_bytes"] + self.prefixes.host_bytes
                if held + needed > self.max_host_bytes:  # idle sessions and cached prefixes make room first
                    held -= self.prefixes.make_room(held + needed - self.max_host_bytes)
                if held + needed > self.max_host_bytes:
                    held -= self.sessions.make_room(held + needed - self.max_host_bytes)
                if held + needed > self.max_host_bytes:
                    if session is not None:
                        self.sessions.release(session, row.cache)
                    elif row.cache is not None:
                        row.cache.close()
                    if not self.estimates:  # it can never fit
                        queue.remove(handle)
                        handle.finish("error", f"The request needs {format_bytes(needed)} of host memory; the server "
                                               f"allows {format_bytes(self.max_host_bytes)} (--max-host-bytes).")
                        counters["finished"] += 1
                        continue
                    return
            queue.remove(handle)
            self.estimates[row] = needed
            prefilling.append(row)

    def _continue_session(self, row: Row, counters: dict[str, int]) -> None:
        """A session request continues its session's cache when its prompt extends the stored tokens; otherwise the
        session starts over (its cache is closed)."""
        cache, prompt = row.session.cache, row.handle.prompt
        stored, held = cache.get_seq_length(), cache.token_ids
        if held is not None and prompt.numel() > stored and torch.equal(held[0, :stored], prompt[:stored]):
            row.cache, row.session.cache = cache, None
            counters["session_resumes"] += 1
        else:
            cache.close()
            row.session.cache = None

    def _host_bytes(self, row: Row) -> int:
        """Host bytes the row's cache will hold (its prompt + max_tokens + 1), not counting a session's stored
        tokens (already counted as the session's); 0 for dense rows."""
        if self.probe is None:
            return 0
        prompt, options = row.prompt_len, row.handle.options
        cache = row.cache or self.probe
        stored = cache.get_seq_length()
        tokens = prompt + options.max_tokens + 1
        if stored:
            return cache.host_bytes_needed(1, tokens - stored, self.dtype, prompt_tokens=prompt - stored)
        return cache.host_bytes_needed(1, tokens, self.dtype, prompt_tokens=prompt)
