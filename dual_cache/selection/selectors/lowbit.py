"""`selector="lowbit"`: a 2-bit copy of every key (the host index), scanned to shortlist positions that are then
rescored exactly — both in one call of the native selection engine (`dual_cache.engine`).

The scan reads the codes of `lowbit_channels` of the channels only (the quads with the largest `Σ_h |q_h| × step`
this step; SparQ's query-magnitude channel choice, Ribar et al., 2024, §3, applied to the 2-bit copy), the others
entering at each group's midpoint, and ranks positions by each head's approximate log-probability (its logit minus
the log-sum-exp over a sample of groups).

Per sequence, keys are quantized per channel over groups of 64 consecutive positions starting at its first real
token (so left padding never changes them): a bfloat16 minimum and step per (group, channel) and a 2-bit code per
key element (`engine/codes.py`, KIVI's key layout, Liu et al., 2024, §3). A step scans the codes of every complete
group with the speculated token's GQA group of queries, keeps the `lowbit_factor × budget` best positions plus every
candidate the index does not cover yet (the positions after the last complete group), and selects the `budget`
of highest exact attention mass among them (`engine/reference.py` defines each number). Groups are appended as the
selectable range grows (prefill chunks, then decode steps). Host bytes: `D/4 + D/16` bytes per key per KV head
(codes, parameters), 7.8% of a bf16 K/V pair; nothing lives on the device. The codes are stored quad-major (each
channel quad's 64-byte lines of all groups one after another), so a scan of a quarter of the quads reads a quarter
of the code bytes as plain streams. A step is one engine call for every sequence of the batch; what it reads of the
index and the store is laid out for the engine once, not per step.
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Sequence

import torch

from ... import engine
from ...engine.codes import GROUP, padded_dim, quantize_fast
from ...host.pages import host_tensor
from ..candidates import Candidates
from .base import Selector


class LowBitSelector(Selector):
    """2-bit key index + exact rescoring, through the native engine (`lowbit_factor` sets the shortlist)."""

    name = "lowbit"
    shares_prefix = True  # `share` copies the prefix's index to every sequence (the index is per sequence)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        batch = self.store.shape_prefix[0]
        self.dim_q = padded_dim(self.store.head_dim)
        self._lines: torch.Tensor | None = None  # (B, H_kv, D_q / 4, capacity, 64) uint8 code lines (`_codes`)
        self.params: torch.Tensor | None = None  # (B, H_kv, capacity, 2, D_q) bfloat16
        self.group_first = [-1] * batch  # per sequence: position of its group 0 (-1: no real token indexed yet)
        self.n_groups = [0] * batch  # per sequence: complete groups indexed
        # what a step's select reads, kept between steps: the index as the engine sees it (rebuilt when the index
        # changes), the store's chunks laid out for the engine (rebuilt when the store grows), and the length at
        # which some sequence completes its next group (0: unknown, `extend` looks)
        self._view: engine.IndexView | None = None
        self._prepared: tuple | None = None
        self._next_group_at = 0
        # `extend` runs inside retrieval jobs on worker threads while the decode loop's `crop(-1)` calls `truncate`
        # on the layer's index: every change of the index state is made under this lock (see `truncate`)
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # copies (a closed cache's deepcopy) get a lock of their own
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @classmethod
    def check_config(cls, config) -> None:
        if isinstance(config.lowbit_factor, bool) or not isinstance(config.lowbit_factor, numbers.Integral) \
                or config.lowbit_factor < 1:
            raise ValueError(f"`lowbit_factor` must be an int >= 1 (positions rescored exactly per KV head, as a "
                             f"multiple of the budget), got {config.lowbit_factor!r}.")
        config.lowbit_factor = int(config.lowbit_factor)  # a numpy integer is stored as the int it holds
        channels = config.lowbit_channels
        if isinstance(channels, bool) or not isinstance(channels, (int, float)) or not 0 < channels <= 1:
            raise ValueError(f"`lowbit_channels` must be a fraction in (0, 1] (share of the key channels the 2-bit "
                             f"scan reads), got {channels!r}.")

    @classmethod
    def host_bytes_for(cls, config, tokens: int, kv_heads: int, head_dim: int, element_size: int) -> int:
        groups = tokens // GROUP + 1
        return groups * kv_heads * padded_dim(head_dim) * (16 + 4)

    def shortlist_for(self, budget: int) -> int:
        """Positions the scan shortlists per KV head for a selection of `budget`: `lowbit_factor × budget`."""
        return self.config.lowbit_factor * budget

    @property
    def quads(self) -> int:
        """Channel quads the scan reads per KV head: `ceil(lowbit_channels × D_q / 4)`."""
        return max(1, math.ceil(self.config.lowbit_channels * self.dim_q / 4 - 1e-9))

    def _ensure_capacity(self, groups: int) -> None:
        have = 0 if self.packed is None else self.packed.shape[2]
        if groups <= have:
            return
        batch, kv_heads = self.store.shape_prefix
        capacity = max(groups, -(-self.store.capacity // GROUP), 2 * have)
        nbytes = batch * kv_heads * capacity * self.dim_q * (16 + 4)
        self.claim_host(nbytes - self.host_bytes)  # what the index grows by (the old tensors are freed below)
        lines = self._codes(batch, capacity)
        params = host_tensor((batch, kv_heads, capacity, 2, self.dim_q), torch.bfloat16)
        if self._lines is not None:
            lines[:, :, :, :have] = self._lines
            params[:, :, :have] = self.params
        self._lines, self.params = lines, params

    @property
    def packed(self) -> torch.Tensor | None:
        """The code lines as `(B, H_kv, capacity, D_q / 4, 64)` uint8 (a view of the quad-major storage), or None."""
        return None if self._lines is None else self._lines.permute(0, 1, 3, 2, 4)

    def _codes(self, batch: int, capacity: int) -> torch.Tensor:
        """Zeroed code lines `(batch, H_kv, D_q / 4, capacity, 64)` uint8, quad-major: each channel quad's lines of
        all groups one after another, so the scan reads one sequential stream per quad it reads. The tensor itself is
        kept (`_lines`): the host-memory accounting of `host_tensor` ends when it is collected."""
        return host_tensor((batch, self.store.shape_prefix[1], self.dim_q // 4, capacity, 64), torch.uint8)

    def _keys(self, lo: int, hi: int, row: int) -> torch.Tensor:
        """`(H_kv, hi - lo, D)` keys of one sequence at positions `[lo, hi)`, read chunk by chunk."""
        parts, start = [], 0
        for chunk in self.store.key_chunks(hi):
            stop = start + chunk.shape[2]
            if stop > lo:
                parts.append(chunk[row if chunk.shape[0] > 1 else 0, :, max(lo - start, 0):])
            start = stop
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def extend(self, length: int, first_real: torch.Tensor, sequences: Sequence[int] | None = None) -> None:
        """Quantize every complete group of positions below `length` not indexed yet (per sequence, from its first
        real position). Holds the index lock (`truncate`). A decode step completes a group once every 64 steps per
        sequence; until then this returns at once."""
        if length < self._next_group_at:
            return
        with self._lock:
            self._extend(length, first_real, sequences)
            self._changed()
            if all(first >= 0 for first in self.group_first):
                self._next_group_at = min(first + (count + 1) * GROUP
                                          for first, count in zip(self.group_first, self.n_groups))

    def _changed(self) -> None:
        """The index changed: rebuild its engine view at the next select, and look for new groups again."""
        self._view = None
        self._next_group_at = 0

    def _extend(self, length: int, first_real: torch.Tensor, sequences: Sequence[int] | None) -> None:
        kv_heads, dim = self.store.shape_prefix[1], self.store.head_dim
        wanted = {}
        for offset, real in enumerate(first_real.tolist()):
            row = offset if sequences is None else sequences[offset]
            if self.group_first[row] < 0 and real < length:
                self.group_first[row] = real
            if self.group_first[row] >= 0:
                complete = max(0, (length - self.group_first[row]) // GROUP)
                if complete > self.n_groups[row]:
                    wanted[row] = complete
        if not wanted:
            return
        self._ensure_capacity(max(wanted.values()))
        for row, want in wanted.items():
            have = self.n_groups[row]
            lo = self.group_first[row] + have * GROUP
            keys = self._keys(lo, lo + (want - have) * GROUP, row).reshape(kv_heads * (want - have), GROUP, dim)
            packed, params = quantize_fast(keys)
            self._lines[row, :, :, have:want] = packed.view(kv_heads, want - have, -1, 64).transpose(1, 2)
            self.params[row, :, have:want] = params.view(kv_heads, want - have, 2, -1)
            self.n_groups[row] = want

    def adopt(self, sources, length: int, first_real: torch.Tensor) -> None:
        """Copy each sequence's groups from its source index (groups start at a sequence's first real position, so
        they hold the same keys after a shift), then index the groups completed since."""
        counts = [source.n_groups[row] if isinstance(source, LowBitSelector) else 0 for source, row in sources]
        if max(counts, default=0):
            self._ensure_capacity(max(counts))
            for i, ((source, row), count) in enumerate(zip(sources, counts)):
                if count:
                    at = row if source.packed.shape[0] > 1 else 0
                    self._lines[i, :, :, :count] = source._lines[at, :, :, :count]
                    self.params[i, :, :count] = source.params[at, :, :count]
                    self.group_first[i], self.n_groups[i] = int(first_real[i]), count
        self._changed()
        self.extend(length, first_real)

    def truncate(self, length: int) -> None:
        """Forget the groups reaching positions `>= length` (the store was cropped to `length` tokens).

        Ordering with the retrieval jobs (worker threads) that extend the index: a decode step's job indexes only
        positions below its selectable end, `committed - window`, and `window >= 1` (`DualDecoderConfig`), so the
        decode loop's `crop(-1)` of the speculated token never finds a group to forget and returns without touching
        the index (the check reads counts that a concurrent `extend` only raises, and only below that end). A crop
        that does forget groups (deeper than the window, between requests or by a user) takes the index lock, so it
        waits for a running `extend` and the two never interleave.
        """
        def doomed(row: int) -> bool:
            first = self.group_first[row]
            return first >= length or (first >= 0 and self.n_groups[row] > (length - first) // GROUP)

        if not any(doomed(row) for row in range(len(self.group_first))):
            return
        with self._lock:
            for row, first in enumerate(self.group_first):
                if first >= length:
                    self.group_first[row], self.n_groups[row] = -1, 0
                elif first >= 0:
                    self.n_groups[row] = min(self.n_groups[row], (length - first) // GROUP)
            self._changed()

    def share(self) -> None:
        """Copy the stored sequence's index to every sequence of the batch that now continues it (the store keeps
        the prefix's K/V once; each sequence's index grows on its own from here). The copies (the index as allocated,
        every row) are checked against the host-memory limit before the request starts
        (`DualDecoderCache.begin_request`)."""
        batch = self.store.shape_prefix[0]
        if self.packed is not None:  # allocate (and claim) first: a HostMemoryError leaves the index as it was
            self.claim_host((batch - 1) * (self.packed[0].nbytes + self.params[0].nbytes))
            lines = self._codes(batch, self._lines.shape[3])
            params = host_tensor((batch, *self.params.shape[1:]), torch.bfloat16)
            lines.copy_(self._lines.expand_as(lines))
            params.copy_(self.params.expand_as(params))
            self._lines, self.params = lines, params
        self.group_first = self.group_first[:1] * batch
        self.n_groups = self.n_groups[:1] * batch
        self._changed()

    def key_bytes_read(self, end: int, budget: int) -> tuple[int, int]:
        """The codes and parameters of every complete group, then the shortlisted and uncovered keys whole; all of
        it read per sequence (each sequence scans its own copy of the index, also after `share`)."""
        kv_heads, dim, element = self.store.shape_prefix[1], self.store.head_dim, self.store.element_size
        groups, shortlisted = end // GROUP, self.shortlist_for(budget)
        if shortlisted >= groups * GROUP:
            return super().key_bytes_read(end, budget)
        codes = kv_heads * groups * (self.quads * 64 + self.dim_q * 4)  # chosen quads' codes; every parameter
        return 0, codes + kv_heads * (shortlisted + end - groups * GROUP) * dim * element

    def select(self, query: torch.Tensor, candidates: Candidates, scaling: float,
               budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._select(query, candidates, scaling, None, budget)

    def select_into(self, query: torch.Tensor, candidates: Candidates, scaling: float, budget: int,
                    out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._select(query, candidates, scaling, out, budget)

    def _select(self, query, candidates, scaling, out, budget):
        rows = candidates.ids
        batch = self.store.shape_prefix[0]
        if len(rows) != query.shape[0] or rows and (min(rows) < 0 or max(rows) >= batch):
            raise ValueError(f"Sequences {rows} are not {query.shape[0]} sequences of this store's batch of {batch}.")
        query = query if query.dtype == torch.float32 else query.float()
        return engine.select(query, candidates.mask, self._chunks(out is not None),
                             budget, scaling, self._index_view(), self.shortlist_for(budget), self.quads, out=out,
                             rows=None if candidates.sequences is None else rows)

    def _index_view(self) -> engine.IndexView | None:
        """The index as the engine reads it (rebuilt after a change of the index, `_changed`)."""
        view = self._view
        if view is None and self.packed is not None:
            view = self._view = engine.IndexView(self.packed, self.params, torch.tensor(self.group_first),
                                                 torch.tensor(self.n_groups))
        return view

    def _chunks(self, gather: bool) -> engine.Chunks:
        """Every allocated key chunk (and value chunk, to gather) of the store, laid out for the engine once per
        growth of the store (chunks are only ever added; positions past a step's `end` are never read)."""
        store = self.store
        key = (store.capacity, store.shared_length, store.shape_prefix, gather)
        prepared = self._prepared
        if prepared is None or prepared[0] != key:
            values = store.value_chunks(store.capacity) if gather else None
            prepared = self._prepared = (key, engine.chunks(store.key_chunks(store.capacity), values))
        return prepared[1]

    @property
    def host_bytes(self) -> int:
        return 0 if self._lines is None else self._lines.nbytes + self.params.nbytes

    def free(self) -> None:
        self._lines = self.params = None
        self._prepared = None  # its views would keep the store's chunks alive
        self._changed()
        self.n_groups = [0] * len(self.n_groups)
        self.group_first = [-1] * len(self.group_first)
