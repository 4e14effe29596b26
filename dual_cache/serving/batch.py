"""The running batch of the serving scheduler: requests are prefilled on caches of their own, one chunk at a time,
then decode together as the rows of one `DualDecoderCache` that gains and loses rows between decode steps.

Each decode step is the dual-token step of `decoding.dual_sample` (docs/design.md §2) over rows with their own
positions, speculation state, sampling options and stops: feed `[x_t, x̂_{t+1}]` per row, keep the real token's K/V
(`crop(-1)`), re-select the entries of rows whose speculated token missed (or that just joined, as `generate()`
re-selects on its first step). Rows join and leave through `regroup` (`dual_cache/cache/regroup.py`): the batch's request
ends, a new cache is built from the rows that stay and the requests that finished their prefill, and the next step
continues each row exactly where it was (its queries select its next entries, its sequence is unchanged). A
regroup copies the rows' host K/V (its cost grows with the batch's stored tokens; docs/serving.md).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..cache.cache import DualDecoderCache
from ..cache.checks import check_model_serves_dual
from ..cache.regroup import regroup
from ..config import DualDecoderConfig
from ..generate.step import DualStep
from ..model.inputs import cache_kwarg_name
from ..runtime.streams import to_device, to_host
from .rows import Row


class DualBatch:
    """Rows decoding together on one `DualDecoderCache`, and the prefill of the requests that will join them.

    Args:
        model: the causal LM (on its device, in eval mode). config: every request's `DualDecoderConfig`.
        pad_id: token fed to rows that finished and await the next regroup. eos_ids: end-of-sequence ids.
        decode: token ids → text (the tokenizer's), for stop strings; None without a tokenizer.

    Attributes:
        cache: the batch's cache (None while no row decodes). rows: the rows of `cache`, in order.
    """

    def __init__(self, model, config: DualDecoderConfig, pad_id: int, eos_ids: set[int],
                 decode: Callable[[list[int]], str] | None) -> None:
        self.model, self.config, self.pad_id, self.eos_ids, self.decode = model, config, pad_id, eos_ids, decode
        self.cache_arg = cache_kwarg_name(model)
        self.device = next(model.parameters()).device
        self.dual_step = DualStep(model, config)
        self.cache: DualDecoderCache | None = None
        self.rows: list[Row] = []
        self.mask: torch.Tensor | None = None  # (B, n) int64 on the device: 1 at each row's real positions
        self.spec_hits = self.spec_steps = 0  # speculated tokens equal to the real one / speculated, every step

    def _forward(self, cache: DualDecoderCache, tokens: torch.Tensor, mask: torch.Tensor | None,
                 positions: torch.Tensor, keep: int):
        return self.model(input_ids=tokens.to(self.device), attention_mask=None if mask is None else
                          mask.to(self.device), position_ids=positions.to(self.device), use_cache=True,
                          logits_to_keep=keep, dual_cache=cache.prefill_call(), **{self.cache_arg: cache})

    # --- prefill (one request, on its own cache) -----------------------------------------------------------
    def prefill_chunk(self, row: Row) -> str:
        """Feed the row's next prompt chunk (`prefill_chunk_size` tokens) to its own cache.

        Returns `"more"`; `"prefix"` when the prefill paused at `row.prefix_end` (the cache's request ended there,
        holding exactly the prompt's whole blocks, for the prefix cache; the next call continues it); or `"done"`
        after the last chunk: the row's first token was picked and streamed and the cache's request ended (the
        row then waits to join the batch).

        Raises:
            ValueError / HostMemoryError: from the cache (a prompt it cannot continue, no host memory), before
            the first chunk's work.
        """
        if row.cache is None:  # a fresh cache (its layer types are fitted to the request below)
            row.cache = DualDecoderCache(self.model.config, dual_config=self.config)
            row.cache.check_model(self.model)  # under tensor parallelism: this rank's KV heads
        cache, prompt, total = row.cache, row.handle.prompt, row.prompt_len + row.handle.options.max_tokens + 1
        with torch.inference_mode():
            if not cache.request_running:  # the first chunk (or the first after a pause): begin the cache's request
                stored = cache.get_seq_length()
                if stored:
                    cache.check_continuation(prompt[None], row.prompt_len)
                else:
                    cache.fit_layers(total)
                    check_model_serves_dual(self.model, cache, self.cache_arg,
                                            {"input_ids": prompt[None, -1:].to(self.device)})
                cache.begin_request(1, total, self.model.dtype, self.device, None, row.prompt_len)
                if row.prefilled == 0:
                    row.stored = row.prefilled = stored
            start = row.prefilled
            end = min(start + row.prefill_tokens(self.config.prefill_chunk_size),
                      row.prefix_end if start < row.prefix_end else row.prompt_len)
            outputs = self._forward(cache, prompt[None, start:end], None, torch.arange(start, end)[None],
                                    0 if row.wants_prompt_logits else 1)  # 0: every position's (echo, logprobs)
            if row.wants_prompt_logits:
                row.take_prompt_logits(outputs.logits[0], start)
            cache.crop(0)  # sliding-window layers drop what falls out of their window
            row.prefilled = end
            if end == row.prefix_end:
                cache.end_request(prompt[None, :end])
                return "prefix"
            if end < row.prompt_len:
                return "more"
            logits = outputs.logits[0, -1].to("cpu", torch.float32)
        cache.end_request(prompt[None])
        row.emit(row.pick(logits), self.decode, self.eos_ids)
        return "done"

    # --- the batch ------------------------------------------------------------------------------------------
    def regroup(self, joining: list[Row]) -> tuple[list[tuple[Row, DualDecoderCache | None]], list[tuple[Row, str]]]:
        """Between steps: rows that finished leave, `joining` rows (prefilled, not finished) join.

        A row whose sequence cannot be regrouped (`regroup` raises for it alone) is dropped from the batch and
        reported; when every row can be regrouped alone but not all together (host memory), the joining rows are
        dropped; the others decode on either way.

        Returns:
            `(row, cache)` for each row that left (a session row gets its own one-sequence cache back, its stored
            tokens for the session's next request; other rows None), and `(row, message)` for each row dropped by a
            failed regroup (its request has failed; the caller finishes it). Every cache this replaces is closed.

        Raises:
            Exception: when even the rows that regroup alone cannot form the new batch (the batch is lost).
        """
        old, old_rows = self.cache, self.rows
        staying = [(i, row) for i, row in enumerate(old_rows) if not row.done]
        leaving = [(i, row) for i, row in enumerate(old_rows) if row.done]
        left: list[tuple[Row, DualDecoderCache | None]] = []
        try:
            if old is not None:
                old.end_request(self._sequences(old_rows, old.get_seq_length()))
            for i, row in leaving:
                kept = None
                if row.session is not None and row.handle.error is None:  # finished or cancelled: kept
                    kept = regroup([(old, i)])
                left.append((row, kept))
            members = [(row, (old, i)) for i, row in staying] + [(row, (row.cache, 0)) for row in joining]
            self.cache, failed = _regroup_rows(members, joining)
        finally:
            for cache in [old] + [row.cache for row in joining]:
                if cache is not None:
                    cache.close()
            for row in joining:
                row.cache = None
        dropped = {row for row, _ in failed}
        self.rows = [row for row, _ in members if row not in dropped]
        if self.cache is None:
            self.mask = None
            return left, failed
        self.mask = to_device(self.cache.sequences.valid.long(), self.device)
        axis = self.cache.get_seq_length()
        tokens = axis + max(r.handle.options.max_tokens - len(r.handle.token_ids) for r in self.rows) + 2
        self.cache.begin_request(len(self.rows), tokens, self.model.dtype, self.device, self.mask, axis)
        self.cache.end_prefill()  # no prefill: fills the sink and window tiers, selects with the rows' next queries
        return left, failed

    def _sequences(self, rows: list[Row], axis: int) -> torch.Tensor:
        """`(B, axis)` token ids of the rows' fed positions, right-aligned (pad ids on the left)."""
        out = torch.full((len(rows), axis), self.pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            fed = row.tokens[:-1][-axis:]
            out[i, axis - len(fed):] = fed
        return out

    def step(self) -> None:
        """One dual decode step of every row (`step.DualStep`): feed each row's pending token (and its speculated
        one), then pick, stream and stop-check each live row's next token on the host (one read of the step's
        logits)."""
        cache, rows, step = self.cache, self.rows, self.dual_step
        live = [not row.done for row in rows]
        real = [row.pending if on else self.pad_id for row, on in zip(rows, live)]
        if step.tokens_per_forward == 2:
            self._propose(rows)
        speculated = [row.speculated for row in rows] if step.tokens_per_forward == 2 else None
        hit = [bool(row.last_hit) for row in rows]  # a row on its first step (None) is re-selected as a miss is
        with torch.inference_mode():
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(rows), 1)], dim=1)
            step_mask = torch.cat([self.mask, self.mask.new_ones(len(rows), step.tokens_per_forward - 1)], dim=1)
            step_logits, spec_logits, _ = step.forward(cache, real, speculated, [row.length - 1 for row in rows],
                                                       step_mask, live, hit)
            logits = to_host(step_logits if spec_logits is None else torch.stack([step_logits, spec_logits], 1))
        outcomes: list[bool | None] = [None] * len(rows)  # per row: its speculated token hit, missed, or none
        for i, row in enumerate(rows):
            if row.done:
                continue
            token = row.pick(logits[i] if spec_logits is None else logits[i, 0])
            if speculated is not None:
                row.last_hit = outcomes[i] = token == row.speculated
                row.guess = row.speculate(logits[i, 1])
            row.emit(token, self.decode, self.eos_ids)
        cache.record_speculation(outcomes)
        self.spec_hits += sum(outcome is True for outcome in outcomes)
        self.spec_steps += sum(outcome is not None for outcome in outcomes)

    def _propose(self, rows: list[Row]) -> None:
        """Set each row's speculated next token (`DualStep.propose` on the live rows' own sequences, in one call
        keyed by the rows, so the speculator's per-row state follows each request; finished rows get pads)."""
        live = [row for row in rows if not row.done]
        proposed = self.dual_step.propose([row.tokens for row in live], [row.guess for row in live],
                                          [row.last_hit for row in live], rows=live)
        for row, token in zip(live, proposed):
            row.speculated = token
        for row in rows:
            if row.done:
                row.speculated = self.pad_id

    def memory(self, caches: list[DualDecoderCache]) -> dict[str, int]:
        """Device and host bytes held now by the batch's cache and `caches` (the prefilling rows')."""
        device = host = 0
        for cache in [self.cache, *caches]:
            if cache is not None:
                device += cache.held_device_bytes
                host += int(cache.stats()["host_bytes"])
        return {"device_bytes": device, "host_bytes": host}

    def close(self) -> None:
        """Close the batch's cache (its rows are the caller's to finish)."""
        if self.cache is not None:
            self.cache.close()
        self.cache, self.rows, self.mask = None, [], None


def _regroup_rows(members: list[tuple[Row, tuple[DualDecoderCache, int]]],
                  joining: list[Row]) -> tuple[DualDecoderCache | None, list[tuple[Row, str]]]:
    """`regroup` of the members' `(cache, row)` sources into one cache; when it fails, the rows that caused it are
    left out: those whose sequence fails to regroup alone, or, when each regroups alone, the joining rows (the
    combination does not fit). Returns the new cache (None without members) and `(row, message)` per row left
    out; raises when the remaining rows still fail together."""
    if not members:
        return None, []
    try:
        return regroup([source for _, source in members]), []
    except Exception as together:  # noqa: BLE001 - narrowed to the rows it concerns below
        failed = []
        for row, source in members:
            try:
                regroup([source]).close()
            except Exception as alone:  # noqa: BLE001 - this row's own failure
                failed.append((row, f"{type(alone).__name__}: {alone}"))
        if not failed:
            failed = [(row, f"{type(together).__name__}: {together}") for row, _ in members if row in joining]
        if not failed:
            raise
        dropped = {row for row, _ in failed}
        kept = [source for row, source in members if row not in dropped]
        return (regroup(kept) if kept else None), failed
