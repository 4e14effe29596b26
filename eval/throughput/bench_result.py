"""The rows a throughput benchmark run writes (`summary.json`), as `bench.py` builds them and `bench_report.py` renders
them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BenchResult:
    """Rows of a run: `cells` (one per `generate()` call), `max_batch` (one per method/context/budget when memory
    limits were given; see `bench_capacity.find_max_batch`), `meta`."""

    cells: list[dict] = field(default_factory=list)
    max_batch: list[dict] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
