"""What every layer of a cache knows about its sequences: which positions hold real tokens, the sink, what may be
selected. One `SequenceState` per cache, written by the cache, read by its layers."""

from __future__ import annotations

import torch

from ..runtime.streams import to_device


class SequenceState:
    """Per-sequence facts shared (read-only) by the layers of one cache.

    Args:
        n_sink: real tokens per sequence kept as the sink (the first ones).

    Attributes:
        valid: `(B, n)` bool host tensor, False at pad positions, for the positions of the prompts recorded so far
            (`set_prompt`); positions past it are real (decoded) tokens. None before the first prompt (all real).
        first_real: `(B,)` int64 host, each sequence's first real position (set by `finish_prompt`).
        sink_last: `(B,)` int64 host, each sequence's last sink position (`first_real - 1` without sink tokens).
        sink_positions, sink_valid: `(B, n_sink)` int64 / bool host: the sink tokens' positions (position 0 and
            False where a sequence has fewer real tokens).
    """

    def __init__(self, n_sink: int) -> None:
        self.n_sink = n_sink
        self.valid: torch.Tensor | None = None
        self.first_real: torch.Tensor | None = None
        self.sink_last: torch.Tensor | None = None
        self.sink_positions: torch.Tensor | None = None
        self.sink_valid: torch.Tensor | None = None
        self._candidates: dict[int, torch.Tensor] = {}
        self._ring: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def set_prompt(self, valid: torch.Tensor | None, batch: int, length: int) -> None:
        """Record the real-token flags of every position of a request's input (cached positions included).

        Args:
            valid: `(B, length)` bool or 0/1 attention mask (any device), or None when every position is real.
            batch, length: the input's shape.
        """
        if valid is None:
            valid = torch.ones(batch, length, dtype=torch.bool)
        self.valid = valid.detach().to("cpu", torch.bool)
        self._candidates, self._ring = {}, {}

    def is_real(self, positions: torch.Tensor) -> torch.Tensor:
        """`(B, ...)` bool: whether each of `positions` (`(B, ...)` or broadcastable, int64 host) is a real token."""
        batch = 1 if self.valid is None else self.valid.shape[0]
        positions = positions.expand(batch, *positions.shape[1:]) if positions.shape[0] == 1 else positions
        if self.valid is None:
            return torch.ones(positions.shape, dtype=torch.bool)
        known = positions < self.valid.shape[1]
        flat = positions.clamp(max=self.valid.shape[1] - 1).reshape(batch, -1)
        return torch.where(known, torch.gather(self.valid, 1, flat).view(positions.shape), True)

    def check_crop(self, tokens_to_remove: int, stored: int, between_requests: bool) -> None:
        """Raise `ValueError` for a crop (transformers' `Cache.crop` count) that no layer of the cache may make: a
        positive count; between requests, one that would leave `stored + tokens_to_remove` tokens, removing a
        sequence's sink tokens or leading pads (fixed by the first request). `stored`: the cropping layer's tokens."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove, e.g. crop(-1).")
        if tokens_to_remove < 0 and between_requests and stored:
            remaining = stored + tokens_to_remove
            fixed = -1 if self.sink_last is None else int(self.sink_last.max())
            if remaining <= fixed:
                raise ValueError(
                    f"crop({tokens_to_remove}) would leave {remaining} tokens, but positions up to {fixed} hold sink "
                    "tokens or leading pads fixed by the first request; crop fewer tokens or use a fresh cache."
                )

    def first_real_so_far(self, batch: int, length: int, start: int = 0) -> torch.Tensor:
        """`(B,)` int64 first real position among positions `[start, length)` (`length` where there is none)."""
        if self.valid is None:
            return torch.full((batch,), start, dtype=torch.long)
        flags = self.valid[:, start:length]
        positions = start + torch.arange(flags.shape[1])
        first = torch.where(flags, positions, length).amin(dim=1)
        known = start + flags.shape[1]  # positions past the recorded prompt are real
        return first if known >= length else torch.minimum(first, torch.full_like(first, known))

    def share(self, batch: int) -> None:
        """The one sequence becomes a prefix shared by `batch` sequences: its sink and first real position are
        theirs too."""
        self.first_real = self.first_real.expand(batch).clone()
        self.sink_last = self.sink_last.expand(batch).clone()
        self.sink_positions = self.sink_positions.expand(batch, -1).clone()
        self.sink_valid = self.sink_valid.expand(batch, -1).clone()
        self._candidates, self._ring = {}, {}

    def finish_prompt(self, batch: int, length: int) -> None:
        """The prompt of `length` positions is stored: fix the sink and first real positions (once: they never
        change when a later request continues the sequences)."""
        if self.first_real is None:
            flags = torch.ones(batch, length, dtype=torch.bool) if self.valid is None else self.valid[:, :length]
            positions = torch.arange(length).expand(batch, length)
            order = torch.where(flags, positions, length + positions)
            first = torch.sort(order, dim=1).values[:, : self.n_sink]
            self.sink_valid = first < length
            self.sink_positions = torch.where(self.sink_valid, first, torch.zeros_like(first))
            self.first_real = torch.where(flags, positions, length).amin(dim=1)
            last_sink = torch.where(self.sink_valid, self.sink_positions, -1).amax(dim=1) if self.n_sink else \
                torch.full((batch,), -1)
            self.sink_last = torch.maximum(last_sink, self.first_real - 1)  # pads before the first real token
        self._candidates, self._ring = {}, {}

    def candidates_below(self, end: int) -> torch.Tensor:
        """`(B, end)` bool: positions below `end` that are real tokens and not sink tokens (selectable)."""
        cached = self._candidates.get(end)
        if cached is None:
            positions = torch.arange(end)[None, :]
            cached = (positions > self.sink_last[:, None]) & self.is_real(positions)
            if len(self._candidates) >= 2:  # keep two ends: a repaired step asks for end and end + 1 in turn
                del self._candidates[min(self._candidates)]
            self._candidates[end] = cached
        return cached

    def ring_view(self, n: int, q: int, window: int, ring_size: int, device: torch.device):
        """Positions `(1, 1, R)` held by each window-ring slot once `n` tokens are stored, and their validity
        `(B, 1, R)` for a step of `q` new tokens: the window `[n - q - window, n)` minus sink and pad positions.
        Shared by every layer of the step (all layers hold the same positions); tensors on `device`."""
        key = (n, q, window, ring_size)
        cached = self._ring.get(key)
        if cached is None:
            slots = torch.arange(ring_size)
            positions = (n - 1) - torch.remainder(n - 1 - slots, ring_size)  # latest position p < n in slot
            valid = (positions >= n - q - window) & (positions >= 0) & (positions[None, :] > self.sink_last[:, None])
            valid &= self.is_real(positions.clamp(min=0)[None, :])
            # through page-locked memory without a host wait (a copy from pageable memory waits for the stream)
            cached = (to_device(positions[None, None, :], device), to_device(valid[:, None, :], device))
            self._ring = {key: cached}
        return cached
