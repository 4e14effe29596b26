"""The native selection engine (`dual_cache/engine/`) against its pure-torch reference, on random inputs, and the
`lowbit` selector built on it: every build variant this CPU runs selects what the reference selects, for any
thread count; the index grown step by step equals one built at once; a missing compiler falls back to the
reference with one warning; bad options are refused."""

from __future__ import annotations

import warnings

import pytest
import torch

from dual_cache import engine
from dual_cache.config import DualDecoderConfig
from dual_cache.engine import codes, native, reference
from dual_cache.host.store import HostKVStore
from dual_cache.selection.candidates import Candidates
from dual_cache.selection.selectors import SELECTORS
from tests.conftest import tiny_llama

VARIANTS = native.supported_variants()  # what this CPU runs, best last


def _runnable(variant: str) -> None:
    """Skip, saying why, when this CPU cannot run `variant` (its selections are then checked where it runs; its
    integer arithmetic by `test_the_vnni_scan_arithmetic_by_emulation` here, its build by
    `test_every_variant_builds`)."""
    if variant not in VARIANTS:
        pytest.skip(f"this CPU cannot run the {variant} engine variant (it runs {VARIANTS})")


def _problem(seed, batch, kv_heads, group, dim, n, dtype, chunks=3, shared=False):
    """Random queries, a mask with holes, keys in `chunks` store-like chunks, and a 2-bit index per sequence."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * group, dim, generator=gen)
    keys = (torch.randn(1 if shared else batch, kv_heads, n, dim, generator=gen) * 2).to(dtype)
    keys = keys.expand(batch, -1, -1, -1)
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: chunks - 1].add(1).tolist())
    pieces = [keys[:1 if shared else batch, :, a:b].contiguous() for a, b in zip([0, *cuts], [*cuts, n])]
    end = n - 7
    mask = torch.rand(batch, end, generator=gen) > 0.15
    first = torch.randint(0, 40, (batch,), generator=gen)
    for b in range(batch):
        mask[b, : int(first[b])] = False  # pads before the first real token
    groups = torch.div(end - first, codes.GROUP, rounding_mode="floor")
    dim_q = codes.padded_dim(dim)
    capacity = int(groups.max()) + 1
    packed = torch.zeros(batch, kv_heads, dim_q // 4, capacity, 64, dtype=torch.uint8).permute(0, 1, 3, 2, 4)
    params = torch.zeros(batch, kv_heads, capacity, 2, dim_q, dtype=torch.bfloat16)
    for b in range(batch):
        g, f = int(groups[b]), int(first[b])
        p, q = codes.quantize(keys[b, :, f : f + g * codes.GROUP].reshape(kv_heads * g, codes.GROUP, dim))
        packed[b, :, :g], params[b, :, :g] = p.view(kv_heads, g, -1, 64), q.view(kv_heads, g, 2, -1)
    return query, mask, pieces, engine.IndexView(packed, params, first, groups)


CASES = [  # batch, KV heads, GQA group, head dim, positions, dtype
    (2, 3, 3, 64, 700, torch.float32),
    (1, 2, 4, 128, 2100, torch.bfloat16),
    (3, 1, 5, 20, 517, torch.float16),
    (2, 2, 9, 18, 900, torch.bfloat16),  # more than 8 query heads per KV head; a head dim not a multiple of 4
    (1, 4, 1, 64, 800, torch.bfloat16),  # MHA: 16-row SIMD blocks
    (2, 2, 2, 40, 650, torch.float16),  # 8-row blocks, a partial channel block
    (1, 2, 4, 32, 9000, torch.bfloat16),  # long enough for the sampled threshold of the top-k
]


@pytest.mark.parametrize("variant", list(native.VARIANTS))
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("seed", [11, 12])
def test_every_variant_selects_what_the_reference_selects(variant, case, seed):
    _runnable(variant)
    batch, kv_heads, group, dim, n, dtype = CASES[case]
    query, mask, keys, index = _problem(seed * 10 + case, batch, kv_heads, group, dim, n, dtype)
    view = (index.packed, index.params, index.group_first, index.usable(mask.shape[1]))
    library = native.library(variant)
    all_quads = codes.padded_dim(dim) // 4
    for budget, shortlist, with_index, quads in [(8, 0, False, None), (48, 0, False, None), (8, 32, True, None),
                                                 (48, 96, True, max(1, all_quads // 3)), (8, 24, True, 1),
                                                 (16, 10_000, True, 2)]:
        expected = reference.select(query, mask, keys, budget, dim ** -0.5, view if with_index else None, shortlist,
                                    quads=quads)
        got = engine._native_select(library, query, mask, keys, budget, dim ** -0.5, index if with_index else None,
                                    shortlist, threads=2, quads=quads)
        assert torch.equal(got[1], expected[1]), (budget, shortlist, with_index, quads)
        assert torch.equal(got[0], expected[0]), (budget, shortlist, with_index, quads)


def test_shared_prefix_chunk_and_more_budget_than_candidates():
    query, mask, keys, index = _problem(3, 3, 2, 2, 32, 300, torch.bfloat16, shared=True)
    assert keys[0].shape[0] == 1  # one stored sequence read by the three rows
    for with_index in (False, True):
        view = (index.packed, index.params, index.group_first, index.usable(mask.shape[1])) if with_index else None
        expected = reference.select(query, mask, keys, 400, 0.2, view, 64)
        got = engine.select(query, mask, keys, 400, 0.2, index if with_index else None, 64)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        if not with_index:  # every candidate, once
            assert torch.equal(got[1].sum(-1), mask.sum(-1, keepdim=True).expand(-1, 2))


@pytest.mark.parametrize("n", [500, 20000])  # the sampled threshold of the top-k runs on the longer one
def test_equal_scores_go_to_the_lower_position(n):
    key = torch.randn(1, 1, 1, 16)
    keys = [key.expand(1, 1, n, 16).contiguous()]  # every key equal: every mass ties
    mask = torch.ones(1, n - 20, dtype=torch.bool)
    mask[0, :4] = False
    indices, valid = engine.select(torch.randn(1, 2, 16), mask, keys, 10, 0.25)
    assert valid.all() and indices[0, 0].tolist() == list(range(4, 14))


@pytest.mark.parametrize("variant", list(native.VARIANTS))
def test_result_does_not_depend_on_threads_or_variant(variant):
    _runnable(variant)
    query, mask, keys, index = _problem(5, 4, 3, 4, 64, 12000, torch.bfloat16)  # large enough to start threads
    library = native.library(variant)
    for quads in (16, 5):  # every channel quad, and a subset of them
        scalar = engine._native_select(native.library("scalar"), query, mask, keys, 32, 0.125, index, 128, 1, quads)
        for threads in (1, 2, 5, 64):
            other = engine._native_select(library, query, mask, keys, 32, 0.125, index, 128, threads, quads)
            assert torch.equal(scalar[0], other[0]) and torch.equal(scalar[1], other[1])


@pytest.mark.parametrize("variant", list(native.VARIANTS))
@pytest.mark.parametrize("batch, kv_heads", [(1, 1), (1, 2), (2, 1)])
def test_a_task_split_over_threads_selects_and_gathers_what_one_thread_does(variant, batch, kv_heads):
    """With more threads than (sequence, KV head) tasks (MQA, batch 1), each task's scan groups and exact rows are
    split over threads (2 to 4 parts of a task here, and uneven splits): the indices and the gathered K/V equal one
    thread's, with and without an index, with a shortlist that the split scan must fill from every part."""
    _runnable(variant)
    n = 3 * 16384 + 900  # up to 3 parts of at least 16K positions per task
    query, mask, keys, index = _problem(31 + kv_heads, batch, kv_heads, 4, 48, n, torch.bfloat16)
    gen = torch.Generator().manual_seed(32)
    values = [torch.randn(chunk.shape, generator=gen).to(chunk.dtype) for chunk in keys]
    prepared = engine.chunks(keys, values)
    library = native.library(variant)
    for with_index, shortlist, quads in [(True, 512, 3), (True, 40, 12), (False, 0, None)]:
        view = index if with_index else None

        def run(threads):
            out = tuple(torch.zeros(batch, kv_heads, 24, 48, dtype=torch.bfloat16) for _ in range(2))
            got = engine._native_select(library, query, mask, prepared, 24, 0.15, view, shortlist, threads, quads, out)
            return got, out

        (one, one_out) = run(1)
        for threads in (2, 3, 4, 7):
            (got, out) = run(threads)
            assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1]), (with_index, threads)
            assert torch.equal(out[0], one_out[0]) and torch.equal(out[1], one_out[1]), (with_index, threads)
    if variant == VARIANTS[-1]:  # and one thread's selection is the reference's
        expected = reference.select(query, mask, keys, 24, 0.15, (index.packed, index.params, index.group_first,
                                                                  index.usable(mask.shape[1])), 512, quads=3)
        got = engine._native_select(library, query, mask, keys, 24, 0.15, index, 512, 4, 3)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def _select_in_child(queue, args):  # a fork()ed child's calls (module level: multiprocessing pickles it by name)
    answers = []
    for variant in VARIANTS:  # each variant a library of its own, some never called on threads before the fork
        library = native.library(variant)
        got = engine._native_select(library, *args)
        answers.append(([t.tolist() for t in got], library.dc_last_threads()))
    queue.put(answers)


