"""Idle sessions: a conversation's `DualDecoderCache` kept in host memory between its requests.

A session's cache holds every stored position on the host and nothing on the device once its request ended
(`DualDecoderCache.end_request` releases the device tiers), so an idle session costs host bytes only. Its next
request continues the cache and prefills only the tokens after the stored ones. Idle sessions past the host-memory
budget are closed least recently used first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..cache.cache import DualDecoderCache


@dataclass
class Session:
    """One named conversation. cache: its `DualDecoderCache` (None before its first request ends); busy: a request
    of it is running; last_used: `time.monotonic()` of its last request's end."""

    name: str
    cache: DualDecoderCache | None = None
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def host_bytes(self) -> int:
        return 0 if self.cache is None else int(self.cache.stats()["host_bytes"])

    @property
    def device_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.held_device_bytes


class SessionStore:
    """Sessions by name, with least-recently-used eviction of idle ones past `host_budget` bytes.

    Args:
        host_budget: bytes the idle sessions' caches may hold in all (None: no limit).
    """

    def __init__(self, host_budget: int | None = None) -> None:
        if host_budget is not None and host_budget < 0:
            raise ValueError(f"host_budget must be >= 0 bytes or None, got {host_budget}.")
        self.host_budget = host_budget
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def acquire(self, name: str) -> Session | None:
        """The session `name` marked busy (created when new), or None while another request of it runs."""
        with self._lock:
            session = self._sessions.get(name)
            if session is None:
                session = self._sessions[name] = Session(name)
            if session.busy:
                return None
            session.busy = True
            self._sessions.move_to_end(name)
            return session

    def release(self, session: Session, cache: DualDecoderCache | None) -> None:
        """The session's request ended; it keeps `cache` (None: the request failed or was cancelled during its
        prefill; the session starts over)."""
        with self._lock:
            if session.cache is not None and session.cache is not cache:
                session.cache.close()
            session.cache, session.busy, session.last_used = cache, False, time.monotonic()
            self._sessions.move_to_end(session.name)
            self._evict()

    def _evict(self) -> None:
        if self.host_budget is None:
            return
        total = sum(s.host_bytes for s in self._sessions.values() if not s.busy)
        for name in list(self._sessions):
            if total <= self.host_budget:
                break
            session = self._sessions[name]
            if session.busy:
                continue
            total -= session.host_bytes
            self._drop(name)

    def make_room(self, nbytes: int) -> int:
        """Close idle sessions, least recently used first, until `nbytes` host bytes are freed (or none is left
        idle); returns the bytes freed."""
        freed = 0
        with self._lock:
            for name in list(self._sessions):
                if freed >= nbytes:
                    break
                session = self._sessions[name]
                if not session.busy and session.cache is not None:
                    freed += session.host_bytes
                    self._drop(name)
        return freed

    def _drop(self, name: str) -> None:
        session = self._sessions.pop(name)
        if session.cache is not None:
            session.cache.close()
        self.evicted += 1

    def totals(self) -> dict[str, int]:
        """`{"sessions", "idle_sessions", "host_bytes", "device_bytes"}` of the idle sessions."""
        with self._lock:
            idle = [s for s in self._sessions.values() if not s.busy]
            return {"sessions": len(self._sessions), "idle_sessions": len(idle),
                    "host_bytes": sum(s.host_bytes for s in idle), "device_bytes": sum(s.device_bytes for s in idle)}

    def close(self) -> None:
        """Close every idle session's cache (busy ones are closed by their request's end)."""
        with self._lock:
            for name in [n for n, s in self._sessions.items() if not s.busy]:
                session = self._sessions.pop(name)
                if session.cache is not None:
                    session.cache.close()
