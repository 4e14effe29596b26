"""Serving: a request scheduler over dual caches (`scheduler.py`), idle sessions in host memory (`sessions.py`),
an OpenAI-compatible HTTP server (`server.py`) and its load benchmark (`bench.py`)."""

from .requests import FINISH_REASONS, GenerationOptions, RequestHandle
from .scheduler import Scheduler

__all__ = ["FINISH_REASONS", "GenerationOptions", "RequestHandle", "Scheduler"]
