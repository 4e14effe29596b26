"""The Triton sparse decode attention kernel against the torch reference.

CPU tensors run through Triton's interpreter (`TRITON_INTERPRET=1`; the kernel module builds interpreter-mode
kernels for CPU tensors even when triton was imported earlier without the variable, as transformers does).
Every run writes into a NaN-poisoned output and NaN-poisoned split workspaces, so an element the kernel fails
to write shows up as a mismatch. Inputs are fresh random tensors, never zeros. Cases stay small: the
interpreter executes each program in numpy.
"""

from __future__ import annotations

import types

import pytest
import torch

from dual_cache.kernels import KVSegment, dispatch, sparse_decode_attention, sparse_decode_attention_reference

if dispatch.triton_import_error() is not None:
    pytest.skip(f"triton is not importable: {dispatch.triton_import_error()}", allow_module_level=True)

from dual_cache.kernels import triton_decode  # noqa: E402
from dual_cache.kernels.triton_decode import UnsupportedShapeError, sparse_decode_attention_triton  # noqa: E402

TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


@pytest.fixture(autouse=True)
def _interpreter_and_poisoned_workspace(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    real = triton_decode._workspace

    def poisoned(shape, device):
        return real(shape, device).fill_(float("nan"))

    monkeypatch.setattr(triton_decode, "_workspace", poisoned)


def _run(query, segments, qpos, scaling, **kwargs):
    out = torch.full_like(query, float("nan"))
    result = sparse_decode_attention_triton(query, segments, qpos, scaling, out=out, **kwargs)
    assert result is out
    return out


def _check(query, segments, qpos, scaling, **kwargs):
    expected = sparse_decode_attention_reference(query, segments, qpos, scaling)
    got = _run(query, segments, qpos, scaling, **kwargs)
    assert not got.isnan().any(), "kernel left elements unwritten (NaN poison survived)"
    torch.testing.assert_close(got.float(), expected.float(), **TOL[query.dtype])
    return got


def _random_segments(gen, batch, kv_heads, dim, lengths, dtype, max_pos, broadcast=False):
    segments = []
    for length in lengths:
        keys = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
        values = torch.randn(batch, kv_heads, length, dim, generator=gen).to(dtype)
        if broadcast:  # one position row for every sequence and head, validity per sequence (the ring's layout)
            positions = torch.randint(0, max_pos, (1, 1, length), generator=gen)
            valid = torch.rand(batch, 1, length, generator=gen) > 0.25
        else:
            positions = torch.randint(0, max_pos, (batch, kv_heads, length), generator=gen)
            valid = torch.rand(batch, kv_heads, length, generator=gen) > 0.25
        segments.append(KVSegment(keys, values, positions, valid))
    return segments


def _cache_like(gen, batch, q_heads, kv_heads, dim, dtype, *, pads, context, n_sink=4, budget=24, window=10,
                q_len=2):
    """Segments laid out like the dual cache's: left-padded sequences, sink, per-head selection, window ring."""
    pads = torch.tensor(pads)
    # sink: the first n_sink real tokens of each sequence (positions per sequence, shared by heads)
    sink_pos = (pads[:, None] + torch.arange(n_sink))[:, None, :]
    sink = KVSegment(torch.randn(batch, kv_heads, n_sink, dim, generator=gen).to(dtype),
                     torch.randn(batch, kv_heads, n_sink, dim, generator=gen).to(dtype),
                     sink_pos, torch.ones(batch, 1, n_sink, dtype=torch.bool))
    # selection: distinct middle positions per (sequence, head); trailing slots unused for the shorter sequences
    sel_pos = torch.empty(batch, kv_heads, budget, dtype=torch.long)
    sel_ok = torch.zeros(batch, kv_heads, budget, dtype=torch.bool)
    for b in range(batch):
        lo, hi = int(pads[b]) + n_sink, context - window
        for h in range(kv_heads):
            pick = lo + torch.randperm(hi - lo, generator=gen)[:budget]
            sel_pos[b, h, : pick.numel()] = pick
            sel_pos[b, h, pick.numel():] = 0
            sel_ok[b, h, : pick.numel()] = True
    selection = KVSegment(torch.randn(batch, kv_heads, budget, dim, generator=gen).to(dtype),
                          torch.randn(batch, kv_heads, budget, dim, generator=gen).to(dtype), sel_pos, sel_ok)
    # ring: window + q_len slots holding the last positions in rotated slot order, shared by all sequences
    ring_len = window + q_len
    ring_positions = context - window + torch.arange(ring_len)
    shift = 5 % ring_len
    ring_positions = torch.roll(ring_positions, shift)[None, None]
    ring_valid = (ring_positions >= pads[:, None, None]).expand(batch, 1, ring_len).clone()
    ring = KVSegment(torch.randn(batch, kv_heads, ring_len, dim, generator=gen).to(dtype),
                     torch.randn(batch, kv_heads, ring_len, dim, generator=gen).to(dtype), ring_positions, ring_valid)
    query = torch.randn(batch, q_heads, q_len, dim, generator=gen).to(dtype)
    qpos = context + torch.arange(q_len)  # (q,): shared by all sequences, as in a left-padded batch
    return query, [sink, selection, ring], qpos


# (head_dim, q_heads, kv_heads, batch, q_len, dtype, lengths, broadcast, split_size)
MATRIX = [
    (64, 4, 4, 1, 1, torch.float32, [4, 37, 13], False, None),
    (64, 8, 2, 2, 2, torch.float16, [4, 50, 12], True, 16),
    (64, 4, 1, 3, 2, torch.bfloat16, [3, 29, 11], True, None),
    (128, 8, 2, 2, 2, torch.float32, [4, 45, 12], False, 20),
    (128, 4, 1, 1, 1, torch.bfloat16, [4, 33, 10], False, 16),
    (128, 2, 2, 3, 2, torch.float16, [5, 19, 9], True, None),
    (256, 4, 1, 2, 2, torch.float16, [4, 21, 10], True, 16),
    (256, 2, 2, 1, 1, torch.float32, [2, 17, 7], False, None),
    (256, 8, 2, 1, 2, torch.bfloat16, [4, 26, 6], False, 11),
    (16, 6, 2, 2, 2, torch.float32, [4, 23, 9], True, 8),
    (80, 6, 3, 2, 2, torch.float16, [4, 31, 8], False, None),  # padded head_dim (not a power of two)
]


@pytest.mark.parametrize("case", range(len(MATRIX)))
def test_matches_reference_random(case):
    dim, q_heads, kv_heads, batch, q_len, dtype, lengths, broadcast, split_size = MATRIX[case]
    gen = torch.Generator().manual_seed(100 + case)
    max_pos = 60
    segments = _random_segments(gen, batch, kv_heads, dim, lengths, dtype, max_pos, broadcast)
    query = torch.randn(batch, q_heads, q_len, dim, generator=gen).to(dtype)
    qpos = torch.randint(max_pos // 3, max_pos, (batch, 1), generator=gen) + torch.arange(q_len)
    _check(query, segments, qpos, dim ** -0.5, split_size=split_size, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (8, 2), (4, 1)])
def test_matches_reference_cache_layout(dtype, q_heads, kv_heads):
    """Left-padded batch, sink + selection + rotated ring with (1,1,L) positions and (B,1,L) validity."""
    gen = torch.Generator().manual_seed(11 + q_heads * 7 + kv_heads)
    query, segments, qpos = _cache_like(gen, 3, q_heads, kv_heads, 64, dtype, pads=[0, 5, 17], context=60)
    assert segments[2].positions.shape == (1, 1, 12) and segments[2].valid.shape == (3, 1, 12)
    _check(query, segments, qpos, 64 ** -0.5, block_n=16)
    _check(query, segments, qpos, 64 ** -0.5, block_n=16, split_size=13)  # splits straddle segment boundaries


def test_query_slots_are_causal_to_each_other():
    """Slot 0 (real token) must not see slot 1's (speculated token's) key, slot 1 sees both."""
    gen = torch.Generator().manual_seed(3)
    query, segments, qpos = _cache_like(gen, 2, 4, 2, 64, torch.float32, pads=[0, 3], context=40)
    got = _check(query, segments, qpos, 64 ** -0.5, block_n=16)
    ring = segments[2]
    newest = ring.positions == qpos[1]
    bumped = KVSegment(ring.keys, ring.values.masked_fill(newest[..., None], 100.0), ring.positions, ring.valid)
    again = _check(query, [segments[0], segments[1], bumped], qpos, 64 ** -0.5, block_n=16)
    torch.testing.assert_close(again[:, :, 0], got[:, :, 0])  # slot 0 unaffected by the speculated token's value
    assert not torch.allclose(again[:, :, 1], got[:, :, 1])


def test_split_sizes_agree_and_sharp_softmax():
    """Many splits (incl. empty ones and splits smaller than a tile) merge to the same result; large logits."""
    gen = torch.Generator().manual_seed(5)
    segments = _random_segments(gen, 2, 2, 64, [4, 70, 14], torch.float32, 90)
    query = torch.randn(2, 4, 2, 64, generator=gen) * 4.0
    qpos = torch.tensor([[80, 81], [40, 41]])
    one = _check(query, segments, qpos, 1.0, block_n=16)  # logits with std ~30: exp2 must not overflow
    for split in (5, 16, 33, 200):
        torch.testing.assert_close(_check(query, segments, qpos, 1.0, block_n=16, split_size=split), one)


def test_many_segments_and_empty_segments():
    gen = torch.Generator().manual_seed(9)
    segments = _random_segments(gen, 2, 2, 32, [4, 0, 19, 7, 11, 0, 5], torch.float16, 50)
    query = torch.randn(2, 4, 2, 32, generator=gen).half()
    qpos = torch.tensor([45, 46])
    _check(query, segments, qpos, 32 ** -0.5, block_n=16)
    _check(query, segments, qpos, 32 ** -0.5, block_n=16, split_size=9)


def test_rows_with_nothing_allowed_are_zero_and_all_empty_is_zero():
    gen = torch.Generator().manual_seed(4)
    segments = _random_segments(gen, 3, 1, 64, [4, 20], torch.float32, 30)
    segments[1] = segments[1]._replace(valid=segments[1].valid.clone())
    segments[0].valid[1] = False
    segments[1].valid[1] = False  # sequence 1: nothing valid at all
    segments[0].positions[2] = 25
    segments[1].positions[2] = 25  # sequence 2: every entry after slot 0's position, but not after slot 1's
    query = torch.randn(3, 2, 2, 64, generator=gen)
    qpos = torch.tensor([[28, 29], [28, 29], [24, 25]])
    got = _check(query, segments, qpos, 0.125, block_n=16, split_size=7)
    assert got[1].abs().max() == 0 and got[2, :, 0].abs().max() == 0 and got[2, :, 1].abs().max() > 0
    empty = [KVSegment(torch.randn(3, 1, 0, 64), torch.randn(3, 1, 0, 64), torch.zeros(0, dtype=torch.long),
                       torch.zeros(0, dtype=torch.bool))]
    assert _run(query, empty, qpos, 0.125).abs().max() == 0


def test_garbage_in_invalid_slots_is_never_read():
    gen = torch.Generator().manual_seed(8)
    segments = _random_segments(gen, 2, 2, 64, [4, 24], torch.float16, 30)
    query = torch.randn(2, 4, 1, 64, generator=gen).half()
    qpos = torch.tensor([29])
    expected = sparse_decode_attention_reference(query, segments, qpos, 0.125)
    dirty = [seg._replace(keys=seg.keys.masked_fill(~seg.valid[..., None], float("nan")),
                          values=seg.values.masked_fill(~seg.valid[..., None], float("inf"))) for seg in segments]
    torch.testing.assert_close(_run(query, dirty, qpos, 0.125, block_n=16).float(), expected.float(),
                               **TOL[torch.float16])


def test_strided_views_are_read_in_place():
    """Segments as views of larger buffers, a transposed query and a strided output."""
    gen = torch.Generator().manual_seed(12)
    batch, q_heads, kv_heads, dim, q_len = 2, 4, 2, 64, 2
    buffer = torch.randn(batch, kv_heads, 40, 2, dim, generator=gen)  # (.., slot, k/v, D): K and V interleaved
    keys, values = buffer[:, :, 5:33, 0], buffer[:, :, 5:33, 1]
    positions = torch.randint(0, 50, (batch, kv_heads, 28), generator=gen)
    valid = torch.rand(batch, kv_heads, 28, generator=gen) > 0.2
    sink = _random_segments(gen, batch, kv_heads, dim, [4], torch.float32, 50)[0]
    segments = [sink, KVSegment(keys, values, positions[..., ::1], valid)]
    query = torch.randn(batch, q_len, q_heads, dim, generator=gen).transpose(1, 2)  # (B, H, q, D), not contiguous
    qpos = torch.tensor([48, 49])
    expected = sparse_decode_attention_reference(query, segments, qpos, 0.125)
    out = torch.full((batch, q_len, q_heads, dim), float("nan")).transpose(1, 2)
    sparse_decode_attention_triton(query, segments, qpos, 0.125, out=out, split_size=10, block_n=16)
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


@pytest.mark.parametrize("pos_shape, ok_shape", [
    ((20,), (2, 1, 20)), ((1, 1, 20), (20,)), ((2, 1, 20), (1, 3, 20)), ((1, 3, 20), (2, 3, 20)),
])
def test_broadcast_layouts(pos_shape, ok_shape):
    gen = torch.Generator().manual_seed(21)
    keys, values = torch.randn(2, 3, 20, 32, generator=gen), torch.randn(2, 3, 20, 32, generator=gen)
    positions = torch.randint(0, 30, pos_shape, generator=gen)
    valid = torch.rand(ok_shape, generator=gen) > 0.3
    query = torch.randn(2, 6, 2, 32, generator=gen)
    _check(query, [KVSegment(keys, values, positions, valid)], torch.tensor([[25, 26], [12, 13]]), 0.2, block_n=16)


def test_unsupported_inputs_raise():
    gen = torch.Generator().manual_seed(1)
    segments = _random_segments(gen, 1, 2, 8, [4, 6], torch.float32, 20)
    with pytest.raises(UnsupportedShapeError, match="head_dim 8"):
        sparse_decode_attention_triton(torch.randn(1, 4, 1, 8), segments, torch.tensor([19]), 0.3)
    big = _random_segments(gen, 1, 1, 512, [4], torch.float32, 20)
    with pytest.raises(UnsupportedShapeError, match="head_dim 512"):
        sparse_decode_attention_triton(torch.randn(1, 1, 1, 512), big, torch.tensor([19]), 0.3)
    half = _random_segments(gen, 1, 2, 64, [4], torch.float16, 20)
    with pytest.raises(UnsupportedShapeError, match="differs"):
        sparse_decode_attention_triton(torch.randn(1, 2, 1, 64), half, torch.tensor([19]), 0.3)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        sparse_decode_attention_triton(torch.randn(1, 3, 1, 64).half(), half, torch.tensor([19]), 0.3)


def test_dispatch_backends(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    segments = _random_segments(gen, 2, 2, 64, [4, 20], torch.float32, 30)
    query = torch.randn(2, 4, 2, 64, generator=gen)
    qpos = torch.tensor([28, 29])
    expected = sparse_decode_attention_reference(query, segments, qpos, 0.125)
    assert dispatch.resolve_backend(query, segments, "auto") == "torch"  # CPU tensors
    torch.testing.assert_close(sparse_decode_attention(query, segments, qpos, 0.125), expected)
    torch.testing.assert_close(sparse_decode_attention(query, segments, qpos, 0.125, backend="torch"), expected)
    torch.testing.assert_close(sparse_decode_attention(query, segments, qpos, 0.125, backend="triton"), expected,
                               **TOL[torch.float32])
    with pytest.raises(ValueError, match="backend must be one of"):
        sparse_decode_attention(query, segments, qpos, 0.125, backend="cuda")
    tiny = _random_segments(gen, 1, 1, 8, [5], torch.float32, 10)
    with pytest.raises(UnsupportedShapeError):
        sparse_decode_attention(torch.randn(1, 2, 1, 8), tiny, torch.tensor([9]), 0.3, backend="triton")
    monkeypatch.setattr(dispatch, "triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    assert dispatch.resolve_backend(query, segments, "auto") == "torch"
    with pytest.raises(RuntimeError, match="backend 'triton' is unavailable"):
        sparse_decode_attention(query, segments, qpos, 0.125, backend="triton")


@pytest.mark.parametrize("dtype, dim, arch", [
    (torch.float16, 64, 90),
    pytest.param(torch.bfloat16, 128, 80, marks=pytest.mark.slow),  # ~30 s of compiling on 2 cores
    pytest.param(torch.float32, 256, 90, marks=pytest.mark.slow),
])
def test_compiles_for_cuda_without_a_gpu(dtype, dim, arch, monkeypatch, tmp_path):
    """The interpreter is lenient; compile the real (non-interpreted) kernels to a cubin for sm_80/sm_90 on CPU.

    Launch arguments are captured from the wrapper and turned into the signature Triton's JIT would build
    (including its specialization of stride-1 arguments and 16-divisible pointers/ints).
    """
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import ASTSource
        from triton.runtime.jit import mangle_type
        import triton
    except ImportError as error:  # internal API moved
        pytest.skip(f"triton's ahead-of-time compile API is not available: {error}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compiled = triton_decode._kernels(False)
    captured = []

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.append((self.name, args, kwargs))

    monkeypatch.setattr(triton_decode, "_kernels", lambda interpret: types.SimpleNamespace(
        _decode_kernel=Capture("_decode_kernel"), _merge_kernel=Capture("_merge_kernel")))
    gen = torch.Generator().manual_seed(0)
    segments = _random_segments(gen, 2, 2, dim, [4, 40, 10], dtype, 60, broadcast=True)
    query = torch.randn(2, 8, 2, dim, generator=gen).to(dtype)
    sparse_decode_attention_triton(query, segments, torch.tensor([58, 59]), 0.1, split_size=16)  # split + merge
    sparse_decode_attention_triton(query, segments, torch.tensor([58, 59]), 0.1)  # one split: direct write
    assert [name for name, *_ in captured] == ["_decode_kernel", "_merge_kernel", "_decode_kernel"]
    for name, args, kwargs in captured:
        fn = getattr(compiled, name)
        options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "enable_fp_fusion") if key in kwargs}
        bound = dict(zip(fn.arg_names, args), **kwargs)
        assert set(bound) == set(fn.arg_names), "launch arguments do not match the kernel's parameters"
        signature, constants, attrs = {}, {}, {}
        for param in fn.params:  # what the JIT decides per parameter: constexpr only where the kernel says so
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name], constants[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = mangle_type(value)
                attrs[(param.num,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            elif value == 1 and not param.do_not_specialize:
                signature[param.name], constants[param.name] = "constexpr", 1
            else:
                signature[param.name] = "i32"
                if value % 16 == 0 and not param.do_not_specialize:
                    attrs[(param.num,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                                options=options)
        assert kernel.asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled-kernel check needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim, q_heads, kv_heads", [(64, 9, 3), (128, 32, 8), (256, 8, 1)])
def test_cuda_compiled_matches_reference(dtype, dim, q_heads, kv_heads, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    gen = torch.Generator().manual_seed(dim + q_heads)
    segments = _random_segments(gen, 3, kv_heads, dim, [4, 1500, 66], dtype, 2000, broadcast=True)
    segments = [KVSegment(*(t.cuda() for t in seg)) for seg in segments]
    query = torch.randn(3, q_heads, 2, dim, generator=gen).to(dtype).cuda()
    qpos = torch.tensor([1998, 1999], device="cuda")
    assert dispatch.resolve_backend(query, segments, "auto") == "triton"
    for split in (None, 128, 100000):
        _check(query, segments, qpos, dim ** -0.5, split_size=split)
    torch.testing.assert_close(sparse_decode_attention(query, segments, qpos, dim ** -0.5).float(),
                               sparse_decode_attention_reference(query, segments, qpos, dim ** -0.5).float(),
                               **TOL[dtype])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_falls_back_for_unsupported_head_dim():
    gen = torch.Generator().manual_seed(0)
    segments = _random_segments(gen, 2, 2, 8, [4, 30], torch.float16, 40)
    segments = [KVSegment(*(t.cuda() for t in seg)) for seg in segments]
    query = torch.randn(2, 4, 2, 8, generator=gen).half().cuda()
    qpos = torch.tensor([38, 39], device="cuda")
    assert dispatch.resolve_backend(query, segments, "auto") == "torch"
    torch.testing.assert_close(sparse_decode_attention(query, segments, qpos, 0.3),
                               sparse_decode_attention_reference(query, segments, qpos, 0.3))


def test_generate_with_triton_kernel_matches_torch(monkeypatch):
    """End to end through the dual cache's attention (config `attention_kernel`), interpreter on CPU."""
    from tests.conftest import tiny_llama

    calls = []
    real = triton_decode.sparse_decode_attention_triton

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_decode, "sparse_decode_attention_triton", spy)
    model = tiny_llama(seed=11)  # head_dim 16, 4 query / 2 KV heads
    ids = torch.randint(3, 96, (2, 70), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :20] = 0  # left padding
    config = {"budget": 12, "n_sink": 4, "window": 8, "early_layers": 0, "retrieval_threads": 0}
    outs = {kernel: model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   cache_implementation="dual", cache_config={**config, "attention_kernel": kernel})
            for kernel in ("torch", "triton")}
    assert calls, "the Triton kernel was never called"
    assert torch.equal(outs["torch"], outs["triton"])


def test_triton_older_than_the_floor_is_refused(monkeypatch):
    """Below `MIN_TRITON` (3.6, the CUDA test machine's triton) "auto" must not pick the kernel."""
    triton = pytest.importorskip("triton")
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    dispatch.triton_import_error.cache_clear()
    try:
        assert "older than 3.6" in dispatch.triton_import_error()
        query = torch.randn(1, 2, 2, 16)
        with pytest.raises(RuntimeError, match="triton>=3.6"):
            dispatch.sparse_decode_attention(query, [], torch.tensor([0, 1]), 0.25, backend="triton")
    finally:
        monkeypatch.undo()
        dispatch.triton_import_error.cache_clear()


@pytest.mark.parametrize("dtype, split_size", [(torch.float32, None), (torch.float16, 16), (torch.bfloat16, 8)])
def test_softcap_matches_reference(dtype, split_size):
    """Logit soft-capping (Gemma 2): `softcap * tanh(logit / softcap)` in the kernel as in the reference, with
    logits large enough (×4 queries, cap 5) that the cap changes the output."""
    gen = torch.Generator().manual_seed(211)
    segments = _random_segments(gen, 2, 2, 64, [4, 37, 13], dtype, 60)
    query = (4 * torch.randn(2, 4, 2, 64, generator=gen)).to(dtype)
    qpos = torch.tensor([[40, 41], [58, 59]])
    expected = sparse_decode_attention_reference(query, segments, qpos, 64 ** -0.5, softcap=5.0)
    uncapped = sparse_decode_attention_reference(query, segments, qpos, 64 ** -0.5)
    assert (expected.float() - uncapped.float()).abs().max() > 0.1
    out = torch.full_like(query, float("nan"))
    got = sparse_decode_attention_triton(query, segments, qpos, 64 ** -0.5, 5.0, out=out, split_size=split_size,
                                         block_n=16)
    torch.testing.assert_close(got.float(), expected.float(), **TOL[dtype])
    torch.testing.assert_close(sparse_decode_attention(query, segments, qpos, 64 ** -0.5, backend="triton",
                                                       softcap=5.0).float(), expected.float(), **TOL[dtype])


def test_auto_on_cuda_warns_once_per_reason_when_it_falls_back(monkeypatch):
    """A CUDA call the kernel refuses (here: a refusal forced on CPU tensors) runs the reference and says so once,
    naming the shapes and dtypes; the result is the reference's."""
    gen = torch.Generator().manual_seed(5)
    segments = _random_segments(gen, 2, 2, 16, [4, 30], torch.float32, 40)
    query = torch.randn(2, 4, 2, 16, generator=gen)
    qpos = torch.tensor([38, 39])

    def refuse(*args, **kwargs):
        raise triton_decode.UnsupportedShapeError("head_dim 16 refused for this test")

    monkeypatch.setattr(dispatch, "_on_cuda", lambda query: True)
    monkeypatch.setattr(triton_decode, "sparse_decode_attention_triton", refuse)
    monkeypatch.setattr(dispatch, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"falls back.*head_dim 16 refused.*query \(2, 4, 2, 16\) torch.float32"):
        out = sparse_decode_attention(query, segments, qpos, 0.25)
    torch.testing.assert_close(out, sparse_decode_attention_reference(query, segments, qpos, 0.25))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second warning
        sparse_decode_attention(query, segments, qpos, 0.25)
