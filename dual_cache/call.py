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


@dataclass
class DualCall:
    """One forward's plan.

    Attributes:
        layers: the cache's layers, indexed by `module.layer_idx` (full-attention ones are `DualLayer`s).
        rows: in a decode step, the sequences it re-selects or checks (`StepRows`, from `RepairPolicy.rows`);
            None in a prefill.
        drift_repairs: layers that re-selected entries for a drifted query in this forward (filled by the
            attention path; `DualDecoderCache.end_step` adds them up).
    """

    layers: Sequence[CacheLayerMixin]
    rows: StepRows | None = None
    drift_repairs: int = 0
