"""Benchmark only: a dual cache whose miss repairs follow a forced miss rate instead of the speculation's outcome.

Why: random weights never confirm a speculated token, so on a random-weight model every decode step of `dual-self`
is repaired (the worst case) and `miss_repair=False` never is (the pipeline alone). Real models sit in between
(the embedded model: ~74–81% of speculated tokens hit at 2K–8K, `results/bench/cpu-embedded*/`). `ForcedMissCache`
times that middle on any weights: each decode step, a seeded random `miss_rate` fraction of the live sequences is
treated as missed (repaired in every layer, synchronously, as a real miss would be), the others as hit.

How: the decode loop reports each step's rows through `DualDecoderCache.begin_step(rows)`, which returns the step's plan; this
subclass only redraws that split, so the decode loop, the schedule and the repairs themselves run unchanged. The
first decode step (`check` is None: the prompt's last position chose its entries) is repaired for every sequence,
as in the real loop. Drift checks on forced hits are skipped (`check` rows are not passed on): with random weights every
query drifts, which would turn each forced hit into a repair; on real weights drift repair redoes ~1% of the hit
(step, layer) pairs (docs/benchmarks.md), which this leaves out. Speculation statistics (`spec_hits`) still report the real
outcomes. Tokens are not what the forced pattern would produce on a real model: use it for timing, never quality.
"""

from __future__ import annotations

import random

from ...cache.cache import DualDecoderCache
from ...layer.repair import StepRows


class ForcedMissCache(DualDecoderCache):
    """`DualDecoderCache` that repairs a seeded random `miss_rate` fraction of the live sequences each step.

    Args:
        config, dual_config, max_cache_len, **options: as `DualDecoderCache`; `miss_repair` is turned on (a
            `dual_config` must have it on).
        miss_rate: probability in [0, 1] that a live sequence counts as missed at a decode step (0: never
            repaired after the first step; 1: every step repaired).
        seed: seed of the draws (one uniform draw per sequence and step, on the host).

    Raises:
        ValueError: for a rate outside [0, 1] or a configuration with `miss_repair=False`.
    """

    def __init__(self, config, dual_config=None, max_cache_len=None, *, miss_rate: float, seed: int = 0,
                 **options) -> None:
        if isinstance(miss_rate, bool) or not isinstance(miss_rate, (int, float)) or not 0.0 <= miss_rate <= 1.0:
            raise ValueError(f"miss_rate must be a number in [0, 1], got {miss_rate!r}.")
        if options.get("miss_repair", True) is False or (dual_config is not None and not dual_config.miss_repair):
            raise ValueError("ForcedMissCache forces miss repairs; build it without miss_repair=False.")
        if dual_config is None:
            options["miss_repair"] = True
        super().__init__(config, dual_config, max_cache_len, **options)
        self.miss_rate = float(miss_rate)
        self._draws = random.Random(seed)
        self.forced_misses = 0  # (step, sequence) pairs marked missed after the first step
        self.forced_rows = 0  # live (step, sequence) pairs after the first step

    def begin_step(self, rows: StepRows):
        """Replace the step's missed / hit split by a random one with `miss_rate` misses among the live rows.

        Args: as `DualDecoderCache.begin_step`.
        """
        if rows.first:  # first decode step: every live sequence is repaired, as in the real loop
            return super().begin_step(rows)
        draws = [self._draws.random() for _ in range(rows.batch)]
        forced = tuple(i for i in rows.live if draws[i] < self.miss_rate)
        self.forced_misses += len(forced)
        self.forced_rows += len(rows.live)
        return super().begin_step(StepRows(forced, (), rows.live, rows.batch))
