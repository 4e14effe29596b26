"""Sparse decode attention kernels and their torch references (installed as `dual_cache.kernels`).

`sparse_decode_attention(..., backend="auto" | "torch" | "triton")` picks the Triton kernel
(`dual_cache.kernels.triton_decode`, imported lazily, only when triton is installed) on CUDA and the torch
reference elsewhere.
"""

from .dispatch import BACKENDS, resolve_backend, sparse_decode_attention, triton_import_error
from .reference import KVSegment, check_segments, sparse_decode_attention_reference

__all__ = [
    "BACKENDS",
    "KVSegment",
    "check_segments",
    "resolve_backend",
    "sparse_decode_attention",
    "sparse_decode_attention_reference",
    "triton_import_error",
]