OPENMP_TEAM, KEPT_THREADS, STARTED_THREADS = 1, 2, 3  # dc_last_threads()


def _openmp_loaded() -> bool:
    """Whether the process holds GNU libgomp (torch's OpenMP runtime in its Linux wheels), which the engine runs
    its workers on."""
    with open("/proc/self/maps") as maps:
        return "libgomp" in maps.read()


def test_threads_kept_between_calls_serve_concurrent_calls_a_forked_child_and_a_release():
    """A call's workers run on torch's OpenMP team when the process has one (its threads spin after torch's own
    operations, on the cores the engine needs), else on threads the engine keeps between calls. Calls from several
    Python threads at once, a fork()ed child (which has none of the parent's threads: a call there must not wait for
    them), and calls after `dc_release_scratch` stopped the kept threads all select what one thread selects."""
    import concurrent.futures
    import multiprocessing

    if engine.native.library() is None:
        pytest.skip("no native engine here (no compiler): the pure-torch reference keeps no threads")
    library = native.library(native.active_variant())
    query, mask, keys, index = _problem(41, 1, 1, 4, 32, 2 * 16384 + 500, torch.bfloat16)
    args = (query, mask, keys, 16, 0.2, index, 256, 2, 5)  # one task in two parts, on two threads at once
    expected = engine._native_select(library, *args[:-2], 1, 5)
    got = engine._native_select(library, *args)
    assert library.dc_last_threads() == (OPENMP_TEAM if _openmp_loaded() else KEPT_THREADS)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: engine._native_select(library, *args), range(12)))
    assert all(torch.equal(r[0], expected[0]) and torch.equal(r[1], expected[1]) for r in results)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_select_in_child, args=(queue, args))
    torch.ones(2**22).add_(1)  # torch's OpenMP team busy in the parent just before the fork
    child.start()
    try:
        answers = queue.get(timeout=120)  # a child waiting for threads it does not have never answers
        child.join(timeout=120)
    finally:
        child.kill()
    assert child.exitcode == 0 and len(answers) == len(VARIANTS)
    for got, used in answers:
        assert got == [t.tolist() for t in expected]
        assert used == KEPT_THREADS  # libgomp's threads are the parent's
    library.dc_release_scratch()
    library.dc_release_scratch()  # idempotent
    again = engine._native_select(library, *args)
    assert torch.equal(again[0], expected[0]) and torch.equal(again[1], expected[1])


