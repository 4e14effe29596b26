"""`selector="oracle"`: the real token's own exact top-k, chosen at the step that uses it (evaluation only)."""

from __future__ import annotations

from .exact import ExactSelector


class OracleSelector(ExactSelector):
    """Exact top-k with the real token's query, synchronously at the step that uses it: the upper bound of any
    selection of `budget` entries by attention mass (nothing is prefetched, so nothing hides behind compute)."""

    name = "oracle"
    prefetched = False
