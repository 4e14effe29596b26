"""Host-memory KV storage of one layer: every key and value of every sequence, in chunks of tokens.

Appending never moves what is stored: the store grows by whole chunks. The first chunk is sized to the request
(`reserve`, e.g. the prompt length), later ones geometrically (half the capacity, between `host.growth.MIN_GROWTH`
and `chunk_tokens` tokens), so a short request holds about what it stores and a long one stays in few chunks (each
chunk is one `index_select` in a gather). How a chunk's pages are allocated, page-locked for the device and
released is `pages.py`'s job; every chunk counts in `host.memory.live_host_bytes()` while it lives.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque
from typing import Callable, Sequence

import torch

from .memory import account_host_bytes, live_host_bytes  # noqa: F401  (public path, docs/usage.md)
from .growth import next_chunk_tokens
from .pages import allocate_chunk, copy_block, release_chunks


class HostKVStore:
    """Keys and values of one attention layer in host memory, `(B, H_kv, D)` per token, in chunks of tokens.

    Args:
        batch_size: sequences B.
        kv_heads: key/value heads H_kv.
        head_dim: D.
        dtype: storage dtype (the model's K/V dtype).
        chunk_tokens: the largest growth step (tokens); see `host.growth.next_chunk_tokens`.
        page_lock: register chunks with CUDA (only when CUDA is available).
        on_alloc: called with the byte size of each chunk (keys + values) before it is allocated; may raise to
            refuse it (the cache's host-memory limit).

    Raises:
        ValueError: if a size argument is not positive.
    """

    def __init__(self, batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_tokens: int,
                 page_lock: bool = False, on_alloc: Callable[[int], None] | None = None) -> None:
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
        self._staged: deque = deque()  # (event, keys, values, position) appended by `stage`, not yet written
        self._spare: list[tuple[torch.Tensor, torch.Tensor]] = []  # staging buffers free for reuse
        self._stage_lock = threading.Lock()
        self._chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._starts: list[int] = []  # first position of each chunk
        self.capacity = 0  # allocated tokens per (sequence, KV head)
        self.shared_length = 0  # positions [0, shared_length) are one sequence's, shared by every row (`share`)
        self.bytes_to_host = 0  # bytes `append` copied in (keys + values)
        self.bytes_to_device = 0  # bytes `read_into` copied out
        self._finalizer = weakref.finalize(self, release_chunks, self._chunks, self.page_lock)

    def __getstate__(self) -> dict:  # copies (a closed cache's deepcopy) get a lock of their own
        state = dict(self.__dict__)
        del state["_stage_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stage_lock = threading.Lock()

    @staticmethod
    def chunk_nbytes(batch_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, chunk_tokens: int) -> int:
        """Bytes of a chunk of `chunk_tokens` tokens (keys + values)."""
        return 2 * batch_size * kv_heads * chunk_tokens * head_dim * torch.empty((), dtype=dtype).element_size()

    def chunk_spans(self) -> list[tuple[int, int]]:
        """`(first position, tokens)` of every allocated chunk, in order."""
        return [(start, keys.shape[2]) for start, (keys, _) in zip(self._starts, self._chunks)]

    @property
    def element_size(self) -> int:
        """Bytes of one stored element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Allocated host bytes: keys and values."""
        return sum(k.nbytes + v.nbytes for k, v in self._chunks)

    def share(self, batch_size: int) -> None:
        """Let `batch_size` sequences continue this store's one sequence: the positions stored so far are kept once
        and read by every row (their chunks keep a batch of 1); later positions are each row's own.

        Raises:
            ValueError: if the store holds more than one sequence or is already shared.
        """
        if self.shape_prefix[0] != 1 or self.shared_length:
            raise ValueError(
                f"Only a store of one sequence can be shared, once; this one holds {self.shape_prefix[0]} sequence(s)"
                f"{' and is shared already' if self.shared_length else ''}."
            )
        self.shape_prefix = (batch_size, self.shape_prefix[1])
        self.shared_length = self.capacity = self.length  # what is left of the last shared chunk stays unused

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` tokens per sequence now, in one chunk (no-op when the capacity suffices)."""
        if tokens > self.capacity:
            self._grow(tokens - self.capacity)

    def _make_room(self, q: int) -> None:
        """Grow (by `next_chunk_tokens` at least) when `q` more tokens do not fit."""
        if self.length + q > self.capacity:
            short = self.length + q - self.capacity
            own = self.capacity - self.shared_length  # a shared prefix is not grown per sequence
            self._grow(max(short, next_chunk_tokens(own, self.chunk_tokens)))

    def _grow(self, tokens: int) -> None:
        """Add a chunk of `tokens` tokens."""
        if self._finalizer.alive is False:
            raise RuntimeError("This HostKVStore was freed; create a new cache to store more tokens.")
        shape = (*self.shape_prefix, tokens, self.head_dim)
        nbytes = self.chunk_nbytes(*self.shape_prefix, self.head_dim, self.dtype, tokens)
        if self.on_alloc is not None:
            self.on_alloc(nbytes)
        keys, values = allocate_chunk(shape, self.dtype, self.page_lock)
        account_host_bytes(nbytes)
        self._chunks.append((keys, values))
        self._starts.append(self.capacity)
        self.capacity += tokens

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append `(B, H_kv, q, D)` keys/values (any device) at positions `[length, length + q)`.

        From a CUDA device the copies are asynchronous on the current stream, one contiguous block per (sequence,
        KV head) and chunk into the page-locked chunks (`copy_block`; the new keys are made contiguous on the device
        first); host readers wait for them with `wait_written`, device readers (`read_into`) are ordered after them
        by the stream."""
        q = keys.shape[2]
        self._make_room(q)
        self._copy_in(keys.contiguous(), values.contiguous(), self.length)
        if keys.device.type == "cuda":  # device→host copies are asynchronous; readers wait on this event
            self._written = torch.cuda.Event()
            self._written.record(torch.cuda.current_stream(keys.device))
        self.bytes_to_host += keys.nbytes + values.nbytes
        self.length += q

    def stage(self, keys: torch.Tensor, values: torch.Tensor, streams) -> None:
        """Append `(B, H_kv, q, D)` keys/values computed on the device during a decode step without a host wait: they
        are copied into page-locked staging on the copy stream of `streams` (after the compute stream's work so far)
        and written into the store by whichever comes first: a `wait_written` (any thread: a retrieval job, a
        reader), or a later `stage` finding the copy done. `length` counts them at once; readers call
        `wait_written` first. With `streams` that copy at once (`HostStreams`, a CPU device) the tokens are written
        directly."""
        q = keys.shape[2]
        self._make_room(q)
        if not streams.asynchronous:  # the "device" is host memory: one strided host copy
            self._write(keys, values, self.length)
            self.length += q
            return
        buffers = self._spare.pop() if self._spare and self._spare[-1][0].shape == keys.shape else None
        if buffers is None:
            pin = self.page_lock and keys.device.type == "cuda"
            buffers = (torch.empty(keys.shape, dtype=self.dtype, pin_memory=pin),
                       torch.empty(values.shape, dtype=self.dtype, pin_memory=pin))
        streams.wait(streams.record("compute"), "copy")
        streams.copy(buffers[0], keys)
        streams.copy(buffers[1], values)
        self._staged.append((streams.record("copy"), buffers[0], buffers[1], self.length))
        self.length += q
        self._drain(block=False)

    def _drain(self, block: bool) -> None:
        """Write staged tokens whose copies are done into the chunks, in order; with `block`, wait for every copy
        (else stop at the first one still in flight, and skip if another thread is draining)."""
        if not self._staged or not self._stage_lock.acquire(blocking=block):
            return
        try:
            while self._staged:
                event, keys, values, position = self._staged[0]
                if not event.query():
                    if not block:
                        return
                    event.synchronize()
                self._write(keys, values, position)
                self._staged.popleft()
                self._spare.append((keys, values))
        finally:
            self._stage_lock.release()

    def _copy_in(self, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Copy contiguous `(B, H_kv, q, D)` keys/values (any device) into the chunks at positions
        `[position, position + q)`, one block per (sequence, KV head) and chunk (`copy_block`)."""
        q, done = keys.shape[2], 0
        sources = keys.flatten(0, 1), values.flatten(0, 1)  # (B·H_kv, q, D): one row per (sequence, KV head)
        while done < q:
            chunk, offset = self._locate(position + done)
            take = min(q - done, self._chunks[chunk][0].shape[2] - offset)
            for stored, source in zip(self._chunks[chunk], sources):
                rows = stored.flatten(0, 1)
                for row in range(rows.shape[0]):
                    copy_block(rows[row, offset : offset + take], source[row, done : done + take])
            done += take

    def _write(self, keys: torch.Tensor, values: torch.Tensor, position: int) -> None:
        """Copy host `(B, H_kv, q, D)` keys/values into the chunks at positions `[position, position + q)` (host to
        host: one strided copy per chunk)."""
        q, done = keys.shape[2], 0
        while done < q:
            chunk, offset = self._locate(position + done)
            chunk_keys, chunk_values = self._chunks[chunk]
            take = min(q - done, chunk_keys.shape[2] - offset)
            chunk_keys[:, :, offset : offset + take].copy_(keys[:, :, done : done + take])
            chunk_values[:, :, offset : offset + take].copy_(values[:, :, done : done + take])
            done += take

    def _locate(self, position: int) -> tuple[int, int]:
        """`(chunk, offset)` of an allocated `position`."""
        chunk = bisect.bisect_right(self._starts, position) - 1
        return chunk, position - self._starts[chunk]

    def wait_written(self) -> None:
        """Block the calling (host) thread until every appended or staged token is in the store's host memory."""
        if self._written is not None:
            self._written.synchronize()
        self._drain(block=True)

    def crop(self, n_tokens: int) -> None:
        """Forget the last `n_tokens` tokens (their memory is reused by the next append; staged tokens are written
        first, so none lands after the crop)."""
        self._drain(block=True)
        if not 0 <= n_tokens <= self.length - self.shared_length:
            raise ValueError(
                f"Cannot crop {n_tokens} tokens from a store holding {self.length}"
                f"{f' ({self.shared_length} of them shared by every sequence)' if self.shared_length else ''}."
            )
        self.length -= n_tokens

    def key_chunks(self, hi: int, rows: slice | None = None) -> list[torch.Tensor]:
        """Views of the keys of positions `[0, hi)`, one `(b, H_kv, n_i, D)` view per chunk (no copy): `b` is the
        store's batch, or `rows`' length when given, or 1 for the chunks of a shared prefix (`share`), which hold
        every row's keys once."""
        return self._rows(self._views(0, hi), rows)

    def value_chunks(self, hi: int, rows: slice | None = None) -> list[torch.Tensor]:
        """The values of positions `[0, hi)`, chunk by chunk as `key_chunks`."""
        return self._rows(self._views(1, hi), rows)

    def _rows(self, views: list[torch.Tensor], rows: slice | None) -> list[torch.Tensor]:
        if rows is None:
            return views
        return [view if view.shape[0] == 1 and self.shared_length else view[rows] for view in views]

    def _views(self, which: int, hi: int) -> list[torch.Tensor]:
        views = []
        for start, (keys, values) in zip(self._starts, self._chunks):
            if start >= hi:
                break
            chunk = keys if which == 0 else values
            end = min(start + chunk.shape[2], hi, self.shared_length if start < self.shared_length else hi)
            views.append(chunk[:, :, : end - start])
        return views

    def read(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions `[lo, hi)` as two `(B, H_kv, hi - lo, D)` tensors (a view when the range
        lies in one chunk, else a copy)."""
        if not 0 <= lo <= hi <= self.length:
            raise ValueError(f"Cannot read positions [{lo}, {hi}) from a store holding {self.length}.")
        if not self._chunks:
            empty = torch.empty(*self.shape_prefix, 0, self.head_dim, dtype=self.dtype)
            return empty, empty
        batch = self.shape_prefix[0]
        first, offset = self._locate(lo)
        keys, values = self._chunks[first]
        if hi - lo <= keys.shape[2] - offset and (hi <= self.shared_length or lo >= self.shared_length):
            keys, values = keys[:, :, offset : offset + hi - lo], values[:, :, offset : offset + hi - lo]
            return keys.expand(batch, *keys.shape[1:]), values.expand(batch, *values.shape[1:])
        keys = torch.cat([view.expand(batch, *view.shape[1:]) for view in self._views(0, hi)], dim=2)[:, :, lo:]
        values = torch.cat([view.expand(batch, *view.shape[1:]) for view in self._views(1, hi)], dim=2)[:, :, lo:]
        return keys, values

    def read_into(self, lo: int, hi: int, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Copy positions `[lo, hi)` into `(B, H_kv, hi - lo, D)` tensors on the device (e.g. the first positions of
        a larger device tensor), one block per (sequence, KV head) and chunk straight from the page-locked chunks
        (`copy_block`: asynchronous on CUDA, on the current stream, which orders them after this store's appends);
        each output's `(hi - lo, D)` block per (sequence, KV head) must be contiguous. A shared prefix's one
        sequence is copied into every row.

        Raises:
            ValueError: for a range outside `[0, length]`.
        """
        if not 0 <= lo <= hi <= self.length:
            raise ValueError(f"Cannot read positions [{lo}, {hi}) from a store holding {self.length}.")
        if keys_out.device.type == "cpu":  # a host reader: the device's writes must have landed
            self.wait_written()
        else:  # the device reads after its own writes (stream order); staged decode tokens are written on the host
            self._drain(block=True)
        batch, kv_heads = self.shape_prefix
        outputs = keys_out.flatten(0, 1), values_out.flatten(0, 1)  # (B·H_kv, hi - lo, D) views
        for start, (keys, values) in zip(self._starts, self._chunks):
            first, last = max(lo, start), min(hi, start + keys.shape[2])
            if first >= last:
                continue
            for stored, out in zip((keys, values), outputs):
                rows = stored.flatten(0, 1)  # a shared chunk holds one sequence: row h serves (b, h) of every b
                for row in range(batch * kv_heads):
                    source = rows[row if stored.shape[0] > 1 else row % kv_heads]
                    copy_block(out[row, first - lo : last - lo], source[first - start : last - start])
        self.bytes_to_device += keys_out[:, :, : hi - lo].nbytes + values_out[:, :, : hi - lo].nbytes

    def gather(self, indices: torch.Tensor, out: Sequence[torch.Tensor] | None = None,
               rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `indices` (b, H_kv, k) int64 positions `< length`.

        Args:
            out: optional `(keys, values)` `(b, H_kv, k, D)` host tensors to write into (e.g. a staging buffer;
                written in place when contiguous, through a temporary otherwise).
            rows: the store's sequences the `b` rows of `indices` belong to (ValueError if outside its batch);
                None: `0 … b - 1`.

        Returns:
            `(keys, values)`, each `(b, H_kv, k, D)`.
        """
        if out is not None and not all(o.is_contiguous() for o in out):  # slots of a wider buffer: via a copy
            keys, values = self.gather(indices, None, rows)
            out[0].copy_(keys)
            out[1].copy_(values)
            return out[0], out[1]
        out_keys, out_values = out if out is not None else (None, None)
        own = self.flat_rows(rows, indices.shape[0])
        shared = torch.arange(indices.shape[1]).view(1, -1, 1)  # a shared chunk's rows: one sequence
        return self._gather(0, indices, out_keys, own, shared), self._gather(1, indices, out_values, own, shared)

    def gather_rows(self, rows: torch.Tensor, positions: torch.Tensor,
                    out: Sequence[torch.Tensor]) -> None:
        """Keys and values of `N` entries, each of its own (sequence, KV head): `rows` `(N,)` int64 flat rows
        `b · H_kv + h` (sequences of the store's batch), `positions` `(N,)` int64 `< length`, written into `out`
        `(keys, values)`, each `(N, D)` contiguous host tensors (a resident set's delta)."""
        if not rows.numel():
            return
        shared = rows % self.shape_prefix[1]
        self._gather(0, positions, out[0], rows, shared)
        self._gather(1, positions, out[1], rows, shared)

    def flat_rows(self, rows: Sequence[int] | None, batch: int) -> torch.Tensor:
        """`(b, H_kv, 1)` int64 flat `(sequence, KV head)` rows of sequences `rows` (None: `0 … batch - 1`).

        Raises:
            ValueError: unless `rows` are `batch` sequences of the store's batch.
        """
        rows = list(range(batch)) if rows is None else list(rows)
        if len(rows) != batch or any(isinstance(r, bool) or not 0 <= r < self.shape_prefix[0] for r in rows):
            raise ValueError(f"Sequences {rows} are not {batch} sequences of this store's batch of "
                             f"{self.shape_prefix[0]}.")
        kv_heads = self.shape_prefix[1]
        return (torch.tensor(rows, dtype=torch.long)[:, None] * kv_heads + torch.arange(kv_heads)).view(
            batch, kv_heads, 1)

    def _gather(self, which: int, indices: torch.Tensor, out: torch.Tensor | None, own: torch.Tensor,
                shared: torch.Tensor) -> torch.Tensor:
        """Rows of keys (`which=0`) or values (1) at `indices` (any shape), copied whole (`D` contiguous elements
        each) with `index_select` from each chunk viewed as `(B·H_kv·tokens, D)`; `own` and `shared` (broadcastable
        to `indices`) are the flat `(sequence, KV head)` rows of each index (`flat_rows`) and, in a chunk the batch
        shares (batch 1), its KV head."""
        shape = (*indices.shape, self.head_dim)
        target = out if out is not None else torch.empty(shape, dtype=self.dtype)
        flat_out = target.view(-1, self.head_dim)  # (a non-contiguous `out` raises here)
        if not indices.numel():
            return target
        if not self.shared_length and (len(self._chunks) == 1 or int(indices.max()) < self._starts[1]):
            tokens = self._chunks[0][which].shape[2]  # one chunk: one index_select
            rows = (own * tokens + indices).flatten()
            torch.index_select(self._chunks[0][which].view(-1, self.head_dim), 0, rows, out=flat_out)
            return target
        starts = torch.tensor(self._starts)
        chunk_ids = torch.bucketize(indices.contiguous(), starts, right=True) - 1
        flat_ids = chunk_ids.flatten()
        counts = torch.bincount(flat_ids, minlength=len(self._chunks)).tolist()
        main = max(range(len(counts)), key=counts.__getitem__)
        # every row from the chunk most rows lie in, straight into `out` (rows of other chunks are clamped into it
        # and overwritten below): one `index_select` does most of the work, as with one chunk
        source = self._chunks[main][which]
        sequences = shared if self._starts[main] < self.shared_length else own
        local = (indices - self._starts[main]).clamp(0, source.shape[2] - 1)
        torch.index_select(source.view(-1, self.head_dim), 0, (sequences * source.shape[2] + local).flatten(),
                           out=flat_out)
        for chunk, count in enumerate(counts):
            if chunk == main or not count:
                continue
            inside = (flat_ids == chunk).nonzero().flatten()
            source = self._chunks[chunk][which]
            sequences = shared if self._starts[chunk] < self.shared_length else own
            rows = (sequences * source.shape[2] + indices - self._starts[chunk]).flatten()[inside]
            flat_out.index_copy_(0, inside, source.view(-1, self.head_dim).index_select(0, rows))
        return target

    def free(self) -> None:
        """Release every chunk and staging buffer now (unregistering page-locked memory); staged tokens not yet
        written are dropped (the request's copy stream was drained before). Idempotent; `length` is kept."""
        self._staged.clear()
        self._spare.clear()
        self._finalizer()
