"""Host-memory KV storage of one layer: every key and value of every sequence, in fixed-size chunks.

Appending never moves what is stored: the store grows by whole chunks of `chunk_tokens` tokens. On CUDA machines
each chunk is ordinary (pageable) memory registered with the driver (`cudaHostRegister`), so host→device copies
from it can be asynchronous without the power-of-two rounding of torch's pinned-memory caching allocator (a
`(3, 8, 4096, 128)` bf16 chunk is 24 MiB; the caching allocator would reserve 32 MiB for it).

Process-wide accounting of live host bytes (`live_host_bytes()`) lets tests and users check that nothing leaks.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Sequence

import torch

_live_lock = threading.Lock()
_live_bytes = 0


def live_host_bytes() -> int:
    """Bytes currently allocated by all `HostKVStore`s of this process (keys + values, registered or not)."""
    return _live_bytes


def _account(delta: int) -> None:
    global _live_bytes
    with _live_lock:
        _live_bytes += delta


def _register(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s memory in place so CUDA copies from it run asynchronously."""
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.untyped_storage().nbytes(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {int(result)}.")


def _release(chunks: list[tuple[torch.Tensor, torch.Tensor]], registered: bool) -> None:
    """Unregister (if registered) and drop every chunk; runs once, from `free()` or when the store is collected."""
    freed = 0
    for keys, values in chunks:
        for tensor in (keys, values):
            if registered:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            freed += tensor.untyped_storage().nbytes()
    chunks.clear()
    _account(-freed)


class HostKVStore:
    """Keys and values of one attention layer in host memory, `(B, H_kv, D)` per token, in chunks of tokens.

    Args:
        batch_size: sequences B.
        kv_heads: key/value heads H_kv.
        head_dim: D.
        dtype: storage dtype (the model's K/V dtype).
        chunk_tokens: tokens per chunk (the growth step).
        page_lock: register chunks with CUDA (only when CUDA is available).
        on_alloc: called with the byte size of each chunk (keys + values) before it is allocated; may raise to
            refuse it (the cache's host-memory limit).

    Raises:
        ValueError: if a size argument is not positive.
    """

    def __init__(
        self,
        batch_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        chunk_tokens: int,
        page_lock: bool = False,
        on_alloc: Callable[[int], None] | None = None,
    ) -> None:
        if min(batch_size, kv_heads, head_dim, chunk_tokens) <= 0:
            raise ValueError(
                f"HostKVStore needs positive sizes, got batch_size={batch_size}, kv_heads={kv_heads}, "
                f"head_dim={head_dim}, chunk_tokens={chunk_tokens}."
            )
        self.shape_prefix = (batch_size, kv_heads)
        self.head_dim = head_dim
        self.dtype = dtype
        self.chunk_tokens = chunk_tokens
        self.page_lock = page_lock and torch.cuda.is_available()
        self.on_alloc = on_alloc
        self.length = 0
        self._written: torch.cuda.Event | None = None
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._finalizer = weakref.finalize(self, _release, self._chunks, self.page_lock)

    @staticmethod
    def chunk_nbytes(batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_tokens: int) -> int:
        """Bytes of one chunk (keys + values)."""
        return 2 * batch_size * kv_heads * chunk_tokens * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity(self) -> int:
        """Allocated tokens per (sequence, KV head)."""
        return len(self._chunks) * self.chunk_tokens

    @property
    def nbytes(self) -> int:
        """Allocated host bytes for keys and values together."""
        return sum(k.nbytes + v.nbytes for k, v in self._chunks)

    def _grow(self) -> None:
        if self._finalizer.alive is False:
            raise RuntimeError("This HostKVStore was freed; create a new cache to store more tokens.")
        shape = (*self.shape_prefix, self.chunk_tokens, self.head_dim)
        nbytes = self.chunk_nbytes(*self.shape_prefix, self.head_dim, self.dtype, self.chunk_tokens)
        if self.on_alloc is not None:
            self.on_alloc(nbytes)
        keys = torch.empty(shape, dtype=self.dtype)
        values = torch.empty(shape, dtype=self.dtype)
        registered = []
        try:
            if self.page_lock:
                for tensor in (keys, values):
                    _register(tensor)
                    registered.append(tensor)
        except BaseException:
            for tensor in registered:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            raise
        _account(keys.untyped_storage().nbytes() + values.untyped_storage().nbytes())
        self._chunks.append((keys, values))

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append `(B, H_kv, q, D)` keys/values (any device) at positions `[length, length + q)`."""
        q = keys.shape[2]
        done = 0
        while done < q:
            position = self.length + done
            chunk, offset = divmod(position, self.chunk_tokens)
            while chunk >= len(self._chunks):
                self._grow()
            take = min(q - done, self.chunk_tokens - offset)
            chunk_keys, chunk_values = self._chunks[chunk]
            chunk_keys[:, :, offset : offset + take].copy_(keys[:, :, done : done + take], non_blocking=True)
            chunk_values[:, :, offset : offset + take].copy_(values[:, :, done : done + take], non_blocking=True)
            done += take
        if keys.device.type == "cuda":  # device→host copies are asynchronous; readers wait on this event
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(keys.device))
        self.length += q

    def wait_written(self) -> None:
        """Block the calling (host) thread until every appended token has landed in host memory (CUDA only)."""
        if self._written is not None:
            self._written.synchronize()

    def crop(self, n_tokens: int) -> None:
        """Forget the last `n_tokens` tokens (their memory is reused by the next append)."""
        if not 0 <= n_tokens <= self.length:
            raise ValueError(f"Cannot crop {n_tokens} tokens from a store holding {self.length}.")
        self.length -= n_tokens

    def key_chunks(self, hi: int) -> list[torch.Tensor]:
        """Views of the keys of positions `[0, hi)`, one `(B, H_kv, n_i, D)` view per chunk (no copy)."""
        return self._views(0, hi)

    def _views(self, which: int, hi: int) -> list[torch.Tensor]:
        views = []
        for start in range(0, hi, self.chunk_tokens):
            chunk = self._chunks[start // self.chunk_tokens][which]
            views.append(chunk[:, :, : min(self.chunk_tokens, hi - start)])
        return views

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions `[lo, hi)` as two `(B, H_kv, hi - lo, D)` tensors (a view when the range
        lies in one chunk, else a copy)."""
        if not 0 <= lo <= hi <= self.length:
            raise ValueError(f"Cannot read positions [{lo}, {hi}) from a store holding {self.length}.")
        first, last = lo // self.chunk_tokens, max(lo, hi - 1) // self.chunk_tokens
        if first == last and self._chunks:
            offset = first * self.chunk_tokens
            keys, values = self._chunks[first]
            return keys[:, :, lo - offset : hi - offset], values[:, :, lo - offset : hi - offset]
        keys = torch.cat(self._views(0, hi), dim=2)[:, :, lo:]
        values = torch.cat(self._views(1, hi), dim=2)[:, :, lo:]
        return keys, values

    def gather(self, indices: torch.Tensor, out: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `indices` (B, H_kv, k) int64 positions `< length`.

        Args:
            out: optional `(keys, values)` `(B, H_kv, k, D)` host tensors to write into (e.g. a staging buffer).

        Returns:
            `(keys, values)`, each `(B, H_kv, k, D)`.
        """
        shape = (*indices.shape, self.head_dim)
        out_keys, out_values = out if out is not None else (
            torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype)
        )
        chunk_ids = indices // self.chunk_tokens
        offsets = indices - chunk_ids * self.chunk_tokens
        index = offsets.unsqueeze(-1).expand(shape)
        used = range(int(chunk_ids.min()), int(chunk_ids.max()) + 1) if indices.numel() else range(0)
        for i, chunk in enumerate(used):
            chunk_keys, chunk_values = self._chunks[chunk]
            if i == 0:
                torch.gather(chunk_keys, 2, index, out=out_keys)
                torch.gather(chunk_values, 2, index, out=out_values)
            else:
                inside = (chunk_ids == chunk).unsqueeze(-1)
                torch.where(inside, torch.gather(chunk_keys, 2, index), out_keys, out=out_keys)
                torch.where(inside, torch.gather(chunk_values, 2, index), out_values, out=out_values)
        return out_keys, out_values

    def free(self) -> None:
        """Release every chunk now (unregistering page-locked memory). Idempotent; `length` is kept."""
        self._finalizer()
