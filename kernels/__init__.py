"""Sparse decode attention kernels and their torch references (installed as `dual_cache.kernels`)."""

from .reference import sparse_decode_attention_reference

__all__ = ["sparse_decode_attention_reference"]
