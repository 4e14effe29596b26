"""A streamer that records when each generated token arrives (decode throughput without a profiler)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers.generation.streamers import BaseStreamer


@dataclass
class TimingStreamer(BaseStreamer):
    """Records when each generated token arrives (seconds, `time.perf_counter`) and forwards to `inner`."""

    inner: BaseStreamer | None = None
    times: list[float] = field(default_factory=list)
    prompt_time: float | None = None  # when generate() handed over the prompt (before the prefill)
    _prompt_seen: bool = False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        else:
            self.prompt_time = time.perf_counter()
        self._prompt_seen = True
        if self.inner is not None:
            self.inner.put(value)

    def end(self):
        if self.inner is not None:
            self.inner.end()

    def first_token_seconds(self) -> float:
        """Seconds from the prompt to the first generated token (the prefill and one step); nan before it."""
        if self.prompt_time is None or not self.times:
            return float("nan")
        return self.times[0] - self.prompt_time

    def decode_tokens_per_second(self) -> float:
        """Tokens per second after the first generated token (prefill excluded); nan with < 2 tokens."""
        if len(self.times) < 2:
            return float("nan")
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])
