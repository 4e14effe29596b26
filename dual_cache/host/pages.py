"""Host pages: how host tensors are allocated, page-locked for the device and released.

Large host tensors go on transparent huge pages (`madvise` through ctypes); a store's chunks are ordinary (pageable)
memory registered with the CUDA driver (`cudaHostRegister`) on CUDA machines, so host→device copies from them can be
asynchronous without the power-of-two rounding of torch's pinned-memory caching allocator (a `(3, 8, 4096, 128)` bf16
chunk is 24 MiB; the caching allocator would reserve 32 MiB for it); `copy_block` moves one contiguous block between
such pages and the device. Every tensor allocated here counts in `host.memory.live_host_bytes()` while it lives.
"""

from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Sequence

import torch

from .memory import account_host_bytes


HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
_madvise = None  # libc's madvise through ctypes, found on first use (False: unavailable)


def advise_huge_pages(tensor: torch.Tensor) -> None:
    """Ask Linux to back a large, not yet touched host tensor with transparent huge pages (`madvise(MADV_HUGEPAGE)`
    over its 2 MiB-aligned interior). Host selection reads rows scattered over tens of MiB per step; with 4 KiB
    pages nearly every row costs a TLB miss. A no-op elsewhere, below 4 MiB, or if the call fails."""
    global _madvise
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes < 2 * HUGE_PAGE or not sys.platform.startswith("linux"):
        return
    if _madvise is None:
        try:
            _madvise = ctypes.CDLL(None, use_errno=True).madvise
            _madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _madvise = False
    if _madvise:
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (tensor.data_ptr() + nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            _madvise(start, end - start, 14)  # MADV_HUGEPAGE


def host_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor whose bytes count in `live_host_bytes()` until it is garbage collected (selector
    indexes and key copies); large ones on transparent huge pages (`advise_huge_pages`)."""
    tensor = torch.empty(tuple(shape), dtype=dtype)
    advise_huge_pages(tensor)
    tensor.zero_()
    nbytes = tensor.untyped_storage().nbytes()
    account_host_bytes(nbytes)
    weakref.finalize(tensor, account_host_bytes, -nbytes)
    return tensor


def register_pages(tensor: torch.Tensor) -> None:
    """Page-lock `tensor`'s memory in place so CUDA copies from it run asynchronously."""
    result = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.untyped_storage().nbytes(), 0)
    if int(result) != 0:
        raise RuntimeError(f"cudaHostRegister failed with CUDA error {int(result)}.")


def allocate_chunk(shape: Sequence[int], dtype: torch.dtype, page_lock: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised host keys and values of `shape` on transparent huge pages (`advise_huge_pages`), registered
    with CUDA when `page_lock` (`register_pages`); a failed registration unregisters what it registered and raises.
    The caller counts their bytes (`host.memory.account_host_bytes`) and frees them with `release_chunks`."""
    keys = torch.empty(tuple(shape), dtype=dtype)
    values = torch.empty(tuple(shape), dtype=dtype)
    advise_huge_pages(keys)
    advise_huge_pages(values)
    registered = []
    try:
        if page_lock:
            for tensor in (keys, values):
                register_pages(tensor)
                registered.append(tensor)
    except BaseException:
        for tensor in registered:
            torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
        raise
    return keys, values


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src, non_blocking=True)` for one contiguous block of a store's traffic with the device (the
    positions of one sequence and KV head in one chunk).

    Between a page-locked host block and the device the copy is asynchronous on the current stream. PyTorch copies a
    strided tensor between host and device through a contiguous temporary in pageable memory and waits for it (an
    extra host copy, at pageable speed, with the launch thread stalled; docs/design.md §6), so both sides must be
    contiguous: a `(B, H_kv, n, D)` range of a `(B, H_kv, tokens, D)` chunk is not, its `(n, D)` block per
    (sequence, KV head) is.

    Raises:
        RuntimeError: when `dst` or `src` is not contiguous (a caller that would make the copy synchronous).
    """
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise RuntimeError(
            f"copy_block needs contiguous blocks, got strides {tuple(dst.stride())} <- {tuple(src.stride())}: a "
            "strided copy between host and device stages through pageable memory and waits."
        )
    dst.copy_(src, non_blocking=True)


def release_chunks(chunks: list[tuple[torch.Tensor, torch.Tensor]], registered: bool) -> None:
    """Unregister (if registered) and drop every chunk; runs once, from `free()` or when the store is collected."""
    freed = 0
    for keys, values in chunks:
        for tensor in (keys, values):
            if registered:
                torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
            freed += tensor.untyped_storage().nbytes()
    chunks.clear()
    account_host_bytes(-freed)
