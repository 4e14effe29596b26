"""Triton sparse decode attention over device-resident KV segments (flash-decoding style).

Computes exactly what `sparse_decode_attention_reference` computes (same arguments, same masking rule, same
zeros for rows with nothing to attend), but reads every segment (sink, selection, window ring, ...) in place:
no concatenated K/V copy, no materialized positions/valid (stride-0 broadcasts are passed as strides).

Shapes and dtypes
-----------------
- `query`: `(B, H_q, q, D)`, fp16 / bf16 / fp32, any strides. q is the number of decode queries per sequence
  (1, or 2 for the real + speculated token; any small q works).
- each `KVSegment`: keys/values `(B, H_kv, L, D)` in the query's dtype, any strides (views of bigger buffers are
  fine); positions int64 and valid bool, each broadcastable to `(B, H_kv, L)` (e.g. `(1, 1, L)` / `(B, 1, L)`).
- `query_positions`: int64 `(B, q)` or `(q,)` (other integer dtypes are converted).
- output: `(B, H_q, q, D)` in the query's dtype. Accumulation (QK^T, softmax, PV) is fp32.

Masking rule (identical to the reference)
-----------------------------------------
Query slot i of sequence b attends entry j of KV head h iff `valid[b, h, j] and positions[b, h, j] <=
query_positions[b, i]`; query head `hq` reads KV head `hq // (H_q // H_kv)`. A row with no allowed entry is
zeros. Entries with `valid == False` are never read from K/V memory (loads are masked), so unused slots may hold
garbage, even NaN — the reference would propagate such NaNs, the kernel does not.

Supported shapes (anything else raises `UnsupportedShapeError`, a `ValueError`; `dual_cache.kernels.dispatch`
falls back to the reference for those)
- head_dim D with 16 <= D <= 256 (tl.dot needs an inner dimension of at least 16; 256 bounds registers and
  shared memory). Powers of two (16/32/64/128/256) are the fast path; other sizes are padded to the next power
  of two with masked loads.
- dtypes fp16, bf16, fp32; query, keys and values share one dtype. fp32 uses IEEE fp32 dot products by default
  (`allow_tf32=True` trades accuracy for speed).
- any GQA ratio (MHA, GQA, MQA), any batch, any number of segments, any segment lengths (0 included).

Kernel design
-------------
One program owns one (sequence b, KV head h, block of query rows, key split). Its query rows are *all* the
query heads of h's GQA group times *all* query slots (`M = H_q // H_kv * q` rows, e.g. 3 heads x 2 slots), so
every K/V tile is loaded once and used for M rows through `tl.dot` (rows padded to at least 16). Keys are
split flash-decoding style: the segments are laid end to end in a *virtual* key axis (never materialized) and
the program for split s walks keys `[s * split, (s + 1) * split)` of that axis, intersecting it with each
segment in turn. Segments are passed as separate pointer/stride argument sets, up to 4 per launch
(`NUM_SEGS` is a compile-time constant, so unused slots cost nothing); more than 4 segments take several
launches that write disjoint splits of the same workspace.

Why pointer sets rather than one launch (or one partial) per segment: a decode step has 3-4 segments per layer;
one launch per segment would triple the launch count (Triton's Python launch path is tens of microseconds), and
per-segment partials force a merge even when a single program could cover everything. With the virtual key
axis a short context is handled by one program per (b, h) that writes the output directly (no merge, one
launch), and a long selection is split into as many programs as the GPU needs, independent of where the
segment boundaries lie.

With more than one split, each program stores its unnormalized partial (acc, running max m, running sum l;
fp32, base-2 exponent domain) to a workspace and a second small kernel merges the splits per row by
log-sum-exp: `m* = max_s m_s`, `out = sum_s 2^(m_s - m*) acc_s / sum_s 2^(m_s - m*) l_s`. Empty splits and
fully masked rows carry `m = -inf, l = 0` and are handled without NaNs.

Split size: on CUDA, enough splits for about two waves of programs over the SMs but never splits shorter than
256 keys; when `B * H_kv` already fills the GPU (e.g. B=64, H_kv=8) that is one split and the output is written
directly. More than 64 query rows per KV head (MQA with many heads) use several row blocks (grid axis 2).

Host overhead matters on the decode path (one call per layer per step): inputs are validated with plain Python
on shapes/strides (no `torch.broadcast_shapes`, no expanded tensors); only when that fast check fails do the full
`check_segments` / `unsupported_reason` run to name the problem.

Runs on CPU through Triton's interpreter: CPU tensors always use interpreter-mode kernels (built on demand,
independent of whether `TRITON_INTERPRET` was set before this module was imported); CUDA tensors use compiled
kernels unless `TRITON_INTERPRET=1`. In the interpreter, bf16 dot products are computed on fp32-converted
operands (numpy has no bf16), with the probabilities rounded to bf16 first as on the GPU.
"""


