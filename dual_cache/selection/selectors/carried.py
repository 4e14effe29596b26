"""`selector="carried"` (the default): the `lowbit` scan every `rescan_interval` steps, and in between an exact
rescoring of a pool of positions carried from the last scan plus the positions appended since.

Per (sequence, KV head) a scan step runs the `lowbit` selection (2-bit scan of every key's code, shortlist of
`lowbit_factor × budget`, exact stage) and keeps the `carried_factor × budget` positions of highest exact attention
mass among those it rescored (`engine.CarriedPool`). Until that task's next scan, a step reads no code: it rescores
exactly the pool's positions plus every position appended since the scan (so keys written during decode are always
selectable), and takes the `budget` best, as the scan step's exact stage would among them. A task scans again when
`rescan_interval` of its selections have passed, when its GQA group's query has moved (cosine to the query of its
last scan below `rescan_cosine`), or when it selects below the end its last scan saw. A crop of the store
(`truncate`) makes the positions from the crop on fresh again: the pool's entries past it are dropped and what is
appended later is rescored whole until the next scan. This is the reusable selector of
LServe (Yang et al., 2025, §4.3: select every C steps) with FreeKV's early correction of the heads whose query moved
(Liu et al., 2025: query cosine threshold); the carried shortlist rescored between selections is this project's
choice, measured in results/selection/carried-recall/.

A layer's first scans are staggered (`1 + (layer + KV head) % rescan_interval` selections after the first), so the
layers of a model do not all scan in the same step. With `rescan_interval` 1 every step scans: the selections equal
`lowbit`'s (tests/test_carried_selector.py holds the two together).
"""

from __future__ import annotations

import contextlib
import numbers
import threading

import torch

from ... import engine
from ...host.pages import host_tensor
from ...runtime.sync_points import uncounted
from .lowbit import LowBitSelector


