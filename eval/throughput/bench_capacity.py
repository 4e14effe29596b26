"""The largest batch a method fits under a device-memory cap and the host memory available, and its decode
throughput there.

Two limits bound a batch (`MemoryLimits`): the device cap (`--device-budget-gib`: peak device bytes, weights
included; on CUDA enforced with `torch.cuda.set_per_process_memory_fraction`, so one large GPU stands in for a
24 / 48 / 80 GiB one) and host memory (`--host-budget-gib`, default 90% of what is available: dual's and Quest's
host stores, the offloaded cache's host copy; on CPU the device *is* the host, so weights, device tiers and host
stores share that one pool).

The search (`find_max_batch`) runs a cell at batch 1 and 2, fits device and host bytes as `fixed + per_request ×
batch` (activations included on CUDA: the peak allocated bytes of the whole call, prefill included), predicts
the batch where the first limit binds, and runs the cell at that batch: that run is both the check that it fits and
the throughput measurement. If it does not fit, it bisects between the last batch that fitted and the one that did
not (a few runs at most). A run whose predicted duration (prefill and decode, each fitted the same way) exceeds
`max_cell_seconds` is not made: its throughput is then extrapolated from the measured batches (ms per step affine
in the batch, never falling) and labelled so. The cell runner is passed in (`measure`), so the logic is tested
with fake probes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

NAN = float("nan")
GIB = 1024 ** 3
DEVICE, HOST, BATCH_CAP, FAILED = "device memory", "host memory", "batch cap", "run failed"


@dataclass(frozen=True)
class MemoryLimits:
    """What a batch may use.

    Attributes:
        device_bytes: device cap in bytes, weights included; None for no cap.
        host_bytes: host memory the run's KV may use (bytes); on a shared pool, everything.
        shared: the device is the host (CPU): weights, device bytes and host bytes come from `host_bytes`.
    """

    device_bytes: int | None
    host_bytes: int
    shared: bool = False


def apply_device_cap(device: torch.device, cap_bytes: int) -> float:
    """Cap this process's allocations on CUDA `device` at `cap_bytes` (the caching allocator raises an out-of-memory
    error past it; the CUDA context itself, a few hundred MiB, is not counted). Returns the fraction set.

    Raises:
        ValueError: for a cap larger than the device's memory.
    """
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_bytes > total:
        raise ValueError(f"--device-budget-gib {cap_bytes / GIB:.1f} exceeds the device's {total / GIB:.1f} GiB.")
    fraction = cap_bytes / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


@dataclass(frozen=True)
class Footprint:
    """Memory of one run at `batch`: peak device bytes (weights included), those of the decode phase alone, and
    host KV bytes of the whole batch."""

    batch: int
    device: float
    device_decode: float
    host: float


def footprint(row: dict, weight_bytes: int) -> Footprint:
    """A cell row's footprint: measured CUDA peaks where present, else weights + the cache's device bytes."""
    batch = row["batch"]
    accounted = weight_bytes + batch * row["device_bytes_per_request"]
    peak = row.get("cuda_peak_total_bytes", NAN)
    decode = row.get("cuda_decode_peak_total_bytes", NAN)
    host = row.get("host_bytes_per_request", NAN)
    return Footprint(
        batch=batch,
        device=peak if _finite(peak) else accounted,
        device_decode=decode if _finite(decode) else (peak if _finite(peak) else accounted),
        host=batch * host if _finite(host) else 0.0,
    )


def limit_reached(row: dict, used: Footprint | None, limits: MemoryLimits) -> str | None:
    """Which limit a run broke (`DEVICE`, `HOST`; `FAILED` for a run that failed otherwise), or None when it
    fitted."""
    error = row.get("error")
    if error:
        if error.startswith("failed"):
            return FAILED
        return HOST if error.startswith("host memory") else DEVICE
    if limits.device_bytes is not None and used.device > limits.device_bytes:
        return DEVICE
    host = used.host + (used.device if limits.shared else 0.0)
    return HOST if host > limits.host_bytes else None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _affine(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares `(intercept, slope)` of `y = a + s x` through `(x, y)` points; None for fewer than 2 xs."""
    points = [(x, y) for x, y in points if _finite(y)]
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - slope * mx, slope


def _largest_within(fixed: float, per: float, room: float) -> float:
    """Largest b with `fixed + per × b <= room` (inf when `per <= 0`, 0 when nothing fits)."""
    if per <= 0:
        return math.inf if fixed <= room else 0
    return max(0, math.floor((room - fixed) / per))


def predict_batches(a: Footprint, b: Footprint, limits: MemoryLimits) -> dict[str, float]:
    """From two runs' footprints, the largest batch each limit allows: `{"device", "device_decode", "host"}`
    (inf where a limit is absent or does not grow with the batch)."""
    span = b.batch - a.batch
    per_device = (b.device - a.device) / span
    per_decode = (b.device_decode - a.device_decode) / span
    per_host = max(a.host / a.batch, b.host / b.batch)
    out = {"device": math.inf, "device_decode": math.inf}
    if limits.device_bytes is not None:
        out["device"] = _largest_within(a.device - per_device * a.batch, per_device, limits.device_bytes)
        out["device_decode"] = _largest_within(a.device_decode - per_decode * a.batch, per_decode,
                                               limits.device_bytes)
    if limits.shared:
        out["host"] = _largest_within(a.device - per_device * a.batch, per_device + per_host, limits.host_bytes)
    else:
        out["host"] = _largest_within(0.0, per_host, limits.host_bytes)
    return out


