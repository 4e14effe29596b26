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


def _release(
    chunks: list[tuple[torch.Tensor, torch.Tensor]], registered: bool, channel_chunks: list[torch.Tensor]
) -> None:
    """Unregister (if registered) and drop every chunk; runs once, from `free()` or when the store is collected."""
    freed = 0
    for keys, values in chunks:
        for tensor in (keys, values):
            if registered:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            freed += tensor.untyped_storage().nbytes()
    freed += sum(tensor.untyped_storage().nbytes() for tensor in channel_chunks)
    chunks.clear()
    channel_chunks.clear()
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
        channel_major: also keep a channel-major copy of the keys, `(B, H_kv, D, chunk_tokens)` per chunk, for
            reading a few channels of every key (`channel_products`; the `"shortlist"` selector). It is filled lazily
            from the keys, on the thread that reads it, and counted in every byte figure (never page-locked).

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
        channel_major: bool = False,
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
        self.channel_major = channel_major
        self.length = 0
        self.channel_length = 0  # positions copied into the channel-major keys so far
        self._written: torch.cuda.Event | None = None
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._channel_chunks: list[torch.Tensor] = []
        self._finalizer = weakref.finalize(self, _release, self._chunks, self.page_lock, self._channel_chunks)

    @staticmethod
    def chunk_nbytes(batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_tokens: int,
                     channel_major: bool = False) -> int:
        """Bytes of one chunk (keys + values, and the channel-major keys when kept)."""
        copies = 3 if channel_major else 2
        return copies * batch_size * kv_heads * chunk_tokens * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def capacity(self) -> int:
        """Allocated tokens per (sequence, KV head)."""
        return len(self._chunks) * self.chunk_tokens

    @property
    def nbytes(self) -> int:
        """Allocated host bytes: keys, values and the channel-major keys."""
        return sum(k.nbytes + v.nbytes for k, v in self._chunks) + sum(c.nbytes for c in self._channel_chunks)

    def _grow(self) -> None:
        if self._finalizer.alive is False:
            raise RuntimeError("This HostKVStore was freed; create a new cache to store more tokens.")
        shape = (*self.shape_prefix, self.chunk_tokens, self.head_dim)
        nbytes = self.chunk_nbytes(*self.shape_prefix, self.head_dim, self.dtype, self.chunk_tokens, self.channel_major)
        if self.on_alloc is not None:
            self.on_alloc(nbytes)
        keys = torch.empty(shape, dtype=self.dtype)
        values = torch.empty(shape, dtype=self.dtype)
        channels = torch.empty(*self.shape_prefix, self.head_dim, self.chunk_tokens, dtype=self.dtype) \
            if self.channel_major else None
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
        _account(nbytes)
        self._chunks.append((keys, values))
        if channels is not None:
            self._channel_chunks.append(channels)

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
        self.channel_length = min(self.channel_length, self.length)

    def channel_products(
        self, left: torch.Tensor, channels: torch.Tensor, hi: int, first_sequence: int = 0
    ) -> torch.Tensor:
        """`left @ keys[..., channels]ᵀ` over positions `[0, hi)`, reading only those channels of the keys from the
        channel-major copy (filled up to `hi` first).

        Args:
            left: `(B, H_kv, G, r)` in the store's dtype (e.g. the query's values at those channels).
            channels: `(B, H_kv, r)` int64 channel indices in `[0, D)`, per sequence and KV head.
            hi: positions read, `<= length`.
            first_sequence: the `B` rows are the store's sequences `first_sequence, first_sequence + 1, …`.

        Returns:
            `(B, H_kv, G, hi)` float32 (products computed in the store's dtype). Per chunk, the `r` channel rows are
            copied whole with `index_select` into one reused buffer, then multiplied.

        Raises:
            RuntimeError: if the store was built without `channel_major=True`.
            ValueError: if `hi` is outside `[0, length]` or the rows lie outside the store's batch.
        """
        if not self.channel_major:
            raise RuntimeError("This HostKVStore keeps no channel-major keys; build it with channel_major=True.")
        if not 0 <= hi <= self.length:
            raise ValueError(f"Cannot read positions [0, {hi}) from a store holding {self.length}.")
        while self.channel_length < hi:  # transpose the keys appended since the last read, chunk by chunk
            chunk, offset = divmod(self.channel_length, self.chunk_tokens)
            take = min(hi - self.channel_length, self.chunk_tokens - offset)
            keys = self._chunks[chunk][0][:, :, offset : offset + take]
            self._channel_chunks[chunk][:, :, :, offset : offset + take].copy_(keys.transpose(-1, -2))
            self.channel_length += take
        batch, kv_heads, r = channels.shape
        first = self.first_row(first_sequence, batch)
        rows = ((first + torch.arange(batch * kv_heads)).view(batch, kv_heads, 1) * self.head_dim + channels).flatten()
        out = torch.empty(*left.shape[:-1], hi, dtype=torch.float32)
        scratch = torch.empty(rows.numel(), self.chunk_tokens, dtype=self.dtype)  # reused: no per-chunk allocation
        for start in range(0, hi, self.chunk_tokens):
            width = min(self.chunk_tokens, hi - start)
            source = self._channel_chunks[start // self.chunk_tokens].view(-1, self.chunk_tokens)
            torch.index_select(source, 0, rows, out=scratch)
            part = scratch.view(batch, kv_heads, r, self.chunk_tokens)[..., :width]
            out[..., start : start + width].copy_(torch.matmul(left, part))
        return out

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
            out: optional contiguous `(keys, values)` `(B, H_kv, k, D)` host tensors to write into (e.g. a staging
                buffer).

        Returns:
            `(keys, values)`, each `(B, H_kv, k, D)`.
        """
        out_keys, out_values = out if out is not None else (None, None)
        return self._gather(0, indices, out_keys), self._gather(1, indices, out_values)

    def gather_keys(self, indices: torch.Tensor, first_sequence: int = 0) -> torch.Tensor:
        """Keys only at `indices` (B, H_kv, k) int64 positions `< length`: a new `(B, H_kv, k, D)` tensor.

        `first_sequence`: the `B` rows of `indices` are the store's sequences `first_sequence, …` (ValueError if
        they lie outside its batch)."""
        return self._gather(0, indices, None, self.first_row(first_sequence, indices.shape[0]))

    def first_row(self, first_sequence: int, batch: int) -> int:
        """Flat `(sequence, KV head)` row of `first_sequence`'s first KV head.

        Raises:
            ValueError: unless sequences `[first_sequence, first_sequence + batch)` lie in the store's batch.
        """
        fits = 0 <= first_sequence <= first_sequence + batch <= self.shape_prefix[0]
        if isinstance(first_sequence, bool) or not fits:
            raise ValueError(
                f"Sequences [{first_sequence}, {first_sequence + batch}) are outside this store's batch of "
                f"{self.shape_prefix[0]}."
            )
        return first_sequence * self.shape_prefix[1]

    def _gather(self, which: int, indices: torch.Tensor, out: torch.Tensor | None, first: int = 0) -> torch.Tensor:
        """Rows of keys (`which=0`) or values (1) at `indices` `(b, H_kv, k)`, copied whole (`D` contiguous elements
        each) with `index_select` from each chunk viewed as `(B·H_kv·chunk_tokens, D)`; `first` is the flat
        `(sequence, KV head)` row of `indices`' first row."""
        shape = (*indices.shape, self.head_dim)
        target = out if out is not None else torch.empty(shape, dtype=self.dtype)
        flat_out = target.view(-1, self.head_dim)  # (a non-contiguous `out` raises here)
        batch, kv_heads = indices.shape[:2]
        chunk_ids = indices // self.chunk_tokens
        base = (first + torch.arange(batch * kv_heads)).view(batch, kv_heads, 1) * self.chunk_tokens
        rows = (base + indices - chunk_ids * self.chunk_tokens).flatten()
        chunk_ids = chunk_ids.flatten()
        used = range(int(chunk_ids.min()), int(chunk_ids.max()) + 1) if indices.numel() else range(0)
        for chunk in used:
            source = self._chunks[chunk][which].view(-1, self.head_dim)
            if len(used) == 1:
                torch.index_select(source, 0, rows, out=flat_out)
            else:
                inside = (chunk_ids == chunk).nonzero().flatten()
                flat_out.index_copy_(0, inside, source.index_select(0, rows[inside]))
        return target

    def free(self) -> None:
        """Release every chunk now (unregistering page-locked memory). Idempotent; `length` is kept."""
        self._finalizer()
