"""`DualLayer`: one full-attention layer of a `DualDecoderCache` — every K/V in a host store, and on the device only
the sink, the local window and the resident set of selected entries kept across steps (docs/design.md §2).

A layer gets what it needs when it is built (its budget, the shared `SequenceState`, the cache's `HostMemory`
allowance), per request (`begin_request`: the schedule, and the request's shape, `RequestShape`: its budgets, the
resident set's capacity, the window ring, the tokens to reserve) and per step as arguments (`begin_attention(...,
rows)`); it never refers back to the cache that holds it. What a request leaves for the next one over the same
sequences is one `RequestCarry` (the query that selects the next first step, the positions last attended, the resident
set's mirror, the softmax scale), which `regroup` hands to a new layer whole (`adopt`). Its decode protocol is two
calls around the attention kernel: `begin_attention` (apply this step's delta to the resident set, repair if asked,
choose what to attend) and `end_attention` (release the delta buffer, submit the next step's selection with what this
step hands it: a `Handoff`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import DualDecoderConfig
from ..host.memory import HostMemory
from ..host.store import HostKVStore
from ..kernels import KVSegment
from ..runtime.sync_points import uncounted
from ..selection.candidates import Candidates, compact_positions
from ..selection.rerank import top_entries
from ..selection.selectors import SELECTORS, Selector
from ..transfer.delta import Delta
from ..transfer.resident_set import ResidentSet
from ..transfer.schedule import TransferSchedule
from .repair import StepRows, rows_to_repair
from .request import RequestCarry, RequestShape
from .sequences import SequenceState


class Handoff(NamedTuple):
    """What one decode step hands the next, travelling with the retrieval job (`TransferSchedule.submit` /
    `acquire`).

    Attributes:
        query: `(B, H_q, D)` the query that chose the next step's entries (the speculated token's; the prompt's last
            on a request's first step); any device.
        attended: `(B, H_kv, k)` int64 positions the real token attended most in the step (-1: none), whose next
            positions the next selection adds (`fetch_next`); None when not tracked.
    """

    query: torch.Tensor
    attended: torch.Tensor | None = None


class StepAttention(NamedTuple):
    """What `begin_attention` returns: the segments the kernel reads, and what `end_attention` needs.

    Attributes:
        segments: sink, resident set, window ring (read in place).
        attended: `(B, H_kv, k)` int64 positions the real token attends most (-1: none), or None.
    """

    segments: list[KVSegment]
    attended: torch.Tensor | None


class DualLayer(CacheLayerMixin):
    """One full-attention layer: host store of every K/V plus device-resident sink, window ring and selection.

    Device tiers (B = batch, H_kv = KV heads, D = head dim), held only while a request decodes:
      - sink: `(B, H_kv, n_sink, D)`, the first `n_sink` real tokens of each sequence;
      - window ring: `(B, H_kv, window + 2, D)`, slot `p % (window + 2)` holds position p; the last `window`
        committed tokens plus the (up to two) tokens of the running step;
      - resident set: `(B, H_kv, C, D)` entries kept across steps (`resident_set.ResidentSet`; C = the request's
        `shape.capacity`), of which each step copies only those its selection wants and the set lacks (the delta);
      - whatever the selector keeps there (`Selector.device_bytes`; only the Quest baseline's page metadata).

    The layer's `Selector` (`config.selector`) owns any host-side index; the layer extends it after each prefill
    chunk and submits its retrieval jobs (the selector's choice, the resident set's plan, the gather of the delta) to
    the schedule. `update()` appends new K/V to the host store (and the ring once decoding) and returns them
    unchanged: the dual attention function reads the tiers through `prefill_kv()` and `begin_attention()`.

    Args:
        layer_idx: the model layer.
        config: the cache's `DualDecoderConfig`.
        budget: entries this layer retrieves per step and KV head (tokens; 0: sink and window only).
        sequences: the cache's `SequenceState` (which positions are real, the sink), read-only here.
        host_memory: the cache's host-memory allowance; every host allocation is claimed from it.
    """

    is_sliding = False
    is_croppable = True

    def __init__(self, layer_idx: int, config: DualDecoderConfig, budget: int, sequences: SequenceState,
                 host_memory: HostMemory) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.budget = budget
        self.sequences = sequences
        self.host_memory = host_memory
        self.host: HostKVStore | None = None
        self.selector: Selector | None = None  # built with the host store when the layer retrieves (budget > 0)
        self.schedule: TransferSchedule | None = None  # the running request's (`begin_request`)
        self.shape = RequestShape.idle(config, budget)  # the running (or last) request's sizes (`begin_request`)
        self.carry = RequestCarry()  # what the last request left for the next one over these sequences
        self.resident: ResidentSet | None = None  # the running request's (`start_decoding`)
        self.decoding = False
        self.unstored = 0  # tokens of the running step past the real one (the speculated token): never stored
        self.sink_keys = self.sink_values = self.sink_pos = self.sink_valid = None
        self.ring_keys = self.ring_values = None

    # --- transformers CacheLayerMixin API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, dim = key_states.shape
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.host = HostKVStore(
            batch, kv_heads, dim, key_states.dtype, self.config.host_chunk_tokens,
            page_lock=key_states.device.type == "cuda", on_alloc=self.host_memory.claim,
        )
        self.host.reserve(self.shape.reserve_tokens)
        if self.budget > 0:
            self.selector = SELECTORS[self.config.selector](
                self.config, self.host, self.device, claim_host=self.host_memory.claim, phase=self.layer_idx
            )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `(B, H_kv, q, D)` new keys/values; returns them unchanged.

        In prefill they go to the host store. In a decode step all q go to the device window ring (the step attends
        to them), and only the first — the real token; the others are the speculated token, which `crop` removes
        after the forward — goes to the host store, without a host wait (`HostKVStore.stage`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.decoding:
            self.host.append(key_states, value_states)
            return key_states, value_states
        start, q, ring_size = self.get_seq_length(), key_states.shape[2], self.shape.ring_size
        slot = start % ring_size
        if slot + q <= ring_size:
            self.ring_keys[:, :, slot : slot + q] = key_states
            self.ring_values[:, :, slot : slot + q] = value_states
        else:
            slots = torch.arange(start, start + q, device=self.device) % ring_size
            self.ring_keys.index_copy_(2, slots, key_states)
            self.ring_values.index_copy_(2, slots, value_states)
        self.host.stage(key_states[:, :, :1], value_states[:, :, :1], self.schedule.streams)
        self.unstored += q - 1
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0 if self.host is None else self.host.length + self.unstored

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise `ValueError` for a crop this layer refuses (`SequenceState.check_crop`: a positive count; between
        requests, one into the sink or leading pads); nothing is changed."""
        self.sequences.check_crop(tokens_to_remove, self.get_seq_length(), self.schedule is None)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (negative counts only, as transformers ≥5.22), after
        `check_crop`."""
        self.check_crop(tokens_to_remove)
        if tokens_to_remove == 0 or self.host is None:
            return
        unstored = min(-tokens_to_remove, self.unstored)  # the step's speculated token: never stored
        self.unstored -= unstored
        if -tokens_to_remove > unstored:
            self.host.crop(-tokens_to_remove - unstored)
            if self.selector is not None:
                self.selector.truncate(self.host.length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError(
            "DualDecoderCache cannot reorder sequences (beam search). Use num_beams=1 with cache_implementation='dual'."
        )

    def reset(self) -> None:
        self.free()
        self.host = None
        self.selector = None
        self.decoding = False
        self.is_initialized = False

    # --- one request ---------------------------------------------------------------------------------
    def begin_request(self, schedule: TransferSchedule, tokens: int, reserve: int) -> None:
        """A request starts (its prefill comes next).

        Args:
            schedule: the request's transfer schedule (retrieval jobs and copies).
            tokens: tokens per sequence the cache will hold at most during the request: no selection or window is
                larger (`RequestShape.for_request`).
            reserve: tokens per sequence the host store should hold at once (a first request: all of `tokens`; a
                continuing one: those stored plus the new prompt).
        """
        self.schedule = schedule
        self.unstored = 0
        self.shape = RequestShape.for_request(self.config, self.budget, tokens, reserve)
        self.decoding = False
        if self.host is not None:
            self.host.reserve(reserve)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, device: torch.device, carry: RequestCarry) -> None:
        """Hold sequences moved here from other caches (`regroup`), between requests: their keys and values `(B,
        H_kv, n, D)` (host tensors; the store reserves their `n` tokens at once) and what their last requests carry to
        the next one, whole. The layer must be empty; `device` is where its attention runs."""
        self.lazy_initialization(keys[:, :, :0].to(device), values[:, :, :0].to(device))
        self.host.reserve(keys.shape[2])
        self.host.append(keys, values)
        self.carry = carry

    @property
    def exclusive(self) -> bool:
        """Whether the resident set holds exactly each step's choice (a selector that chooses at the step that uses
        it: its attention is that choice alone)."""
        return self.selector is not None and not self.selector.prefetched

    def share(self, batch: int) -> None:
        """The stored sequence becomes a prefix `batch` sequences share (`HostKVStore.share`, `Selector.share`); each
        starts from the stored sequence's resident set."""
        if self.carry.resident is not None:
            self.carry = replace(self.carry, resident=tuple(t.expand(batch, *t.shape[1:]).clone()
                                                            for t in self.carry.resident))
        if self.host is not None:
            self.host.share(batch)
        if self.selector is not None:
            self.selector.share()

    def end_request(self, pending: Handoff | None = None) -> None:
        """The request ended: release the device tiers (resident set included) and the request's schedule; the host
        store, the selector's index and the carry stay for a request that continues these sequences.

        Args:
            pending: the handoff of the selection submitted for the step that did not run (`TransferSchedule.pending`):
                its query selects the next request's first step, its attended positions continue there.
        """
        if self.decoding and pending is not None:
            attended = self.carry.attended  # no step ran: the first step's positions stand
            if pending.attended is not None:
                attended = compact_positions(pending.attended, self.shape.budget).to("cpu")
            self.carry = replace(self.carry, query=pending.query.detach().to("cpu", torch.float32), attended=attended)
        if self.decoding and self.resident is not None:
            self.carry = replace(self.carry, resident=self.resident.carried())
        self.schedule = None
        self.decoding = False
        self.sink_keys = self.sink_values = self.sink_pos = self.sink_valid = None
        self.ring_keys = self.ring_values = None
        if self.resident is not None:
            self.resident.free()
            self.resident = None

    # --- prefill ---------------------------------------------------------------------------------------
    def prefill_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of every position so far, `(B, H_kv, n, D)` on the compute device, for dense prefill.

        The chunk's own `key_states`/`value_states` `(B, H_kv, q, D)` are used as they are; earlier positions are
        read back from the host store (`HostKVStore.read_into`: contiguous blocks, asynchronous on CUDA). Each
        prompt token goes to the host once (linear in the prompt); the earlier chunks come back at every later chunk,
        `C · n(n-1)/2` tokens per layer for n chunks of C tokens: the price of holding one layer's K/V on the device
        at a time (docs/design.md, "Prefill traffic").
        """
        q = key_states.shape[2]
        past = self.host.length - q
        if past == 0:
            return key_states, value_states
        batch, kv_heads, _, dim = key_states.shape
        keys = torch.empty(batch, kv_heads, past + q, dim, dtype=key_states.dtype, device=self.device)
        values = torch.empty_like(keys)
        self.host.read_into(0, past, keys[:, :, :past], values[:, :, :past])
        keys[:, :, past:] = key_states
        values[:, :, past:] = value_states
        return keys, values

    def end_prefill_chunk(self, query: torch.Tensor, scaling: float) -> None:
        """A prefill chunk was stored: carry its last position's query `(B, H_q, D)` (it selects the first decode
        step) and the layer's softmax scale, and extend the selector's host index over the prompt so far (after the
        chunk's keys have reached host memory). A new prompt drops what an earlier request carried: the prompt's last
        token chose (its own top entries continue, `Selector.job`), and the resident set starts empty, as a fresh
        request's does."""
        self.carry = RequestCarry(query=query.detach().to("cpu", torch.float32), scaling=scaling)
        if self.selector is not None:
            self.host.wait_written()
            batch, length, start = self.host.shape_prefix[0], self.host.length, self.host.shared_length
            self.selector.extend(length, self.sequences.first_real_so_far(batch, length, start))

    # --- decode ----------------------------------------------------------------------------------------
    def start_decoding(self) -> None:
        """Fill the sink and window tiers from the host store and schedule the first step's selection."""
        self.host.wait_written()
        n = self.host.length
        batch, kv_heads = self.host.shape_prefix
        dim = self.host.head_dim
        sequences = self.sequences
        sink_pos = sequences.sink_positions
        sink_keys, sink_values = self.host.gather(sink_pos[:, None, :].expand(batch, kv_heads, sink_pos.shape[1]))
        self.sink_keys, self.sink_values = sink_keys.to(self.device), sink_values.to(self.device)
        self.sink_pos = sink_pos[:, None, :].to(self.device)  # (B, 1, n_sink)
        self.sink_valid = sequences.sink_valid[:, None, :].to(self.device)
        # window ring: the last `window` positions (ring slot p % ring_size)
        ring_size = self.shape.ring_size
        self.ring_keys = torch.zeros(batch, kv_heads, ring_size, dim, dtype=self.dtype, device=self.device)
        self.ring_values = torch.zeros_like(self.ring_keys)
        first_pos = max(0, n - self.config.window)
        slots = torch.arange(first_pos, n, device=self.device) % ring_size
        keys = torch.empty(batch, kv_heads, n - first_pos, dim, dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        self.host.read_into(first_pos, n, keys, values)
        self.ring_keys.index_copy_(2, slots, keys)
        self.ring_values.index_copy_(2, slots, values)
        self.decoding = True
        if self.selector is not None:
            self.resident = ResidentSet(batch, kv_heads, self.shape.capacity, dim, self.dtype, self.device)
            self.resident.allocate()
            carried = self.carry.resident
            self.carry = replace(self.carry, resident=None)
            if carried is not None and carried[0].shape[:2] == (batch, kv_heads) and not self.exclusive:
                end = max(0, n - self.config.window)
                self.resident.restore(*carried, self.sequences.candidates_below(end), self.host)
            if self.selector.prefetched:
                self.submit_selection(Handoff(self.carry.query, self.carry.attended), committed=n,
                                      scaling=self.carry.scaling)

    def _retrieval_job(self, query: torch.Tensor, committed: int, scaling: float, rows: list[int] | None = None,
                       exact: frozenset[int] = frozenset(), use: str = "prefetch", follow=None):
        """The retrieval job for `query` `(B, H_q, D)` (any device: copied to the host on the copy stream, the job
        waits for it) among the candidates below `committed - window`, scored with the softmax scale `scaling`: the
        selector's choice of the request's `fetch_budget` (`Selector.job`; `rows` chooses for those sequences only, a
        repair, `exact` of them by exact scoring; `follow` the host copy of the positions the real token attended),
        the resident set's plan, and the gather of the delta's K/V into the staging `Delta` it is given. Returns the
        job; it returns the `resident_set.Plan`."""
        end = max(0, committed - self.config.window)
        host_query, ready = self.schedule.query_to_host(self.layer_idx, query, use)
        candidates = Candidates(self.sequences.candidates_below(end), self.sequences.first_real)
        choose = self.selector.job(host_query, ready, candidates, scaling, self.shape.fetch_budget, self.shape.width,
                                   rows, exact, follow)
        resident, store, exclusive = self.resident, self.host, self.exclusive

        def job(staging: Delta):
            wanted = choose()
            with uncounted():  # host tensors only
                plan = resident.plan(wanted.positions, wanted.valid, rows, wanted.used, exclusive)
                count = staging.count = plan.count
                staging.slots[:count] = plan.slots
                staging.positions[:count] = plan.positions
                store.gather_rows(plan.flat_heads, plan.positions.clamp(min=0),
                                  (staging.keys[:count], staging.values[:count]))
            return plan

        return job

    def _staging_rows(self, batch: int) -> int:
        """Rows of a delta's staging: the most one step can copy per KV head — everything wanted, but never more than
        the set's slots (a plan never wants more distinct entries than the capacity), and exactly the set's slots
        when it holds each step's choice alone (new entries and emptied slots)."""
        shape = self.shape
        per_head = shape.capacity if self.exclusive else min(shape.width, shape.capacity)
        return batch * self.host.shape_prefix[1] * per_head

    def submit_selection(self, handoff: Handoff, committed: int, scaling: float) -> None:
        """Schedule the selection for the step whose committed length is `committed` tokens.

        Args:
            handoff: what the step that submits hands the next: the query `(B, H_q, D)` (any device) of the
                (speculated or real) token predicting that step, and the positions the real token attended (whose
                next positions the selection adds, `fetch_next`; None: a request's first step chooses them from the
                query's own top entries).
            committed: real tokens in the cache when that step starts; its window is `[committed - window,
                committed)` and candidates lie in `[0, committed - window)` minus sink and pads.
            scaling: the layer's softmax scale.
        """
        if self.selector is None:
            return
        batch = self.host.shape_prefix[0]
        follow = None
        if self.shape.next_budget and handoff.attended is not None:
            attended = handoff.attended
            follow = (attended, None) if attended.device.type == "cpu" and self.device.type != "cpu" else \
                self.schedule.query_to_host(self.layer_idx, attended, "attended")
        self.schedule.submit(self.layer_idx, self._retrieval_job(handoff.query, committed, scaling, follow=follow),
                             self._staging_rows(batch), self.host.head_dim, self.host.dtype, chooser=handoff)

    def repair_selection(self, query: torch.Tensor, committed: int, rows: list[int], batch: int,
                         drifted: list[int] = ()) -> None:
        """Miss repair: add the real token's own selection to the resident set of `rows`, now.

        A sequence repaired for a miss is re-selected by the layer's selector; one repaired because its query
        drifted (`repair_drift`) by exact selection over every candidate key (`Selector.select_exact`), whatever
        the selector: drift repairs are rare and are the steps where an approximate index's misses cost an answer
        (docs/host-selection-engine.md). The layer waits for the host (`TransferSchedule.repair`).

        Args:
            query: `(B, H_q, D)` the real token's query at this layer (slot 0 of the step).
            committed: real tokens in the cache before the step (as in `submit_selection`).
            rows: the sequences repaired (a miss, or a drifted query), ascending; batch: sequences of the step.
            drifted: those of `rows` repaired for drift only.
        """
        subset = None if len(rows) == batch else list(rows)
        job = self._retrieval_job(query, committed, self.carry.scaling, subset, frozenset(drifted), use="repair")
        delta = self.schedule.repair(self.layer_idx, job, list(rows), self._staging_rows(batch), self.host.head_dim,
                                     self.host.dtype, drifted=bool(drifted))
        self.resident.apply(*delta.fields())

    def begin_attention(self, query: torch.Tensor, scaling: float, rows: StepRows = StepRows(),
                        softcap: float | None = None) -> StepAttention:
        """The device-resident KV segments the running step attends to: sink, resident set, window ring.

        Applies the step's delta to the resident set (on the compute stream, after its copy). Selectors that are not
        prefetched (oracle, Quest) select with the real token's query (slot 0) here, synchronously, and so does miss
        repair for `rows`. The real token attends to every resident entry (`resident_attention="all"`) or to the
        `budget` of them with the most mass of its query (`"rerank"`, `rerank.top_entries`, on the device).

        Args:
            query: `(B, H_q, q, D)` queries of the step (q = 1 or 2).
            scaling: the layer's softmax scale.
            rows: the sequences this step repairs or checks for drift.
            softcap: the model's attention logit soft-cap, or None (used by the re-rank's scores).

        Returns:
            `StepAttention`: the `KVSegment`s (read in place; the ring segment also holds the step's q new tokens)
            and the positions the real token attends most (for `end_attention`).
        """
        q = query.shape[2]
        n = self.get_seq_length()  # includes the q new tokens
        segments = [KVSegment(self.sink_keys, self.sink_values, self.sink_pos, self.sink_valid)]
        attended = None
        selector = self.selector
        if selector is not None:
            if not selector.prefetched:  # chosen now, with the real token's query
                self.submit_selection(Handoff(query[:, :, 0]), committed=n - q, scaling=scaling)
            delta, handoff = self.schedule.acquire(self.layer_idx)
            self.resident.apply(*delta.fields())
            shape = self.shape
            if selector.repairable and not selector.selects_everything(n - q - self.config.window,
                                                                       shape.fetch_budget):
                repair, drift_only = rows_to_repair(query[:, :, 0], handoff.query, rows, self.config.repair_drift,
                                                    self.host.shape_prefix[1])
                if repair:
                    self.repair_selection(query[:, :, 0], n - q, repair, rows.batch, drift_only)
            resident = self.resident.segment()
            valid = resident.valid
            if selector.prefetched and (shape.next_budget or self.config.resident_attention == "rerank") and \
                    shape.capacity > shape.budget:
                slots, chosen = top_entries(query[:, :, 0], resident.keys, valid, shape.budget, scaling, softcap)
                attended = torch.where(chosen, torch.gather(resident.positions, 2, slots), -1)
                if self.config.resident_attention == "rerank":
                    valid = torch.zeros_like(valid).scatter_(2, slots, chosen)
            elif shape.next_budget:
                attended = torch.where(valid, resident.positions, -1)
            segments.append(resident._replace(valid=valid))
        ring_pos, ring_valid = self.sequences.ring_view(n, q, self.config.window, self.shape.ring_size, self.device)
        segments.append(KVSegment(self.ring_keys, self.ring_values, ring_pos, ring_valid))
        return StepAttention(segments, attended)

    def end_attention(self, query: torch.Tensor, step: StepAttention) -> None:
        """The running step's attention at this layer is queued: release its delta buffer and, for a prefetched
        selector, submit the next step's selection with the speculated token's query (`query` `(B, H_q, q, D)`, its
        last slot) and what the real token attended."""
        if self.selector is None:
            return
        self.schedule.release(self.layer_idx)
        if self.selector.prefetched:
            n = self.get_seq_length()
            self.submit_selection(Handoff(query[:, :, -1], step.attended), committed=n - query.shape[2] + 1,
                                  scaling=self.carry.scaling)

    # --- lifecycle (its bytes: `cache.stats.layer_device_bytes`, `layer_host_bytes`) -----------------------
    def free(self) -> None:
        """Release host chunks, the selector's state and device tiers (the token count stays readable)."""
        self.end_request()
        self.carry = RequestCarry(scaling=self.carry.scaling)
        if self.host is not None:
            self.host.free()
        if self.selector is not None:
            self.selector.free()