import functools
import os
import types
from typing import Sequence

import torch
import triton.language as tl

from .reference import KVSegment, check_segments

__all__ = [
    "MAX_HEAD_DIM",
    "MIN_HEAD_DIM",
    "SUPPORTED_DTYPES",
    "UnsupportedShapeError",
    "sparse_decode_attention_triton",
    "unsupported_reason",
]

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEGMENTS_PER_LAUNCH = 4
_LOG2E = 1.4426950408889634
_MAX_BLOCK_M = 64
_MIN_AUTO_SPLIT = 256  # keys; a split shorter than this is not worth a merge


class UnsupportedShapeError(ValueError):
    """The Triton kernel does not handle these inputs (head_dim, dtype, device); use the reference instead."""


# --------------------------------------------------------------------------------------------------------------
# Kernels. Plain functions registered here and wrapped on demand (see `_kernels`), so the same source serves
# compiled CUDA kernels and interpreter kernels for CPU tensors in one process.
# --------------------------------------------------------------------------------------------------------------
_KERNEL_SOURCES: dict = {}


def _kernel_source(fn):
    _KERNEL_SOURCES[fn.__name__] = fn
    return fn


@_kernel_source
def _row_max(x):
    return tl.max(x, axis=1)


@_kernel_source
def _row_sum(x):
    return tl.sum(x, axis=1)


