"""`DualCall`: what one forward of a `DualDecoderCache` hands the dual attention of every layer it serves, as the
`dual_cache` keyword argument (transformers forwards it to each attention function; `routing.py`). The decode loop
builds it for each forward — `DualDecoderCache.prefill_call()` for a prefill chunk, `begin_step(rows)` for a decode
step — so the attention path receives the step's plan as an argument and reaches no state stored on the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from transformers.cache_utils import CacheLayerMixin

from .repair import StepRows


@dataclass(frozen=True)
class DualCall:
    """One forward's plan, read-only (what the layers do is counted where they do it: repairs by the schedule).

    Attributes:
        layers: the cache's layers, indexed by `module.layer_idx` (full-attention ones are `DualLayer`s).
        rows: in a decode step, the sequences it re-selects or checks (`StepRows`, from `RepairPolicy.rows`);
            None in a prefill.
    """

    layers: Sequence[CacheLayerMixin]
    rows: StepRows | None = None
