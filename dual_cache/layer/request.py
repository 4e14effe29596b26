"""A full-attention layer's request state, as two small objects: the request's shape (`RequestShape`: its budgets,
the resident set's capacity, the window ring's and the host store's sizes, fixed when the request begins) and what a
request carries to the next one over the same sequences (`RequestCarry`: the query that selects the next first step,
the positions last attended, the resident set's mirror, the softmax scale). `regroup` hands a layer a carry whole
(`DualLayer.adopt`); nothing outside the layer writes either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import DualDecoderConfig
from ..selection.selectors import SELECTORS


@dataclass(frozen=True)
class RequestShape:
    """A request's sizes at one layer (per KV head unless said otherwise), fixed by `begin_request`.

    Attributes:
        budget: entries the real token attends to per step: the layer's budget, at most the request's tokens.
        fetch_budget: entries the selector chooses per step: `fetch_factor × budget` for a prefetched selector (at
            most the request's tokens), else `budget`.
        next_budget: slots after them for the next positions of what the real token attended (`fetch_next`), 0
            without.
        capacity: entries the resident set holds (`for_request`).
        ring_size: slots of the window ring: the window (at most the request's tokens) plus the step's two tokens.
        reserve_tokens: tokens per sequence the host store holds at once when the request starts.
    """

    budget: int
    fetch_budget: int
    next_budget: int
    capacity: int
    ring_size: int
    reserve_tokens: int

    @classmethod
    def idle(cls, config: DualDecoderConfig, budget: int) -> "RequestShape":
        """A layer's shape before its first request: its budget, no follow slots, the whole window."""
        return cls(budget, budget, 0, budget, config.window + 2, 0)

    @classmethod
    def for_request(cls, config: DualDecoderConfig, budget: int, tokens: int, reserve: int) -> "RequestShape":
        """The shape of a request of at most `tokens` tokens per sequence at a layer of `budget`, whose host store
        reserves `reserve` tokens at once."""
        prefetched = SELECTORS[config.selector].prefetched
        request_budget = min(budget, tokens)
        fetch = max(request_budget, min(config.fetch_factor * request_budget, tokens)) if prefetched else \
            request_budget
        follow = request_budget if (config.fetch_next and prefetched and fetch < tokens and request_budget > 0) else 0
        return cls(request_budget, fetch, follow, _capacity(config, prefetched, request_budget, fetch, follow, tokens),
                   min(config.window, tokens) + 2, reserve)

    @property
    def width(self) -> int:
        """Slots per KV head of a step's wanted positions: the selector's choice, then the follow slots."""
        return self.fetch_budget + self.next_budget


def _capacity(config: DualDecoderConfig, prefetched: bool, budget: int, fetch: int, follow: int, tokens: int) -> int:
    """Resident entries per KV head for a request of `tokens` tokens: `resident_factor × budget` for a prefetched
    selector (at least what one step wants), else exactly what one step selects (those selectors attend to their choice
    alone); never more than the positions a step can ever select (`tokens` minus the window and the sink), so a short
    request holds no slot that could never fill. Past that it follows the budget alone (a request shorter than the
    budget lowers it), so a sequence moved into another request's cache (`regroup`) keeps its set's size."""
    if not prefetched:
        return max(1, fetch)
    wanted = max(fetch + follow, config.resident_factor * budget)
    return max(1, min(wanted, tokens - config.window - config.n_sink))


@dataclass(frozen=True)
class RequestCarry:
    """What a layer carries from one request to the next over the same sequences (kept between requests; `regroup`
    moves sequences into another cache with theirs, so they decode as if never interrupted).

    Attributes:
        query: `(B, H_q, D)` float32 host: the query that selects the next request's first decode step: the prompt's
            last query after a prefill, the last speculated token's when a request ends mid-decode; None before.
        attended: `(B, H_kv, m)` int64 host, -1 where none: the positions the last step attended when a request ended
            mid-decode (the first step's next positions; a row of `OWN_TOP`: its query's own top entries); None: a
            prompt's last token chose (its own top entries continue).
        resident: `(positions, stamps)` host tensors of the resident set when a request ended mid-decode, restored by
            the next request that decodes these sequences without a new prompt; a new prompt drops it.
        scaling: the layer's softmax scale, as its prefill attention received it (what selections score with).
    """

    query: torch.Tensor | None = None
    attended: torch.Tensor | None = None
    resident: tuple[torch.Tensor, torch.Tensor] | None = None
    scaling: float = 1.0