@contextlib.contextmanager
def _plain_tensors():
    """The selector's state is updated in place from whichever thread selects, inside `generate`'s inference mode
    or not: it is made of (and its results are) normal tensors, not inference tensors, and nothing is recorded for
    autograd."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class CarriedSelector(LowBitSelector):
    """`lowbit` scans every `rescan_interval` selections per (sequence, KV head); a carried pool rescored between."""

    name = "carried"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._tally = [0, 0]  # scans and pooled selections of pools since dropped
        self._pool: engine.CarriedPool | None = None  # allocated at the first select (its size is the budget's)
        self._state_lock = threading.Lock()

    @classmethod
    def check_config(cls, config) -> None:
        super().check_config(config)
        interval = config.rescan_interval
        if isinstance(interval, bool) or not isinstance(interval, numbers.Integral) or not 1 <= interval < 2**62:
            raise ValueError(f"`rescan_interval` must be an int in [1, 2**62) (selections between full scans of the key "
                             f"index; 1 scans every step), got {interval!r}.")
        config.rescan_interval = int(interval)
        cosine = config.rescan_cosine
        if cosine is not None:
            if isinstance(cosine, bool) or not isinstance(cosine, numbers.Real) or not -1 <= cosine <= 1:
                raise ValueError(f"`rescan_cosine` must be None or a number in [-1, 1] (a task whose query's cosine "
                                 f"to its last scan's falls below it scans again), got {cosine!r}.")
            config.rescan_cosine = float(cosine)
        factor = config.carried_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Integral) or factor < 1:
            raise ValueError(f"`carried_factor` must be an int >= 1 (positions carried between scans per KV head, "
                             f"as a multiple of the budget), got {factor!r}.")
        config.carried_factor = int(factor)

    @classmethod
    def host_bytes_for(cls, config, tokens: int, kv_heads: int, head_dim: int, element_size: int) -> int:
        """The 2-bit index (`lowbit`'s) plus, per KV head, the pool's positions and schedule and one query (of up to
        8 query heads per KV head; a wider GQA group's pool is claimed when allocated). No pool where the budget
        takes every token (its selections take every candidate and keep nothing)."""
        index = super().host_bytes_for(config, tokens, kv_heads, head_dim, element_size)
        if config.budget >= tokens or config.rescan_interval == 1:
            return index
        slots = min(config.carried_factor * config.budget, tokens)
        return index + kv_heads * (8 * (slots + 5) + 4 * 8 * head_dim)

    @property
    def tasks_scanned(self) -> int:
        """(sequence, KV head) selections so far that scanned every key's code."""
        return self._tally[0] + self._pool_tally(0)

    @property
    def tasks_pooled(self) -> int:
        """(sequence, KV head) selections so far that rescored their carried pool."""
        return self._tally[1] + self._pool_tally(1)

    def _pool_tally(self, column: int) -> int:
        pool = self._pool
        if pool is None:
            return 0
        with uncounted():  # a host tensor: reading it never waits for a device
            return int(pool.tally[..., column].sum())

    def key_bytes_read(self, end: int, budget: int) -> tuple[int, int]:
        """Averaged over this selector's selections so far (before any: one scan per `rescan_interval`): a scan
        reads what `lowbit` reads; a pooled selection the `carried_factor × budget` carried keys and the fresh ones
        (half the selections between two scans, on average). The share that scans is data-dependent (`tasks_scanned`, `tasks_pooled`)."""
        scanned, gathered = super().key_bytes_read(end, budget)
        if budget >= end or self.config.rescan_interval == 1:
            return scanned, gathered
        total = self.tasks_scanned + self.tasks_pooled
        share = self.tasks_scanned / total if total else 1 / self.config.rescan_interval
        kv_heads, dim, element = self.store.shape_prefix[1], self.store.head_dim, self.store.element_size
        fresh = min(self.config.rescan_interval, 1 / share) / 2  # selections since the scan, on average
        pooled = kv_heads * (self.config.carried_factor * budget + fresh) * dim * element
        return round(share * scanned), round(share * gathered + (1 - share) * pooled)

    def __getstate__(self) -> dict:  # copies (a closed cache's deepcopy) get a lock of their own
        state = super().__getstate__()
        del state["_state_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._state_lock = threading.Lock()

    def _pool_for(self, budget: int, query_width: int) -> engine.CarriedPool:
        """The pools for this budget and GQA group, (re)allocated empty where the budget, the group or the store's
        batch changed (every task then scans at its next selection)."""
        batch, kv_heads = self.store.shape_prefix
        slots = self.config.carried_factor * budget
        pool = self._pool
        if pool is not None and tuple(pool.positions.shape) == (batch, kv_heads, slots) \
                and pool.query.shape[2] == query_width:
            return pool
        self.drop_pools()
        self.claim_host(batch * kv_heads * (8 * (slots + 5) + 4 * query_width))
        with _plain_tensors():
            tally = lambda *shape: host_tensor(shape, torch.long).zero_()  # noqa: E731
            self._pool = engine.CarriedPool(
                host_tensor((batch, kv_heads, slots), torch.long), tally(batch, kv_heads), tally(batch, kv_heads),
                tally(batch, kv_heads), host_tensor((batch, kv_heads, query_width), torch.float32),
                tally(batch, kv_heads, 2), self.config.rescan_interval, self.config.rescan_cosine, self.phase)
        return self._pool

    def drop_pools(self) -> None:
        """Free the pools (their counts kept in `tasks_scanned` / `tasks_pooled`); every task scans next."""
        if self._pool is not None:
            self._tally = [self.tasks_scanned, self.tasks_pooled]
            self._pool = None

    def _select(self, query, candidates, scaling, out, budget):
        if budget >= candidates.end or self.config.rescan_interval == 1:  # every candidate fits, or every step scans
            return super()._select(query, candidates, scaling, out, budget)
        rows = candidates.ids
        batch = self.store.shape_prefix[0]
        if len(rows) != query.shape[0] or rows and (min(rows) < 0 or max(rows) >= batch):
            raise ValueError(f"Sequences {rows} are not {query.shape[0]} sequences of this store's batch of {batch}.")
        query = query if query.dtype == torch.float32 else query.float()
        with self._state_lock, _plain_tensors():
            pool = self._pool_for(budget, query.shape[1] // self.store.shape_prefix[1] * query.shape[2])
            return engine.select(query, candidates.mask, self._chunks(out is not None), budget, scaling,
                                 self._index_view(), self.shortlist_for(budget), self.quads, out=out,
                                 rows=None if candidates.sequences is None else rows, pool=pool)

    def truncate(self, length: int) -> None:
        """`lowbit`'s; positions from `length` on are fresh again for every task (rescored whole until its next scan:
        what is appended after the crop was never in a pool)."""
        super().truncate(length)
        with self._state_lock, _plain_tensors():
            if self._pool is not None:
                self._pool.fresh_from.clamp_(max=length)

    def adopt(self, sources, length, first_real) -> None:
        super().adopt(sources, length, first_real)
        with self._state_lock:
            self.drop_pools()

    def share(self) -> None:
        super().share()
        with self._state_lock:
            self.drop_pools()

    def free(self) -> None:
        super().free()
        with self._state_lock:
            self.drop_pools()

    @property
    def host_bytes(self) -> int:
        pool = self._pool
        extra = 0 if pool is None else sum(t.nbytes for t in (pool.positions, pool.counts, pool.due, pool.fresh_from,
                                                               pool.query, pool.tally))
        return super().host_bytes + extra
