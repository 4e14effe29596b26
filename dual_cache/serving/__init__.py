"""Serving: a request scheduler with continuous batching over dual caches (`scheduler.py`, `batch.py`; dense rows
in `dense_batch.py`), idle sessions in host memory (`sessions.py`), a prefix cache (`prefix.py`) and an
OpenAI-compatible HTTP server (`server.py`). Its load benchmark, `dual-decoder bench-serve`, is evaluation code:
`dual_cache.eval.throughput.bench_serve`."""

from .requests import FINISH_REASONS, GenerationOptions, RequestHandle
from .scheduler import Scheduler

__all__ = ["FINISH_REASONS", "GenerationOptions", "RequestHandle", "Scheduler"]
