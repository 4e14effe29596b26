"""Host memory: the allowance of one cache (a limit checked before anything is allocated, and what is claimed) and
the process-wide count of live host bytes (`live_host_bytes()`), which lets tests and users check that nothing leaks."""

from __future__ import annotations

import os
import threading


_live_lock = threading.Lock()
_live_bytes = 0  # bytes of live host stores and selector state, process-wide (`live_host_bytes`)


def live_host_bytes() -> int:
    """Bytes currently allocated by all `HostKVStore`s of this process (keys + values, registered or not) and by
    selectors' host state (`host.pages.host_tensor`)."""
    return _live_bytes


def account_host_bytes(delta: int) -> None:
    """Add `delta` bytes (negative: freed) to `live_host_bytes()`; thread-safe."""
    global _live_bytes
    with _live_lock:
        _live_bytes += delta


class HostMemoryError(MemoryError):
    """The host store of a request would not fit in the host memory the cache may use."""


def format_bytes(nbytes: float) -> str:
    """`"512 B"`, `"3.5 KiB"`, `"12.0 MiB"`, `"1.25 GiB"` (binary units)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(nbytes) < 1024:
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def available_host_bytes() -> int:
    """Host memory available to new allocations now (Linux `MemAvailable`; else free physical pages), bytes."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class HostMemory:
    """What one cache may allocate on the host, shared by its layers' stores and selectors.

    Args:
        limit: bytes the cache may allocate in all; None = 90% of the host memory available at the first check,
            divided by `ranks_per_host`.

    Claims come from the decode loop's thread and from retrieval worker threads (a selector's index grows inside
    its retrieval job), so every change of `claimed` is made under a lock: concurrent claims never exceed the
    limit together.

    Attributes:
        claimed: bytes allocated so far (stores and selector state).
        ranks_per_host: processes of a tensor-parallel group on this host (1 without one): each rank's cache holds
            its own KV heads and may use this share of the available memory (`tensor_parallel.TensorShard`).
    """

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self.configured = limit
        self.claimed = 0
        self._lock = threading.Lock()
        self.ranks_per_host = 1

    @property
    def limit(self) -> int:
        """The limit in bytes (resolved from the available memory on first use when not configured)."""
        if self._limit is None:
            self._limit = int(0.9 * available_host_bytes() / self.ranks_per_host)
        return self._limit

    def _whose(self) -> str:
        return "" if self.ranks_per_host == 1 else f" (this rank's share: {self.ranks_per_host} ranks on this host)"

    def check(self, needed: int, request: str) -> None:
        """Raise `HostMemoryError` unless `needed` more bytes fit; nothing is claimed.

        Args:
            needed: bytes the request will allocate (all layers).
            request: what needs them, for the message (e.g. "2 sequence(s) of 4,096 tokens").
        """
        if self.claimed + needed > self.limit:
            raise HostMemoryError(
                f"The dual cache needs {format_bytes(needed)} ({needed:,} bytes) of host memory for {request}, but "
                f"may use {format_bytes(self.limit - self.claimed)} more{self._whose()} (max_host_bytes="
                f"{self.configured}). Lower "
                "the batch size, the prompt length or max_new_tokens, or raise `max_host_bytes` in cache_config."
            )

    def claim(self, nbytes: int) -> None:
        """Account for `nbytes` about to be allocated; raises `HostMemoryError` past the limit (nothing is claimed
        then). Thread-safe: the check and the addition are one step."""
        limit = self.limit
        with self._lock:
            if self.claimed + nbytes > limit:
                raise HostMemoryError(
                    f"The dual cache's host memory would exceed {format_bytes(limit)}{self._whose()} (another "
                    f"{format_bytes(nbytes)} requested). Lower the batch size or the number of tokens, or raise "
                    "`max_host_bytes` in cache_config."
                )
            self.claimed += nbytes

    def __deepcopy__(self, memo: dict) -> "HostMemory":
        """A new allowance with the same limit and claims (and a lock of its own)."""
        copied = HostMemory(self._limit)
        copied.configured, copied.claimed = self.configured, self.claimed
        copied.ranks_per_host = self.ranks_per_host
        memo[id(self)] = copied
        return copied

    def release(self, nbytes: int) -> None:
        """`nbytes` claimed earlier were freed (a layer's host store and index, when the layer starts sliding)."""
        with self._lock:
            self.claimed = max(0, self.claimed - nbytes)

    def release_all(self) -> None:
        """Everything claimed was freed (the cache was closed)."""
        with self._lock:
            self.claimed = 0