def find_max_batch(measure: Callable[[int], dict], limits: MemoryLimits, weight_bytes: int, cap: int = 256,
                   max_cell_seconds: float | None = None, max_retries: int = 3) -> dict:
    """The largest batch that fits `limits`, and the decode throughput there.

    Args:
        measure: runs the cell at a batch size and returns its row (`bench_cell.COLUMNS`; `error` set when it ran
            out of memory). Called with batch 1, 2, the predicted maximum, and bisection points if that fails.
        limits: the device cap and host memory. weight_bytes: the model's weights (CPU device accounting).
        cap: largest batch considered (`BATCH_CAP` when it binds).
        max_cell_seconds: runs predicted to take longer are not made; the throughput at the maximum is then
            extrapolated from the measured batches. None: always measure.
        max_retries: bisection runs after the predicted maximum failed.

    Returns:
        A dict: `max_batch`, `limited_by` (`DEVICE`, `HOST`, `BATCH_CAP`, or `FAILED` with the run's error),
        `predicted` (the batch each limit allows by the fit: device, device with the decode-phase peak only,
        host), `measured_at_batch` (the largest batch that ran and fitted), `how` ("measured" at max_batch, or "extrapolated from batches ..."),
        `decode_tokens_per_s`, `ms_per_step`, `prefill_s` at max_batch, the per-request bytes, and `runs`
        (batch, footprint, tokens/s, error of every run).
    """
    runs: list[dict] = []
    fitted: dict[int, dict] = {}

    def run(batch: int) -> str | None:
        row = measure(batch)
        used = None if row.get("error") else footprint(row, weight_bytes)
        limit = limit_reached(row, used, limits)
        runs.append({"batch": batch, "device_bytes": used.device if used else NAN,
                     "host_bytes": used.host if used else NAN, "decode_tokens_per_s": row["decode_tokens_per_s"],
                     "error": row.get("error") or (f"over the {limit}" if limit else None)})
        if limit is None:
            fitted[batch] = row
        return limit

    result = {"max_batch": 0, "limited_by": None, "predicted": {}, "runs": runs}
    limit = run(1)
    if limit is not None:
        result["limited_by"] = limit
        return _summarize(result, fitted, 0)
    if cap < 2:
        result.update(limited_by=BATCH_CAP)
        return _summarize(result, fitted, 1)
    limit = run(2)
    if limit is not None:
        result.update(limited_by=limit)
        return _summarize(result, fitted, 1)
    predicted = predict_batches(footprint(fitted[1], weight_bytes), footprint(fitted[2], weight_bytes), limits)
    result["predicted"] = predicted
    target, limit = min((predicted["device"], DEVICE), (predicted["host"], HOST), (cap, BATCH_CAP))
    target = int(max(target, 2))
    good, bad, retries = 2, None, -1  # the run at the predicted batch is not a retry
    while target > good:
        if max_cell_seconds is not None and _predicted_seconds(fitted, target) > max_cell_seconds:
            result.update(max_batch=target, limited_by=limit)
            return _summarize(result, fitted, target)
        broke = run(target)
        retries += 1
        if broke is None:
            good = target
        else:
            bad, limit = target, broke
        if bad is None or bad - good <= 1 or retries >= max_retries or broke == FAILED:
            break
        target = (good + bad) // 2
    result.update(max_batch=good, limited_by=limit)
    return _summarize(result, fitted, good)


def _extrapolate(fitted: dict[int, dict], key: str, batch: int) -> float:
    """`fitted` rows' `key` at `batch` by the affine fit over the batch; a falling fit (timing noise: no cost falls
    with the batch) is replaced by the value at the largest measured batch. NaN with fewer than two batches."""
    fit = _affine([(b, r[key]) for b, r in fitted.items()])
    if fit is None:
        return NAN
    if fit[1] < 0:
        return fitted[max(fitted)][key]
    return fit[0] + fit[1] * batch


def _predicted_seconds(fitted: dict[int, dict], batch: int) -> float:
    steps = max((r["decode_steps"] for r in fitted.values() if _finite(r["decode_steps"])), default=NAN)
    return _extrapolate(fitted, "prefill_s", batch) + steps * _extrapolate(fitted, "ms_per_step", batch) / 1000


def _summarize(result: dict, fitted: dict[int, dict], max_batch: int) -> dict:
    """Add the throughput at `max_batch`: measured when a run there fitted, else extrapolated (affine in batch)."""
    result["max_batch"] = max_batch
    measured = max(fitted, default=None)
    result["measured_at_batch"] = measured
    keys = ("decode_tokens_per_s", "ms_per_step", "prefill_s", "device_bytes_per_request", "host_bytes_per_request",
            "cuda_peak_bytes_per_request", "cuda_decode_peak_bytes_per_request")
    if measured is None:
        result.update({key: NAN for key in keys}, how="nothing fitted")
        return result
    row = fitted[measured]
    result.update({key: row.get(key, NAN) for key in keys})
    if max_batch == measured:
        result["how"] = "measured"
        return result
    ms = _extrapolate(fitted, "ms_per_step", max_batch)
    result.update(
        ms_per_step=ms, decode_tokens_per_s=1000 * max_batch / ms if _finite(ms) and ms > 0 else NAN,
        prefill_s=_extrapolate(fitted, "prefill_s", max_batch),
        how="extrapolated from batches " + ", ".join(str(b) for b in sorted(fitted)),
    )
    return result
