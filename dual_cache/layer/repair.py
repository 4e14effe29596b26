"""Miss repair (docs/design.md §2): which sequences a decode step re-selects with the real token's own query, decided
once per step on the host from what it already knows — the tokens it sampled — never per layer from the device.

A sequence whose speculated token differed from the real one (and every sequence on the first decode step, whose
entries the prompt's last position chose) is re-selected in every layer where its candidates outnumber the budget,
synchronously, with the real token's query: the layer waits for the host (`DualLayer.repair_selection`), which is
what restores exact-top-k quality on the steps a wrong guess chose for (`results/needle/4k.md`: 7 of 16 needles
without it, 13 of 16 with it, as dense). A sequence whose guess hit is re-selected only in the layers where its real
query drifted from the speculated query that chose its entries (`repair_drift`); that check reads a flag per layer
back from the device, so on CUDA it runs by default only in steps that repair a miss anyway (they wait per layer
already) and steady-state steps — every guess a hit, as under greedy decoding once one guess hits — never wait for
the host inside the layers. On a CPU device (no waits to save) it runs on every step (`drift_on_hit_steps`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.streams import to_host_list


@dataclass(frozen=True)
class StepRows:
    """The sequences a decode step re-selects with the real token's query (indices into the batch, ascending).

    Attributes:
        repair: re-selected in every layer (a miss, or the first step).
        check: re-selected in the layers where their query drifted (`repair_drift`).
        live: the sequences still generating (`repair` and `check` are among them).
        batch: sequences of the step.
        first: the request's first decode step (the prompt's last position chose its entries).
        agree: under tensor parallelism, turns this rank's `(B,)` bool device drift flags into "drifted in a KV head
            of any rank" (`TensorShard.any_rank`, a collective), so every rank repairs the sequences one process
            would; None without it (`DualDecoderCache.begin_step` sets it).
    """

    repair: tuple[int, ...] = ()
    check: tuple[int, ...] = ()
    live: tuple[int, ...] = ()
    batch: int = 0
    first: bool = False
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None


class RepairPolicy:
    """Miss and drift repair for a request's decode steps.

    Args:
        enabled: repair at all (`DualDecoderConfig.miss_repair`, with a two-token speculator).
        drift: `DualDecoderConfig.repair_drift` (None: no drift checks).
        device: where the model runs.
        drift_on_hit_steps: `DualDecoderConfig.drift_on_hit_steps`: check drift in steps without a miss too; None:
            on a CPU device yes, on CUDA no (a check waits for the device per layer).
    """

    def __init__(self, enabled: bool, drift: float | None, device: torch.device,
                 drift_on_hit_steps: bool | None = None) -> None:
        self.enabled = enabled
        self.drift = drift
        self.drift_on_hit_steps = torch.device(device).type != "cuda" if drift_on_hit_steps is None else \
            drift_on_hit_steps

    def rows(self, live: list[bool], hit: list[bool] | None) -> StepRows:
        """The step's repairs, from host values: `live` (per sequence, still generating) and `hit` (per sequence,
        whether the speculated token that chose this step's entries equalled the real one; None on the first decode
        step)."""
        batch, alive = len(live), tuple(i for i, on in enumerate(live) if on)
        if not self.enabled:
            return StepRows(live=alive, batch=batch, first=hit is None)
        if hit is None:
            return StepRows(alive, (), alive, batch, True)
        repair = tuple(i for i in alive if not hit[i])
        check = ()
        if self.drift is not None and (self.drift_on_hit_steps or repair):
            check = tuple(i for i in alive if hit[i])
        return StepRows(repair, check, alive, batch)


def query_drift(query: torch.Tensor, chooser: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Relative distance between a token's query and the query that chose its entries, per sequence.

    Args:
        query: `(B, H_q, D)` the real token's query at one layer (any float dtype, any device).
        chooser: `(B, H_q, D)` the query that selected the entries it attends to (the speculated token's).
        kv_heads: `H_kv`; the query heads of one KV head (its GQA group) are compared as one `G·D` vector.

    Returns:
        `(B,)` float32 on `query`'s device: the largest over KV heads of `‖q − q̂‖₂ / ‖q‖₂` (0 for equal queries;
        huge or inf for a zero query with a non-zero `chooser`).
    """
    batch = query.shape[0]
    real = query.float().reshape(batch, kv_heads, -1)
    diff = (real - chooser.float().reshape(batch, kv_heads, -1)).norm(dim=-1)
    return (diff / real.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)).amax(dim=-1)


def rows_to_repair(real_query: torch.Tensor, chooser: torch.Tensor | None, rows: StepRows, threshold: float | None,
                   kv_heads: int) -> tuple[list[int], list[int]]:
    """The sequences a layer re-selects with `real_query` `(B, H_q, D)`: `rows.repair`, plus the `rows.check`
    sequences whose query drifted from `chooser` (the query that chose the entries; `repair_drift` at `threshold`;
    one device→host read of a `(B,)` flag, only when there are such rows). Returns `(repair, drifted)`: ascending
    indices, and those of them added for drift."""
    if not rows.check or threshold is None or chooser is None:
        return list(rows.repair), []
    chooser = chooser.to(real_query.device, non_blocking=True)
    flags = query_drift(real_query, chooser, kv_heads) >= threshold
    if rows.agree is not None:  # tensor parallelism: this rank holds some of the KV heads
        flags = rows.agree(flags)
    far = to_host_list(flags)
    drifted = [i for i in rows.check if far[i]]
    return sorted(set(rows.repair) | set(drifted)), drifted