@_kernel_source
def _attend_segment(
    acc, m_i, l_i, q, qpos, scale_log2, cap_log2,
    k_ptr, v_ptr, p_ptr, ok_ptr,
    k_sl, k_sd, v_sl, v_sd, p_sl, ok_sl,
    seg_len, seg_start, start, end, offs_d, d_mask,
    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # keys [start, end) of the virtual axis, intersected with this segment's [seg_start, seg_start + seg_len)
    lo = tl.maximum(start - seg_start, 0)
    hi = tl.minimum(end - seg_start, seg_len)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = tl.load(ok_ptr + offs_n * ok_sl, mask=offs_n < hi, other=0) != 0
        pos = tl.load(p_ptr + offs_n * p_sl, mask=ok, other=0)
        kv_mask = ok[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * k_sl + offs_d[None, :] * k_sd, mask=kv_mask, other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee" if IEEE_DOT else "tf32")
        s = s * scale_log2
        if SOFTCAP:  # s = logit / softcap here; softcap * tanh(s) in log2 units, tanh(s) = 1 - 2 / (e^(2s) + 1)
            s = (1.0 - 2.0 / (tl.exp2(s * 2.8853900817779268) + 1.0)) * cap_log2
        allowed = ok[None, :] & (pos[None, :] <= qpos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, _row_max(s))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: keep exp2 finite
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + _row_sum(p)
        v = tl.load(v_ptr + offs_n[:, None] * v_sl + offs_d[None, :] * v_sd, mask=kv_mask, other=0.0)
        if UPCAST:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee" if IEEE_DOT else "tf32")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, m_i, l_i


@_kernel_source
def _store_rows(out_ptr, acc, l_i, b, kv_head, rows, row_mask, offs_d, d_mask,
                o_sb, o_sh, o_sq, o_sd, GROUPS, Q: tl.constexpr):
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # rows with nothing allowed: acc == 0 -> zeros
    head = kv_head * GROUPS + rows // Q
    slot = rows % Q
    ptrs = (out_ptr + b.to(tl.int64) * o_sb + head[:, None].to(tl.int64) * o_sh + slot[:, None] * o_sq
            + offs_d[None, :] * o_sd)
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@_kernel_source
def _decode_kernel(
    q_ptr, qpos_ptr, out_ptr, ws_acc, ws_m, ws_l,
    q_sb, q_sh, q_sq, q_sd, qp_sb, qp_sq, o_sb, o_sh, o_sq, o_sd,
    KV_HEADS, GROUPS, M, scale_log2, cap_log2, split, split_base, ws_splits,
    k0, v0, p0, ok0, len0, k0_sb, k0_sh, k0_sl, k0_sd, v0_sb, v0_sh, v0_sl, v0_sd, p0_sb, p0_sh, p0_sl,
    ok0_sb, ok0_sh, ok0_sl,
    k1, v1, p1, ok1, len1, k1_sb, k1_sh, k1_sl, k1_sd, v1_sb, v1_sh, v1_sl, v1_sd, p1_sb, p1_sh, p1_sl,
    ok1_sb, ok1_sh, ok1_sl,
    k2, v2, p2, ok2, len2, k2_sb, k2_sh, k2_sl, k2_sd, v2_sb, v2_sh, v2_sl, v2_sd, p2_sb, p2_sh, p2_sl,
    ok2_sb, ok2_sh, ok2_sl,
    k3, v3, p3, ok3, len3, k3_sb, k3_sh, k3_sl, k3_sd, v3_sb, v3_sh, v3_sl, v3_sd, p3_sb, p3_sh, p3_sl,
    ok3_sb, ok3_sh, ok3_sl,
    Q: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SEGS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_OUT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_split = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // KV_HEADS
    h = pid_bh % KV_HEADS
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = (group head r // Q, query slot r % Q)
    row_mask = rows < M
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    head = h * GROUPS + rows // Q
    slot = rows % Q
    q = tl.load(
        q_ptr + b64 * q_sb + head[:, None].to(tl.int64) * q_sh + slot[:, None] * q_sq + offs_d[None, :] * q_sd,
        mask=row_mask[:, None] & d_mask[None, :], other=0.0,
    )
    qpos = tl.load(qpos_ptr + b64 * qp_sb + slot * qp_sq, mask=row_mask, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    start = pid_split * split
    end = start + split

    acc, m_i, l_i = _attend_segment(
        acc, m_i, l_i, q, qpos, scale_log2, cap_log2,
        k0 + b64 * k0_sb + h64 * k0_sh, v0 + b64 * v0_sb + h64 * v0_sh,
        p0 + b64 * p0_sb + h64 * p0_sh, ok0 + b64 * ok0_sb + h64 * ok0_sh,
        k0_sl, k0_sd, v0_sl, v0_sd, p0_sl, ok0_sl, len0, 0, start, end, offs_d, d_mask,
        BLOCK_N, UPCAST, IEEE_DOT, SOFTCAP,
    )
    if NUM_SEGS > 1:
        acc, m_i, l_i = _attend_segment(
            acc, m_i, l_i, q, qpos, scale_log2, cap_log2,
            k1 + b64 * k1_sb + h64 * k1_sh, v1 + b64 * v1_sb + h64 * v1_sh,
            p1 + b64 * p1_sb + h64 * p1_sh, ok1 + b64 * ok1_sb + h64 * ok1_sh,
            k1_sl, k1_sd, v1_sl, v1_sd, p1_sl, ok1_sl, len1, len0, start, end, offs_d, d_mask,
            BLOCK_N, UPCAST, IEEE_DOT, SOFTCAP,
        )
    if NUM_SEGS > 2:
        acc, m_i, l_i = _attend_segment(
            acc, m_i, l_i, q, qpos, scale_log2, cap_log2,
            k2 + b64 * k2_sb + h64 * k2_sh, v2 + b64 * v2_sb + h64 * v2_sh,
            p2 + b64 * p2_sb + h64 * p2_sh, ok2 + b64 * ok2_sb + h64 * ok2_sh,
            k2_sl, k2_sd, v2_sl, v2_sd, p2_sl, ok2_sl, len2, len0 + len1, start, end, offs_d, d_mask,
            BLOCK_N, UPCAST, IEEE_DOT, SOFTCAP,
        )
    if NUM_SEGS > 3:
        acc, m_i, l_i = _attend_segment(
            acc, m_i, l_i, q, qpos, scale_log2, cap_log2,
            k3 + b64 * k3_sb + h64 * k3_sh, v3 + b64 * v3_sb + h64 * v3_sh,
            p3 + b64 * p3_sb + h64 * p3_sh, ok3 + b64 * ok3_sb + h64 * ok3_sh,
            k3_sl, k3_sd, v3_sl, v3_sd, p3_sl, ok3_sl, len3, len0 + len1 + len2, start, end, offs_d, d_mask,
            BLOCK_N, UPCAST, IEEE_DOT, SOFTCAP,
        )

    if WRITE_OUT:
        _store_rows(out_ptr, acc, l_i, b, h, rows, row_mask, offs_d, d_mask, o_sb, o_sh, o_sq, o_sd, GROUPS, Q)
    else:
        # workspace: acc (B * H_kv, ws_splits, M, HEAD_DIM), m and l (B * H_kv, ws_splits, M), contiguous fp32
        row_base = (pid_bh.to(tl.int64) * ws_splits + split_base + pid_split) * M + rows
        tl.store(ws_m + row_base, m_i, mask=row_mask)
        tl.store(ws_l + row_base, l_i, mask=row_mask)
        tl.store(ws_acc + row_base[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=row_mask[:, None] & d_mask[None, :])


@_kernel_source
def _merge_kernel(
    ws_acc, ws_m, ws_l, out_ptr, o_sb, o_sh, o_sq, o_sd, KV_HEADS, GROUPS, M, ws_splits,
    Q: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = pid_bh // KV_HEADS
    h = pid_bh % KV_HEADS
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    for s in range(0, ws_splits):
        row_base = (pid_bh.to(tl.int64) * ws_splits + s) * M + rows
        m_s = tl.load(ws_m + row_base, mask=row_mask, other=float("-inf"))
        l_s = tl.load(ws_l + row_base, mask=row_mask, other=0.0)
        acc_s = tl.load(ws_acc + row_base[:, None] * HEAD_DIM + offs_d[None, :],
                        mask=row_mask[:, None] & d_mask[None, :], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        beta = tl.exp2(m_s - m_use)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + acc_s * beta[:, None]
        m_i = m_new
    _store_rows(out_ptr, acc, l_i, b, h, rows, row_mask, offs_d, d_mask, o_sb, o_sh, o_sq, o_sd, GROUPS, Q)


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> types.SimpleNamespace:
    """The kernels as compiled Triton JIT functions (`interpret=False`) or interpreter functions (CPU tensors).

    Each mode gets its own copies of the functions with their own globals, so helper calls inside a kernel
    resolve to helpers of the same mode.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    namespace = dict(globals())
    wrapped = {}
    for name, fn in _KERNEL_SOURCES.items():
        clone = types.FunctionType(fn.__code__, namespace, name, fn.__defaults__, fn.__closure__)
        clone.__qualname__ = fn.__qualname__
        clone.__module__ = fn.__module__
        clone.__doc__ = fn.__doc__
        clone.__annotations__ = dict(fn.__annotations__)  # the tl.constexpr marks: FunctionType drops them
        if interpret:
            wrapped[name] = InterpretedFunction(clone)
        elif name == "_decode_kernel":
            # lengths and split bookkeeping change from call to call: don't specialize on them
            wrapped[name] = JITFunction(clone, do_not_specialize=[
                "split", "split_base", "ws_splits", "len0", "len1", "len2", "len3"])
        else:
            wrapped[name] = JITFunction(clone)
    if interpret and not isinstance(tl.max, InterpretedFunction):
        # triton was imported without TRITON_INTERPRET=1 (e.g. by transformers), so its standard-library
        # functions (tl.max, tl.sum, ...) are compiled-mode JIT functions the interpreter cannot call. Route the
        # two row reductions straight to tl.reduce, which the interpreter evaluates with numpy.
        wrapped["_row_max"] = _interpreter_row_reduce("_elementwise_max", lambda a, b: tl.maximum(a, b))
        wrapped["_row_sum"] = _interpreter_row_reduce("_sum_combine", lambda a, b: a + b)
    namespace.update(wrapped)
    return types.SimpleNamespace(**wrapped)


def _interpreter_row_reduce(combine_name: str, fallback):
    # The interpreter evaluates tl.reduce with numpy when the combine function is triton's own (identity check);
    # any other combine function takes its slow element-by-element path, still correct.
    combine = getattr(tl.standard, combine_name, None) or types.SimpleNamespace(fn=fallback)

    def row_reduce(x):
        return tl.reduce(x, 1, combine)

    return row_reduce


# --------------------------------------------------------------------------------------------------------------
# Host side.
# --------------------------------------------------------------------------------------------------------------
def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def unsupported_reason(query: torch.Tensor, segments: Sequence[KVSegment]) -> str | None:
    """Why the Triton kernel cannot run these inputs, or None when it can (shapes assumed valid already)."""
    dim = query.shape[-1]
    if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
        return f"head_dim {dim} is outside [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if query.dtype not in SUPPORTED_DTYPES:
        return f"dtype {query.dtype} is not one of fp16/bf16/fp32"
    if segments and segments[0].keys.dtype != query.dtype:
        return f"query dtype {query.dtype} differs from the KV dtype {segments[0].keys.dtype}"
    for i, seg in enumerate(segments):
        for name in ("keys", "values", "positions", "valid"):
            if getattr(seg, name).device != query.device:
                return f"segment {i} {name} is on {getattr(seg, name).device}, the query on {query.device}"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _plan_split(total: int, programs: int, block_n: int, interpret: bool, device: torch.device) -> int:
    """Keys per split for one launch: enough programs to fill the GPU (~2 waves), never splits < 256 keys."""
    if interpret or device.type != "cuda":
        return max(total, 1)
    target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    splits = max(1, min(_cdiv(target, programs), _cdiv(total, _MIN_AUTO_SPLIT)))
    return _cdiv(_cdiv(total, splits), block_n) * block_n


def sparse_decode_attention_triton(
    query: torch.Tensor,
    segments: Sequence[KVSegment],
    query_positions: torch.Tensor,
    scaling: float,
    softcap: float | None = None,
    *,
    split_size: int | None = None,
    block_n: int | None = None,
    allow_tf32: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse decode attention with the Triton kernel; same contract as `sparse_decode_attention_reference`.

    Args:
        query: `(B, H_q, q, D)` fp16/bf16/fp32 queries after RoPE.
        segments: `KVSegment`s (keys/values `(B, H_kv, L, D)` in the query's dtype; positions int64 and valid
            bool broadcastable to `(B, H_kv, L)`), read in place.
        query_positions: int64 `(B, q)` or `(q,)`.
        scaling: softmax scale.
        softcap: logit soft-capping (`softcap * tanh(logit / softcap)`, as the reference); None = off.
        split_size: keys per split of the key axis (flash-decoding); default: chosen from the GPU's SM count
            (one split on CPU / interpreter). Small values force the split + merge path (tests).
        block_n: keys per tile (default 64, 32 for head_dim > 128); a power of two >= 16.
        allow_tf32: fp32 inputs only: use TF32 tensor-core dot products (faster, ~1e-3 relative error).
        out: optional `(B, H_q, q, D)` output tensor in the query's dtype (any strides), written in place.

    Returns:
        `(B, H_q, q, D)` in `query.dtype` (`out` when given).

    Raises:
        ValueError: mismatched shapes/dtypes (from `check_segments`) or a bad `out`/`split_size`/`block_n`.
        UnsupportedShapeError: head_dim outside [16, 256], dtype outside fp16/bf16/fp32, query dtype different
            from the KV dtype, or tensors on different devices.
    """
    seg_args = _segment_args(query, segments, query_positions)
    if seg_args is None:  # something is off: let the full checks name it
        check_segments(query, segments, query_positions)
        reason = unsupported_reason(query, segments)
        if reason is not None:
            raise UnsupportedShapeError(f"Triton sparse decode attention does not support this input: {reason}.")
        raise AssertionError("internal error: fast input validation rejected inputs the full checks accept.")
    batch, q_heads, q_len, dim = query.shape
    kv_heads = segments[0].keys.shape[1]
    groups = q_heads // kv_heads
    rows = groups * q_len
    device = query.device

    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    elif out.shape != query.shape or out.dtype != query.dtype or out.device != device:
        raise ValueError(f"out must be {tuple(query.shape)} {query.dtype} on {device}, got {tuple(out.shape)} "
                         f"{out.dtype} on {out.device}.")
    if query_positions.device != device:
        query_positions = query_positions.to(device)
    qpos = query_positions.expand(batch, q_len) if query_positions.dim() == 1 else query_positions
    if qpos.dtype != torch.int64:
        qpos = qpos.long()

    block_d = max(16, _next_pow2(dim))
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}.")
    if split_size is not None and split_size < 1:
        raise ValueError(f"split_size must be positive, got {split_size}.")
    block_m = min(_MAX_BLOCK_M, max(16, _next_pow2(rows)))
    m_blocks = _cdiv(rows, block_m)
    interpret = device.type != "cuda" or _interpret_env()
    kernels = _kernels(interpret)
    upcast = interpret and query.dtype == torch.bfloat16
    # only fp32 operands care; "tf32" is Triton's default for every other dtype
    ieee_dot = query.dtype == torch.float32 and not allow_tf32  # a bool constexpr (str ones fail on triton 3.6)
    programs = batch * kv_heads * m_blocks
    if softcap is None:
        scale_log2, cap_log2 = float(scaling) * _LOG2E, 0.0
    else:  # the kernel scales logits by 1 / softcap before tanh, and by softcap (in log2 units) after
        scale_log2, cap_log2 = float(scaling) / float(softcap), float(softcap) * _LOG2E

    # launches of up to 4 segments each; each launch covers its own range of workspace splits
    launches = []
    ws_splits = 0
    for first in range(0, len(segments), SEGMENTS_PER_LAUNCH):
        group = seg_args[first:first + SEGMENTS_PER_LAUNCH]
        total = sum(args[4] for args in group)  # args[4]: the segment's length
        if total == 0:
            continue
        split = split_size if split_size is not None else _plan_split(total, programs, block_n, interpret, device)
        n_splits = _cdiv(total, split)
        launches.append((group, split, ws_splits, n_splits))
        ws_splits += n_splits
    if not launches or out.numel() == 0:
        return out.zero_()
    if split_size is not None and max(launch[3] for launch in launches) > 65535:
        raise ValueError(f"split_size {split_size} gives more than 65535 splits (the grid's limit); use a larger one.")
    direct = ws_splits == 1
    if direct:
        ws_acc = ws_m = ws_l = out  # unused placeholders
    else:
        ws_acc = _workspace((batch * kv_heads, ws_splits, rows, dim), device)
        ws_m = _workspace((batch * kv_heads, ws_splits, rows), device)
        ws_l = _workspace((batch * kv_heads, ws_splits, rows), device)

    with _device_guard(device):
        for group, split, split_base, n_splits in launches:
            flat = [arg for args in group + [group[0]] * (SEGMENTS_PER_LAUNCH - len(group)) for arg in args]
            kernels._decode_kernel[(batch * kv_heads, n_splits, m_blocks)](
                query, qpos, out, ws_acc, ws_m, ws_l,
                *query.stride(), *qpos.stride(), *out.stride(),
                kv_heads, groups, rows, scale_log2, cap_log2, split, split_base, ws_splits,
                *flat,
                Q=q_len, HEAD_DIM=dim, NUM_SEGS=len(group), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                WRITE_OUT=direct, UPCAST=upcast, IEEE_DOT=ieee_dot, SOFTCAP=softcap is not None,
                num_warps=4 if block_d <= 128 else 8, num_stages=2, enable_fp_fusion=True,
            )
        if not direct:
            kernels._merge_kernel[(batch * kv_heads, m_blocks)](
                ws_acc, ws_m, ws_l, out, *out.stride(), kv_heads, groups, rows, ws_splits,
                Q=q_len, HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=True,
            )
    return out


def _broadcast_strides(tensor: torch.Tensor, shape: tuple) -> tuple | None:
    """Strides of `tensor` viewed as broadcast to the 3-d `shape` (0 on broadcast dims), None if it does not fit."""
    extra = 3 - tensor.dim()
    if extra < 0:
        return None
    sizes = (1,) * extra + tuple(tensor.shape)
    strides = (0,) * extra + tensor.stride()
    out = []
    for size, stride, want in zip(sizes, strides, shape):
        if size == want:
            out.append(stride if size != 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            return None
    return tuple(out)


def _segment_args(query: torch.Tensor, segments: Sequence[KVSegment], query_positions: torch.Tensor):
    """Kernel arguments of every segment, or None unless the inputs are well formed *and* supported.

    The decode hot path's validation: the same conditions as `check_segments` + `unsupported_reason`, without
    building broadcast tensors (`torch.broadcast_shapes` / `expand` cost microseconds each on the host).
    """
    if query.dim() != 4 or not segments or query.dtype not in SUPPORTED_DTYPES:
        return None
    batch, q_heads, q_len, dim = query.shape
    if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM or query_positions.shape not in ((batch, q_len), (q_len,)):
        return None
    kv_heads = segments[0].keys.shape[1]
    if kv_heads == 0 or q_heads % kv_heads:
        return None
    device, dtype = query.device, query.dtype
    result = []
    for seg in segments:
        keys, values, positions, valid = seg
        if keys.dim() != 4 or keys.shape != values.shape or keys.dtype != dtype or values.dtype != dtype:
            return None
        b, h, length, d = keys.shape
        if b != batch or h != kv_heads or d != dim or positions.dtype != torch.int64 or valid.dtype != torch.bool:
            return None
        if keys.device != device or values.device != device or positions.device != device or valid.device != device:
            return None
        shape = (batch, kv_heads, length)
        pos_strides = _broadcast_strides(positions, shape)
        ok_strides = _broadcast_strides(valid, shape)
        if pos_strides is None or ok_strides is None:
            return None
        result.append([keys, values, positions, valid, length, *keys.stride(), *values.stride(), *pos_strides,
                       *ok_strides])
    return result


def _workspace(shape, device: torch.device) -> torch.Tensor:
    """fp32 scratch for split partials (every element is written by the decode kernel before the merge reads)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def _device_guard(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.device(device)
    import contextlib

    return contextlib.nullcontext()
