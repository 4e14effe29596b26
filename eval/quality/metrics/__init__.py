"""Local `evaluate` metric modules (load by path with `evaluate.load(metric_path(name))`; they work offline)."""

from __future__ import annotations

import os

METRICS = ("longbench_score", "ruler_string_match")


def metric_path(name: str) -> str:
    """Absolute path of the metric module `name` (one of `METRICS`), for `evaluate.load(path)`.

    Raises:
        ValueError: for an unknown metric name.
    """
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; available: {list(METRICS)}.")
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")


def load_metric(name: str):
    """`evaluate.load` of the local metric module `name` (no Hub access).

    Raises:
        MissingExtraError: without the `eval` extra (datasets, evaluate and the metrics' libraries).
    """
    from ....runtime.extras import require

    require("eval", f"the {name} metric")
    import evaluate

    return evaluate.load(metric_path(name))
