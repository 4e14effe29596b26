"""Byte and telemetry accounting of a finished `generate()`'s cache, per benchmark method (dense `DynamicCache`,
transformers' offloaded cache, `DualDecoderCache`)."""

from __future__ import annotations

NAN = float("nan")


def _layer_bytes(cache) -> list[int]:
    out = []
    for layer in getattr(cache, "layers", []):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if getattr(layer, "is_initialized", False) and keys is not None and values is not None:
            out.append(keys.nbytes + values.nbytes)
    return out


def cache_accounting(method: str, cache) -> dict[str, float]:
    """Bytes of a finished `generate()`'s cache, for the whole batch.

    Returns `device_bytes`, `host_bytes`, `dense_equivalent_bytes` (what a DynamicCache would hold),
    `bytes_copied` (host→device in total, dual only; NaN where it is derived per step instead),
    `bytes_copied_per_step_estimate` (offloaded only), and the dual telemetry (`overlap_ratio`, `wait_seconds`,
    `steps`, `spec_hits`, `spec_steps`, `spec_row_hit_rate_min` (the worst sequence's own hit rate),
    `repaired_fraction`, `retrieval_cpu_seconds` (0 for the caches that do not
    select), `resident_share`; NaN when the cache does not report them), with a device
    clock (CUDA) the shares of the device's step time it idled waiting for selection copies (`idle_copy_fraction`)
    and without work while the host selected (`idle_host_fraction`), NaN without one.
    """
    empty = {"overlap_ratio": NAN, "wait_seconds": NAN, "steps": NAN, "spec_hits": NAN, "spec_steps": NAN,
             "spec_row_hit_rate_min": NAN, "repaired_fraction": NAN, "idle_copy_fraction": NAN,
             "idle_host_fraction": NAN,
             "retrieval_cpu_seconds": 0.0, "resident_share": NAN}
    if method == "dense":
        total = sum(_layer_bytes(cache))
        return {"device_bytes": total, "host_bytes": 0, "dense_equivalent_bytes": total, "bytes_copied": 0, **empty}
    if method == "offloaded":
        layers = sorted(_layer_bytes(cache), reverse=True)
        total = sum(layers)
        return {
            "device_bytes": sum(layers[:2]),  # the layer being used + the one being prefetched
            "host_bytes": total, "dense_equivalent_bytes": total, "bytes_copied": NAN,
            "bytes_copied_per_step_estimate": total, **empty,
        }
    stats = cache.stats()
    step = stats.get("device_step_seconds", 0.0)
    return {
        "device_bytes": stats["device_bytes"], "host_bytes": stats["host_bytes"],
        "dense_equivalent_bytes": stats["dense_equivalent_bytes"], "bytes_copied": stats.get("bytes_copied", NAN),
        "overlap_ratio": stats.get("overlap_ratio", NAN), "wait_seconds": stats.get("wait_seconds", NAN),
        "steps": stats.get("steps", NAN), "spec_hits": stats.get("spec_hits", NAN),
        "spec_steps": stats.get("spec_steps", NAN),
        "spec_row_hit_rate_min": stats.get("spec_row_hit_rate_min", NAN),
        "repaired_fraction": stats["repaired_steps"] / stats["steps"] if stats.get("steps") else NAN,
        "idle_copy_fraction": stats["device_wait_seconds"] / step if step else NAN,
        "idle_host_fraction": stats["device_starved_seconds"] / step if step else NAN,
        "retrieval_cpu_seconds": stats.get("retrieval_cpu_seconds", NAN),
        "resident_share": stats.get("resident_share", NAN),
    }
