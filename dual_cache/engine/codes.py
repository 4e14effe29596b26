"""The 2-bit key index's storage format, shared by the native engine and its pure-torch reference.

Keys are quantized per channel over groups of `GROUP` = 64 consecutive tokens (the key layout of KIVI, Liu et al.,
2024, §3): per (group, channel) a minimum `m` and a step `s = (max - m) / 3`, both stored as bfloat16, and each key
element as the 2-bit code `c = clamp(round((k - m) / s), 0, 3)` of the stored (rounded) `m` and `s`, so `m + s·c`
dequantizes it. Head dims that are not a multiple of 4 are padded with zero channels (`padded_dim`).

Byte layout of one group (`quantize`'s rows, `16 · D_q` bytes): for each channel quad `c` (channels `4c … 4c+3`) a
64-byte line, in it 16 bytes per block `tb` of 16 tokens; bit pair `i` of byte `k` holds element `p = 16·i + k` of
the (16 tokens × 4 channels) block, token `tb·16 + p // 4`, channel `4c + p % 4`. The engine reads the index line
by line, wherever the caller keeps the lines (`dual_cache.engine.IndexView`: the `lowbit` selector stores each
quad's lines of all groups one after another, so a scan of some quads reads one stream per quad). The AVX2 scan
unpacks a 16-byte block with three operations into the operand of `vpmaddubsw`; the AVX-512 scan masks a whole line
with `3 << 2i` (one AND per bit pair `i`: 4^i times the codes of tokens `16·tb + 4·i + w` at 32-bit lane `4·tb + w`)
and feeds it to `vpdpbusd` (4-way u8·s8 dot products into 32-bit sums; a shift right by `2i` restores the dot).
"""

from __future__ import annotations

import torch

GROUP = 64  # tokens per quantization group
KEY_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # key dtype → the engine's code for it


def padded_dim(head_dim: int) -> int:
    """Channels of the index for heads of `head_dim`: rounded up to a multiple of 4."""
    return -(-head_dim // 4) * 4


def quantize(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and parameters of complete groups of keys (the definition; `quantize_fast` computes the same bytes
    natively).

    Args:
        keys: `(N, GROUP, D)` host keys, any float dtype (N independent groups).

    Returns:
        `(packed, params)`: `(N, 16 · D_q)` uint8 in the byte layout above and `(N, 2, D_q)` bfloat16 (row 0 the
        per-channel minimum, row 1 the step), `D_q = padded_dim(D)`.
    """
    count, group, dim = keys.shape
    if group != GROUP:
        raise ValueError(f"quantize takes groups of {GROUP} tokens, got {group}.")
    dim_q = padded_dim(dim)
    values = torch.nn.functional.pad(keys.float(), (0, dim_q - dim))
    low = values.amin(dim=1).bfloat16()
    step = ((values.amax(dim=1) - low.float()) / 3).bfloat16()
    safe = torch.where(step.float() > 0, step.float(), torch.ones(()))
    codes = torch.round((values - low.float()[:, None]) / safe[:, None]).clamp_(0, 3).to(torch.uint8)
    return pack(codes), torch.stack([low, step], dim=1)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """`(N, GROUP, D_q)` uint8 codes in `[0, 4)` → `(N, 16 · D_q)` uint8 in the engine's byte layout."""
    count, _, dim_q = codes.shape
    blocks = codes.view(count, 4, 16, dim_q // 4, 4).permute(0, 3, 1, 2, 4)  # (N, quad, tb, token, channel)
    elements = blocks.reshape(count, dim_q // 4, 4, 4, 16)  # (N, quad, tb, bit pair i, byte k): p = 16 i + k
    packed = elements[..., 0, :] | (elements[..., 1, :] << 2) | (elements[..., 2, :] << 4) | (elements[..., 3, :] << 6)
    return packed.reshape(count, 16 * dim_q)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: `(N, 16 · D_q)` uint8 → `(N, GROUP, D_q)` uint8 codes."""
    count, size = packed.shape
    dim_q = size // 16
    chunks = packed.view(count, dim_q // 4, 4, 1, 16)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
    elements = (chunks >> shifts) & 3  # (N, quad, tb, i, k)
    blocks = elements.reshape(count, dim_q // 4, 4, 16, 4)  # (N, quad, tb, token, channel)
    return blocks.permute(0, 2, 3, 1, 4).reshape(count, GROUP, dim_q)


def quantize_fast(keys: torch.Tensor, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` through the native engine (the same bytes), or `quantize` itself where the engine is unavailable.

    Args:
        keys: `(N, GROUP, D)` float32 / bfloat16 / float16 host keys; threads: default `torch.get_num_threads()`.
    """
    from . import native

    library = native.library()
    if library is None or keys.dtype not in KEY_TYPES or keys.shape[1] != GROUP:
        return quantize(keys)
    keys = keys.contiguous()
    count, _, dim = keys.shape
    dim_q = padded_dim(dim)
    packed = torch.empty(count, 16 * dim_q, dtype=torch.uint8)
    params = torch.empty(count, 2, dim_q, dtype=torch.bfloat16)
    library.dc_quantize(keys.data_ptr(), KEY_TYPES[keys.dtype], count, dim, dim_q, packed.data_ptr(),
                        params.data_ptr(), max(1, torch.get_num_threads() if threads is None else threads))
    return packed, params
