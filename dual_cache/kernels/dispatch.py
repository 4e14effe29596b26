"""Backend selection for sparse decode attention: the Triton kernel on CUDA, the torch reference elsewhere.

`sparse_decode_attention(query, segments, query_positions, scaling, backend="auto", softcap=None)` takes the
arguments of `sparse_decode_attention_reference` (see `dual_cache.kernels.reference` for shapes and the masking rule):

- `"auto"`: the Triton kernel when the query is on a CUDA device, `triton` imports and the kernel supports the
  input (head_dim in [16, 256], fp16/bf16/fp32, one dtype, one device: the kernel's own validation decides, by
  raising `UnsupportedShapeError`, so the hot path validates once); the torch reference otherwise (CPU
  tensors, head_dim 8, no triton, ...). `resolve_backend` says which one a call would take.
- `"torch"`: always the reference.
- `"triton"`: always the kernel; raises `RuntimeError` when triton cannot be imported and
  `UnsupportedShapeError` (a `ValueError`) for inputs the kernel refuses. CPU tensors run through Triton's
  interpreter (slow; for tests).

On a CUDA query, `"auto"` falling back to the reference (no usable triton, or inputs the kernel refuses) is slow
on the hot path: it warns once per reason (`RuntimeWarning`), naming the shape and dtypes.

`triton_decode` is imported lazily, on the first call that may use it, so importing `dual_cache` never imports
triton.
"""

from __future__ import annotations

import functools
import warnings
from typing import Sequence

import torch

from .reference import KVSegment, sparse_decode_attention_reference

BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS", "resolve_backend", "sparse_decode_attention", "triton_import_error"]


MIN_TRITON = (3, 6)  # the CUDA test machine's; the sm_90 compile test runs under it (make test-triton-floor)


@functools.lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """None when the Triton kernel module imports and triton is recent enough, else why not (e.g. "No module
    named 'triton'", or a triton older than `MIN_TRITON`)."""
    try:
        from . import triton_decode  # noqa: F401
        import triton
    except Exception as error:  # ImportError, or a broken triton install failing at import
        return f"{type(error).__name__}: {error}"
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_TRITON:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, MIN_TRITON))}, which the kernel needs"
    return None


_warned: set[str] = set()


def _on_cuda(query: torch.Tensor) -> bool:
    """Whether `"auto"` tries the kernel for this query (a CUDA tensor)."""
    return query.device.type == "cuda"


def _warn_fallback(reason: str) -> None:
    """Warn once per distinct `reason` that a CUDA call runs the torch reference instead of the Triton kernel."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"dual-cache: decode attention on CUDA falls back to the slow torch reference: {reason}. "
                      "Pass attention_kernel='torch' to choose it knowingly.", RuntimeWarning, stacklevel=3)


def resolve_backend(query: torch.Tensor, segments: Sequence[KVSegment], backend: str = "auto") -> str:
    """The backend ("torch" or "triton") that `sparse_decode_attention` would use for these inputs."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if backend != "auto":
        return backend
    if query.device.type != "cuda" or triton_import_error() is not None:
        return "torch"
    from .triton_decode import unsupported_reason

    return "torch" if unsupported_reason(query, segments) is not None else "triton"


def sparse_decode_attention(
    query: torch.Tensor,
    segments: Sequence[KVSegment],
    query_positions: torch.Tensor,
    scaling: float,
    backend: str = "auto",
    softcap: float | None = None,
) -> torch.Tensor:
    """Sparse decode attention through the chosen backend; same contract as the reference.

    Raises:
        ValueError: unknown backend, or mismatched shapes (`check_segments`).
        RuntimeError: `backend="triton"` without an importable triton.
        UnsupportedShapeError: `backend="triton"` with inputs the kernel does not support.
    """
    if backend == "auto":
        if not _on_cuda(query):
            return sparse_decode_attention_reference(query, segments, query_positions, scaling, softcap)
        if triton_import_error() is not None:
            _warn_fallback(f"triton is unavailable ({triton_import_error()})")
            return sparse_decode_attention_reference(query, segments, query_positions, scaling, softcap)
        from .triton_decode import UnsupportedShapeError, sparse_decode_attention_triton

        try:  # one validation pass on the hot path: the kernel's own checks decide support
            return sparse_decode_attention_triton(query, segments, query_positions, scaling, softcap)
        except UnsupportedShapeError as error:
            kv = segments[0].keys if segments else None
            _warn_fallback(f"{error} (query {tuple(query.shape)} {query.dtype}"
                           + ("" if kv is None else f", KV {tuple(kv.shape)} {kv.dtype}") + ")")
            return sparse_decode_attention_reference(query, segments, query_positions, scaling, softcap)
    if resolve_backend(query, segments, backend) == "torch":
        return sparse_decode_attention_reference(query, segments, query_positions, scaling, softcap)
    error = triton_import_error()
    if error is not None:
        raise RuntimeError(
            f"attention backend 'triton' is unavailable ({error}); install "
            f"triton>={'.'.join(map(str, MIN_TRITON))} or use backend 'auto'/'torch'."
        )
    from .triton_decode import sparse_decode_attention_triton

    return sparse_decode_attention_triton(query, segments, query_positions, scaling, softcap)