@pytest.mark.parametrize("env", [{"DUAL_CACHE_ENGINE_OWN_THREADS": "1"}, {"OMP_THREAD_LIMIT": "1"}])
def test_without_an_openmp_team_the_kept_threads_select_the_same(env):
    """Where the engine does not use the OpenMP team (switched off, or a team that comes short: OMP_THREAD_LIMIT=1,
    as for a call made inside an OpenMP region), its own threads run the workers, split tasks included, with the
    same selections (in a fresh process: the runtime is looked up once per process)."""
    import json
    import os
    import subprocess
    import sys

    if engine.native.library() is None:
        pytest.skip("no native engine here (no compiler)")
    script = (
        "import json, torch\n"
        "from tests.test_engine import _problem\n"
        "from dual_cache import engine\n"
        "from dual_cache.engine import native\n"
        "library = native.library(native.active_variant())\n"
        "query, mask, keys, index = _problem(43, 1, 2, 4, 32, 4 * 16384 + 500, torch.bfloat16)\n"
        "one = engine._native_select(library, query, mask, keys, 16, 0.2, index, 256, 1, 5)\n"
        "out = []\n"
        "for threads in (2, 4):\n"
        "    got = engine._native_select(library, query, mask, keys, 16, 0.2, index, 256, threads, 5)\n"
        "    out.append([torch.equal(got[0], one[0]) and torch.equal(got[1], one[1]), library.dc_last_threads()])\n"
        "print(json.dumps(out))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    # 4 threads: 4 workers (2 tasks in 2 parts), kept when the CPU has 3 cores besides the caller's, else started
    beyond = KEPT_THREADS if (os.cpu_count() or 1) >= 3 else STARTED_THREADS
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [[True, KEPT_THREADS], [True, beyond]]


def test_the_vnni_scan_arithmetic_by_emulation():
    """The AVX-512 scan's integer trick, emulated in torch on random codes and weights (so it is checked on CPUs
    without VNNI too): a quad's 64-byte line masked with 3 << 2i holds 4^i x the codes of bit pair i; a 4-way u8 x s8
    dot per 32-bit lane (vpdpbusd) of that with the quad's 4 weights, summed over quads, is 4^i x the exact dot of
    tokens 16 tb + 4 i + w at lane 4 tb + w; an arithmetic shift right by 2i restores it."""
    gen = torch.Generator().manual_seed(41)
    quads = 7
    raw = torch.randint(0, 4, (1, codes.GROUP, 4 * quads), generator=gen, dtype=torch.uint8)
    lines = codes.pack(raw).view(quads, 64).long()  # (quad, 64 bytes)
    weights = torch.randint(-127, 128, (quads, 4), generator=gen)  # int8 weights of each quad's 4 channels
    expected = raw[0].long() @ weights.flatten()  # (64 tokens,) the exact dot per token
    sums = torch.zeros(4, 16, dtype=torch.long)  # (bit pair i, lane)
    for i in range(4):
        masked = lines & (3 << 2 * i)  # u8 operands, <= 192
        assert int(masked.max()) < 256
        lanes = masked.view(quads, 16, 4)  # dword lane = 4 consecutive bytes
        sums[i] = (lanes * weights[:, None, :]).sum(dim=(0, 2))  # vpdpbusd, accumulated over the quads
        assert bool((sums[i] % 4**i == 0).all())
        sums[i] = sums[i] >> 2 * i  # exact: a multiple of 4^i
    assert int(sums.abs().max()) < 2**31
    tokens = torch.tensor([[16 * (lane // 4) + 4 * i + lane % 4 for lane in range(16)] for i in range(4)])
    assert torch.equal(sums.flatten(), expected[tokens.flatten()])  # bit-pair order -> token order


@pytest.mark.parametrize("variant", list(native.VARIANTS))
def test_every_variant_builds(variant, fresh_engine):
    """Each variant compiles with this machine's compiler, whether or not the CPU runs it (a CPU without AVX-512
    VNNI still builds that variant's scan)."""
    if native._compiler() is None:
        pytest.skip("no C++ compiler on PATH")
    assert native._build(variant).exists()


def test_codes_round_trip_and_dequantize_within_half_a_step():
    gen = torch.Generator().manual_seed(8)
    raw = torch.randint(0, 4, (3, codes.GROUP, 12), generator=gen, dtype=torch.uint8)
    assert torch.equal(codes.unpack(codes.pack(raw)), raw)
    keys = torch.randn(5, codes.GROUP, 10, generator=gen) * 3
    packed, params = codes.quantize(keys)
    low, step = params[:, 0, :10].float()[:, None], params[:, 1, :10].float()[:, None]
    restored = low + step * codes.unpack(packed)[:, :, :10].float()
    # nearest level of the stored (bf16-rounded) minimum and step; levels outside [min, max] only by rounding
    nearest = low + step * ((keys - low) / step).round().clamp(0, 3)
    assert torch.equal(restored, nearest)
    assert ((restored - keys).abs() <= step * 0.5 + 0.02 * keys.abs().amax()).all()


def _store(seed, batch=2, kv_heads=2, dim=16, tokens=400):
    store = HostKVStore(batch, kv_heads, dim, torch.bfloat16, chunk_tokens=128)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn(batch, kv_heads, tokens, dim, generator=gen).bfloat16()
    for lo in range(0, tokens, 97):  # appends across chunk boundaries
        store.append(data[:, :, lo : lo + 97], data[:, :, lo : lo + 97])
    return store


def test_index_grown_step_by_step_equals_one_built_at_once():
    config = DualDecoderConfig(selector="lowbit", lowbit_factor=2)
    first_real = torch.tensor([0, 37])
    grown, whole = (SELECTORS["lowbit"](config, _store(2), "cpu") for _ in range(2))
    for length in (50, 64, 130, 131, 260, 333, 400):
        grown.extend(length, first_real)
    whole.extend(400, first_real)
    assert grown.n_groups == whole.n_groups == [6, 5]
    for row in range(2):
        g = whole.n_groups[row]
        assert torch.equal(grown.packed[row, :, :g], whole.packed[row, :, :g])
        assert torch.equal(grown.params[row, :, :g], whole.params[row, :, :g])
    grown.truncate(200)  # a crop forgets the groups past it
    assert grown.n_groups == [3, 2]


def test_lowbit_selector_with_a_shortlist_of_everything_selects_what_exact_selects():
    store = _store(4)
    query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 380, dtype=torch.bool)
    mask[1, :37] = False
    candidates = Candidates(mask, torch.tensor([0, 37]))
    exact = SELECTORS["exact"](DualDecoderConfig(), store, "cpu").select(query, candidates, 0.25, 24)
    lowbit = SELECTORS["lowbit"](DualDecoderConfig(selector="lowbit", lowbit_factor=100), store, "cpu")
    lowbit.extend(candidates.end, candidates.first_real)  # the index, built apart from the query
    got = lowbit.select(query, candidates, 0.25, 24)
    assert lowbit.n_groups == [5, 5]  # the index was built and scanned
    assert torch.equal(got[0], exact[0]) and torch.equal(got[1], exact[1])


@pytest.fixture
def fresh_engine(monkeypatch, tmp_path):
    """The engine as on a machine that has not built or loaded it yet (builds go to a temporary folder)."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_resolved", {})
    monkeypatch.setattr(native, "_failure", None)
    monkeypatch.setattr(native, "_warned", False)
    monkeypatch.setenv("DUAL_CACHE_ENGINE_DIR", str(tmp_path))


def test_a_compiler_that_fails_falls_back_to_the_reference_with_one_warning(fresh_engine, monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    query, mask, keys, index = _problem(6, 2, 2, 2, 32, 400, torch.float32)
    with pytest.warns(RuntimeWarning, match="native selection engine is unavailable"):
        got = engine.select(query, mask, keys, 16, 0.2, index, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        engine.select(query, mask, keys, 16, 0.2, index, 32)
    assert native.active_variant() == "reference"
    view = (index.packed, index.params, index.group_first, index.usable(mask.shape[1]))
    expected = reference.select(query, mask, keys, 16, 0.2, view, 32)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU runs only the scalar variant")
def test_a_variant_that_fails_to_build_gives_the_next_best_with_one_warning(fresh_engine, monkeypatch):
    best, next_best = VARIANTS[-1], VARIANTS[-2]
    build = native._build

    def failing_build(variant):
        if variant == best:
            raise RuntimeError(f"g++ failed building the {variant} engine")
        return build(variant)

    monkeypatch.setattr(native, "_build", failing_build)
    query, mask, keys, index = _problem(8, 2, 2, 2, 32, 400, torch.float32)
    with pytest.warns(RuntimeWarning, match=f"runs the {next_best} variant"):
        got = engine.select(query, mask, keys, 16, 0.2, index, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        engine.select(query, mask, keys, 16, 0.2, index, 32)
    assert native.active_variant() == next_best
    view = (index.packed, index.params, index.group_first, index.usable(mask.shape[1]))
    expected = reference.select(query, mask, keys, 16, 0.2, view, 32)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bad_options_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="lowbit_factor"):
        DualDecoderConfig(selector="lowbit", lowbit_factor=0)
    for channels in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="lowbit_channels"):
            DualDecoderConfig(selector="lowbit", lowbit_channels=channels)
    monkeypatch.setenv("DUAL_CACHE_ENGINE", "fastest")
    with pytest.raises(ValueError, match="DUAL_CACHE_ENGINE must be one of"):
        native.library()
    query, mask, keys, _ = _problem(7, 1, 2, 2, 32, 200, torch.float32)
    with pytest.raises(ValueError, match="float32 queries"):
        engine.select(query.double(), mask, keys, 8, 0.2)
    with pytest.raises(ValueError, match="fewer than end"):
        engine.select(query, torch.ones(1, 999, dtype=torch.bool), keys, 8, 0.2)
    for quads in (0, 9, 2.5):  # 32 channels: 8 quads
        with pytest.raises(ValueError, match="quads"):
            engine.select(query, mask, keys, 8, 0.2, quads=quads)


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_generate_with_lowbit_full_budget_equals_dense_and_threads_do_not_change_tokens(threads):
    model = tiny_llama(seed=31)
    ids = torch.randint(3, 96, (2, 300), generator=torch.Generator().manual_seed(32))
    mask = torch.ones_like(ids)
    mask[1, :45] = 0
    dense = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    full = {"selector": "lowbit", "budget": 4096, "window": 16, "retrieval_threads": threads}
    assert torch.equal(dense, model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                             cache_implementation="dual", cache_config=full))
    partial = {"selector": "lowbit", "budget": 16, "window": 8, "early_layers": 0, "lowbit_factor": 2,
               "retrieval_threads": threads}
    tokens = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                            cache_implementation="dual", cache_config=partial)
    reference_run = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                   cache_implementation="dual", cache_config={**partial, "retrieval_threads": 0})
    assert torch.equal(tokens, reference_run)


@pytest.mark.parametrize("variant", list(native.VARIANTS))
@pytest.mark.parametrize("dtype, dim", [(torch.float32, 64), (torch.bfloat16, 128), (torch.float16, 18)])
def test_native_quantize_writes_the_bytes_of_the_reference(variant, dtype, dim, monkeypatch):
    _runnable(variant)
    monkeypatch.setenv("DUAL_CACHE_ENGINE", variant)
    gen = torch.Generator().manual_seed(dim)
    keys = (torch.randn(7, codes.GROUP, dim, generator=gen) * 4).to(dtype)
    keys[2, :, 3] = 1.5  # a constant channel: step 0
    expected, got = codes.quantize(keys), codes.quantize_fast(keys, threads=3)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_the_scan_reads_only_the_chosen_channel_quads():
    query, mask, keys, index = _problem(9, 1, 1, 4, 64, 3000, torch.bfloat16)  # one KV head of 16 quads
    groups = int(index.usable(mask.shape[1])[0])
    chosen = reference.choose_quads(query[0], index.params[0, 0, :groups, 1].float(), 5)
    before = engine.select(query, mask, keys, 16, 0.125, index, 64, 5)
    scrambled = index.packed.clone().view(1, 1, -1, 16, 64)  # (b, H, groups, quad, 64 bytes)
    others = torch.tensor([j for j in range(16) if j not in chosen.tolist()])
    noise = torch.randint(0, 256, scrambled[:, :, :, others].shape, generator=torch.Generator().manual_seed(9))
    scrambled[:, :, :, others] = noise.to(torch.uint8)
    after = engine.select(query, mask, keys, 16, 0.125,
                          engine.IndexView(scrambled.view_as(index.packed), index.params, index.group_first,
                                           index.n_groups), 64, 5)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    full_before = engine.select(query, mask, keys, 16, 0.125, index, 64)  # every quad read: the codes count
    full_after = engine.select(query, mask, keys, 16, 0.125,
                               engine.IndexView(scrambled.view_as(index.packed), index.params, index.group_first,
                                                index.n_groups), 64)
    assert not torch.equal(full_before[0], full_after[0])


@pytest.mark.parametrize("variant", list(native.VARIANTS))
@pytest.mark.parametrize("shared", [False, True])
def test_the_gather_in_the_select_call_copies_the_rows_of_the_selection(variant, shared):
    """K/V written by the engine's gather equal the reference gather (`HostKVStore.gather`'s rows) of the indices
    it returns, invalid slots (position 0) included, for chunked and shared-prefix key/value chunks."""
    _runnable(variant)
    query, mask, keys, index = _problem(21, 3, 2, 2, 40, 700, torch.bfloat16, shared=shared)
    gen = torch.Generator().manual_seed(22)
    values = [torch.randn(chunk.shape, generator=gen).to(chunk.dtype) for chunk in keys]
    library = native.library(variant)
    for budget, with_index in [(16, False), (16, True), (900, False)]:  # 900: more slots than candidates
        view = (index.packed, index.params, index.group_first, index.usable(mask.shape[1])) if with_index else None
        # the first `budget` of budget + 5 slots per (sequence, KV head), as the layer's staging buffer holds them
        wide = tuple(torch.full((3, 2, budget + 5, 40), float("nan"), dtype=torch.bfloat16) for _ in range(2))
        out = tuple(w[:, :, :budget] for w in wide)
        indices, valid = engine._native_select(library, query, mask, engine.chunks(keys, values), budget, 0.2,
                                               index if with_index else None, 64, 2, None, out)
        expected = tuple(torch.empty_like(o) for o in out)
        reference.gather(keys, indices, expected[0])
        reference.gather(values, indices, expected[1])
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
        assert all(w[:, :, budget:].isnan().all() for w in wide)  # the slots after them untouched
        assert torch.equal((indices, valid)[0], reference.select(query, mask, keys, budget, 0.2, view, 64)[0])


@pytest.mark.parametrize("name", ["exact", "lowbit"])
def test_select_into_fills_the_staging_buffer_as_select_then_gather(name):
    store = HostKVStore(3, 2, 16, torch.bfloat16, chunk_tokens=128)
    gen = torch.Generator().manual_seed(7)
    for lo in range(0, 700, 97):  # across chunk boundaries; values differ from keys
        size = min(97, 700 - lo)
        store.append(torch.randn(3, 2, size, 16, generator=gen).bfloat16(),
                     torch.randn(3, 2, size, 16, generator=gen).bfloat16())
    config = DualDecoderConfig(selector=name, lowbit_factor=2)
    selector = SELECTORS[name](config, store, "cpu")
    query = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 650, dtype=torch.bool)
    candidates = Candidates(mask, torch.zeros(2, dtype=torch.long), sequences=(2, 0))  # sequences 2 and 0
    out = tuple(torch.empty(2, 2, 24, 16, dtype=torch.bfloat16) for _ in range(2))
    indices, valid = selector.select_into(query, candidates, 0.25, 24, out)
    expected_indices, expected_valid = selector.select(query, candidates, 0.25, 24)
    keys, values = store.gather(expected_indices, rows=[2, 0])
    assert torch.equal(indices, expected_indices) and torch.equal(valid, expected_valid)
    assert torch.equal(out[0], keys) and torch.equal(out[1], values)
    with pytest.raises(ValueError, match="out"):
        selector.select_into(query, candidates, 0.25, 24, (out[0], out[1][:, :, :8]))


def test_a_long_scan_uses_a_sparser_threshold_sample_and_selects_what_the_reference_selects():
    query, mask, keys, index = _problem(31, 1, 1, 4, 16, 70000, torch.bfloat16, chunks=2)  # > 32K positions
    view = (index.packed, index.params, index.group_first, index.usable(mask.shape[1]))
    for variant in VARIANTS:
        got = engine._native_select(native.library(variant), query, mask, keys, 64, 0.25, index, 512, 1, 2)
        expected = reference.select(query, mask, keys, 64, 0.25, view, 512, 2)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
