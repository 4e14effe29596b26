"""The throughput / memory benchmark harness (eval/throughput/bench*.py): runs end to end on a tiny random model, produces every
column, and its memory accounting matches hand computations. Timings are printed by the harness, never asserted.
The max-batch search itself is tested with fake probes in test_bench_capacity.py."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dual_cache.eval.throughput import bench, bench_report, cpu_linear
from dual_cache.eval.throughput.bench_accounting import cache_accounting
from dual_cache.eval.throughput.bench_capacity import MemoryLimits
from dual_cache.eval.throughput.bench_cell import COLUMNS
from dual_cache.eval.throughput.bench_grid import BenchGrid
from dual_cache.eval.throughput.bench_models import kv_bytes_estimate, llama31_8b_config, random_model, weight_bytes
from tests.conftest import tiny_llama

# tiny_llama: 3 layers, 4 query / 2 KV heads, hidden 64 → head_dim 16, float32
LAYERS, KV_HEADS, HEAD_DIM, ITEM = 3, 2, 16, 4
# longer than every selection slot (the first layer's: 2 × 32 fetched + 32 next positions), so no slot is capped
CONTEXTS = (104, 136)


def quiet(_line: str) -> None:
    pass


def small_grid(**changes) -> BenchGrid:
    values = dict(
        methods=("all", "dual-no-repair", "dual-forced-miss"), batches=(1, 2), contexts=CONTEXTS, budgets=(16,),
        new_tokens=5, warmup_steps=1, n_sink=4, window=16, dual_options={"early_layers": 1, "early_layer_budget": 32},
        forced_miss_rate=0.5,
    )
    values.update(changes)
    return BenchGrid(**values)


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread avoids spin-waiting on a shared machine
    yield tiny_llama()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def result(model):
    # host pool of 10 MiB shared with the device (CPU)
    limits = MemoryLimits(device_bytes=2 ** 30, host_bytes=10 * 2 ** 20, shared=True)
    return bench.run_bench(model, None, small_grid(), limits=limits, model_name="tiny", max_batch_cap=4, log=quiet)


def test_end_to_end_every_column(result, tmp_path):
    methods = {"dense", "dual-self", "dual-ngram", "dual-none", "dual-lowbit", "quest", "dual-no-repair",
               "dual-forced-miss"}
    assert {row["method"] for row in result.cells} == methods
    assert len(result.cells) >= len(methods) * 2 * 2  # × batches × contexts (one budget), then max-batch runs
    assert "offloaded" in result.meta["skipped"]  # CUDA only
    finite = ("prefill_s", "decode_tokens_per_s", "ms_per_step", "device_bytes_per_request",
              "host_bytes_per_request", "dense_equivalent_bytes_per_request", "bytes_copied_per_step")
    for row in result.cells:
        assert set(COLUMNS) <= set(row), set(COLUMNS) - set(row)
        assert row["error"] is None
        for column in finite:
            assert math.isfinite(row[column]), (row["method"], column)
        assert row["decode_steps"] == 4  # new_tokens - 1 forwards after the prefill
        assert math.isnan(row["cuda_peak_bytes_per_request"])  # CPU
        if row["method"] in ("dual-self", "dual-ngram", "dual-lowbit", "dual-no-repair", "dual-forced-miss"):
            assert 0 <= row["spec_row_hit_rate_min"] <= row["spec_hit_rate"] <= 1
        if row["method"] in ("dense", "dual-none"):
            assert math.isnan(row["spec_hit_rate"])
    assert {(r["method"], r["context"]) for r in result.max_batch} == {(m, c) for m in methods for c in CONTEXTS}
    for found in result.max_batch:
        assert found["limited_by"] in ("host memory", "batch cap") and found["how"] == "measured"
        # the cap: the tiny model's bytes are far below the limits (host stores are sized to the request; the
        # host-limited search is covered by tests/test_bench_capacity.py)
        assert found["max_batch"] == 4 and found["limited_by"] == "batch cap", found
    markdown = bench_report.render_markdown(result)
    assert "×dense tok/s" in markdown and "×offl tok/s" in markdown and "Max batch within" in markdown
    assert "(50% missed)" in markdown and "×best baseline" in markdown
    assert "Skipped offloaded" in markdown
    paths = bench.write_result(result, str(tmp_path), log=quiet)
    for kind in ("cells", "summary", "table", "throughput_plot", "memory_plot"):
        assert os.path.getsize(paths[kind]) > 0, kind
    with open(paths["cells"], encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle]
    assert len(rows) == len(result.cells) and set(COLUMNS) <= set(rows[0])
    with open(paths["summary"], encoding="utf-8") as handle:
        summary = json.load(handle)
    assert summary["meta"]["weight_bytes"] == weight_bytes(tiny_llama())
    assert len(summary["max_batch"]) == len(result.max_batch)


def test_dense_memory_matches_hand_computation(result):
    for row in result.cells:
        if row["method"] != "dense":
            continue
        tokens = row["context"] + row["new_tokens"] - 1  # the last generated token is never fed back
        expected = 2 * LAYERS * KV_HEADS * tokens * HEAD_DIM * ITEM
        assert row["device_bytes_per_request"] == expected
        assert row["dense_equivalent_bytes_per_request"] == expected
        assert row["host_bytes_per_request"] == 0 and row["bytes_copied_per_step"] == 0


@pytest.mark.parametrize("method", ["dual-self", "dual-ngram", "dual-none", "quest", "dual-no-repair",
                                    "dual-forced-miss"])
def test_dual_memory_and_copies_per_request(result, method):
    # grid: n_sink 4, window 16, budget 16, early_layers 1 with early_layer_budget 32, layers_in_flight 2 (default)
    window = 16
    layer_budgets = [32, 16, 16]
    # entries per (layer, KV head) a step wants resident: the library defaults fetch the budget plus budget next
    # positions; dual-no-repair and the forced-miss repairs fetch the budget alone, and Quest selects the budget at the
    # step; only those not resident yet are copied (a delta row: key + value, int64 slot, int64 position)
    wants = layer_budgets if method in ("quest", "dual-no-repair", "dual-forced-miss") else [2 * b for b in layer_budgets]
    entry = 2 * HEAD_DIM * ITEM + 8 + 8
    rows = [r for r in result.cells if r["method"] == method and r["batch"] <= 2]
    assert rows
    device = {(r["context"], r["batch"]): r["device_bytes_per_request"] for r in rows}
    if method == "quest":  # its page metadata (min and max key per page) lives on the device and grows
        assert device[(CONTEXTS[1], 1)] > device[(CONTEXTS[0], 1)]
    else:  # the method's claim: what the device holds per request does not grow with the context, once the context
        # fills its resident sets (3 x the layer's budget per KV head); a shorter request holds only the positions it
        # can select (about its tokens minus window and sink): here the first layer's 96 entries at the shorter context
        for context in CONTEXTS:
            assert device[(context, 1)] == device[(context, 2)], device
        grown = device[(CONTEXTS[1], 1)] - device[(CONTEXTS[0], 1)]
        per_entry = KV_HEADS * (2 * HEAD_DIM * ITEM + 8)
        short_of = 3 * layer_budgets[0] - (CONTEXTS[0] - window - 4)  # entries the shorter context cannot select
        assert 0 < grown <= short_of * per_entry and grown % per_entry == 0, device
    for row in rows:
        tokens = row["context"] + row["new_tokens"] - 1
        assert row["dense_equivalent_bytes_per_request"] == 2 * LAYERS * KV_HEADS * tokens * HEAD_DIM * ITEM
        assert row["host_bytes_per_request"] >= row["dense_equivalent_bytes_per_request"]
        # host→device, whole batch: each step's delta; at most what every step wants (the dual pipeline also
        # plans the first layer's step after the last one: lookahead 1, issued while the last layer runs, never
        # used; Quest selects at the step that uses it), at least the first step's budget per layer, whose
        # resident sets start empty
        steps = row["decode_steps"]
        most = row["batch"] * KV_HEADS * (steps * sum(wants) + (0 if method == "quest" else wants[0]))
        # miss repair (dual-forced-miss) adds the real query's selection of a missed step (the first step always) in
        # every layer where the candidates outnumber the budget, for the rows that missed
        repaired_steps = round(row["repaired_fraction"] * steps)
        repairing = [b for b in layer_budgets if row["context"] - window > b]
        if method == "dual-forced-miss":
            assert repaired_steps >= 1
        else:
            assert repaired_steps == 0
        most += repaired_steps * row["batch"] * KV_HEADS * sum(repairing)
        copied = round(row["bytes_copied_per_step"] * steps)
        assert copied % entry == 0
        assert row["batch"] * KV_HEADS * sum(layer_budgets) <= copied // entry <= most
        assert row["bytes_copied_per_sequence_step"] == pytest.approx(row["bytes_copied_per_step"] / row["batch"])
        assert 0 <= row["resident_share"] <= 1 and row["host_core_ms_per_sequence_step"] > 0


def test_offloaded_accounting_on_a_dynamic_cache(model):
    batch, prompt, new = 2, 24, 3
    ids = torch.randint(1, 96, (batch, prompt), generator=torch.Generator().manual_seed(0))
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    layer = 2 * batch * KV_HEADS * (prompt + new - 1) * HEAD_DIM * ITEM
    acct = cache_accounting("offloaded", cache)
    assert acct["device_bytes"] == 2 * layer  # the layer in use + the one being prefetched
    assert acct["host_bytes"] == LAYERS * layer == acct["dense_equivalent_bytes"]
    assert acct["bytes_copied_per_step_estimate"] == LAYERS * layer
    assert cache_accounting("dense", cache)["device_bytes"] == LAYERS * layer


def test_llama8b_shape_without_weights():
    config = llama31_8b_config()
    with torch.device("meta"):
        meta_model = random_model(config, torch.bfloat16, torch.device("meta"))
    assert 8.0e9 < sum(p.numel() for p in meta_model.parameters()) < 8.1e9
    # the yardstick: dense KV of one 32K request in bf16 is 4 GiB
    assert kv_bytes_estimate(config, 1, 32768, torch.bfloat16) == 4 * 1024 ** 3


@pytest.mark.parametrize("argv, message", [
    (["--batches", "0"], "--batches"),
    (["--methods", "dense", "fast"], "unknown method"),
    (["--budgets", "-1"], "--budgets"),
    (["--new-tokens", "3", "--warmup-steps", "2"], "--new-tokens"),
    (["--dual-options", '{"speculator": "self"}'], "--dual-options"),
    (["--dual-options", '{"layers_in_flight": 0}'], "layers_in_flight"),
    (["--device", "cuda"], "cuda"),
    (["--model", "llama8b", "--device", "cpu"], "llama8b"),
    (["--contexts", "64"], "128 tokens"),
    (["--device-budget-gib", "0"], "--device-budget-gib"),
    (["--host-budget-gib", "-2"], "--host-budget-gib"),
    (["--max-cell-seconds", "0"], "--max-cell-seconds"),
    (["--methods", "dense", "dual-forced-miss"], "--forced-miss-rate"),
    (["--methods", "dual-forced-miss", "--forced-miss-rate", "1.5"], "--forced-miss-rate"),
    (["--methods", "dual-forced-miss", "--forced-miss-rate", "0.2", "--dual-options", '{"miss_repair": false}'],
     "miss_repair"),
    (["--no-max-batch"], "--no-max-batch"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "0.9"], "--top-p"),
    (["--temperature", "0.8", "--top-p", "0"], "--top-p"),
    (["--sample", "--temperature", "0.7"], "--sample"),
    (["--model", "tiny", "--prompts", "natural"], "tokenizer"),
])
def test_bad_grids_fail_before_any_model_loads(argv, message, monkeypatch, capsys):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is available here")

    def no_load(*args, **kwargs):
        raise AssertionError("the model must not load for a bad grid")

    monkeypatch.setattr(bench, "load_bench_model", no_load)
    assert bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_bench_subcommand_runs_on_the_tiny_model(tmp_path, capsys):
    from dual_cache.cli.main import main

    out = tmp_path / "run"
    rc = main(["bench", "--model", "tiny", "--device", "cpu", "--methods", "dense", "dual-none", "--contexts", "40",
               "--batches", "1", "--budgets", "16", "--new-tokens", "5", "--warmup-steps", "1", "--no-plots",
               "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| dual-none k=16 | 40 | 1 |" in printed
    assert (out / "cells.jsonl").exists() and (out / "table.md").exists()


def test_summary_only_with_a_host_limit_and_no_search_writes_one_file(tmp_path, capsys, monkeypatch):
    """The device script's latency stage: the grid alone, each cell within the host limit given (not 85% of what
    happens to be available), one file written."""
    limits = []
    run_cell = bench.run_cell

    def spy(*args, **kwargs):
        limits.append(kwargs["host_limit_bytes"])
        return run_cell(*args, **kwargs)

    monkeypatch.setattr(bench, "run_cell", spy)
    out = tmp_path / "run"
    assert bench.main(["--model", "tiny", "--device", "cpu", "--methods", "dual-none", "--contexts", "40",
                       "--batches", "1", "2", "--budgets", "16", "--new-tokens", "4", "--warmup-steps", "1",
                       "--repeats", "1", "--host-budget-gib", "3", "--no-max-batch", "--summary-only",
                       "--out", str(out)]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["summary.json"]
    summary = json.loads((out / "summary.json").read_text())
    assert [cell["batch"] for cell in summary["cells"]] == [1, 2] and summary["max_batch"] == []
    assert limits and set(limits) == {3 * 2**30}
    assert "| dual-none k=16 | 40 | 2 |" in capsys.readouterr().out  # the table goes to the log
    assert bench_report.main([str(out / "summary.json")]) == 0  # and can be printed again from the summary
    assert "| dual-none k=16 | 40 | 2 |" in capsys.readouterr().out


@pytest.mark.parametrize("shape", [(1, 24), (2, 24), (1, 3, 24), (2, 4, 24), (9, 24)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_linear_matches_f_linear(shape, bias):
    generator = torch.Generator().manual_seed(sum(shape) + bias)
    x = torch.randn(*shape, generator=generator)
    weight = torch.randn(40, 24, generator=generator)
    b = torch.randn(40, generator=generator) if bias else None
    expected = torch.nn.functional.linear(x, weight, b)
    got = cpu_linear.gemm_linear(x, weight, b)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_gemm_linears_switch_every_linear_and_restore_on_error(model):
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        stock = model(ids).logits
        with pytest.raises(RuntimeError, match="boom"), cpu_linear.gemm_linears(model) as switched:
            assert switched == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
            patched = model(ids[:, :1]).logits
            raise RuntimeError("boom")
        assert all("forward" not in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
        torch.testing.assert_close(patched, model(ids[:, :1]).logits, rtol=1e-4, atol=1e-5)
        assert torch.equal(model(ids).logits, stock)

    # a forward already set on an instance (e.g. by a hook library) comes back; nesting is a no-op
    linear = torch.nn.Linear(4, 3)
    own = lambda x: torch.zeros(x.shape[:-1] + (3,))  # noqa: E731
    linear.forward = own
    with cpu_linear.gemm_linears(linear) as outer:
        with cpu_linear.gemm_linears(linear) as inner:
            assert (outer, inner) == (1, 0)
        assert linear.forward is not own
    assert linear.forward is own


def test_bench_with_gemm_linears_runs_and_says_so(model):
    grid = small_grid(methods=("dense", "dual-self"), batches=(1,), contexts=(40,), cpu_linear="gemm")
    result = bench.run_bench(model, None, grid, model_name="tiny", log=quiet)
    assert all(row["error"] is None for row in result.cells) and not result.max_batch
    assert "--cpu-linear gemm" in bench_report.render_markdown(result)
    with pytest.raises(ValueError, match="cpu-linear"):
        small_grid(cpu_linear="fast").validate()
    with pytest.raises(ValueError, match="up to 64 rows"):
        small_grid(cpu_linear="gemm", batches=(1, 33)).validate()


def test_keep_going_records_a_failed_cell_instead_of_raising(model, monkeypatch):
    from dual_cache.eval.throughput.bench_cell import run_cell
    from dual_cache.eval.throughput.bench_models import PromptSource

    grid = small_grid(methods=("dense",), batches=(1,), contexts=(40,))
    prompts = PromptSource(None, 96, model.device)

    def broken(*args, **kwargs):
        raise TypeError("this cache cannot prefill in chunks")

    monkeypatch.setattr(model, "generate", broken)
    row = run_cell(model, prompts, "dense", 40, 1, None, grid, keep_going=True)
    assert row["error"] == "failed: TypeError: this cache cannot prefill in chunks"
    with pytest.raises(TypeError):
        run_cell(model, prompts, "dense", 40, 1, None, grid)


def test_a_device_clock_gives_each_cell_its_idle_shares(model):
    """With a device clock (CUDA; here `SimulatedStreams`'), a dual cell reports the share of the step the device
    waited for copies and the share it had no work while the host selected; overlap is what is left. Without one
    (a CPU device), NaN."""
    from dual_cache.eval.throughput.bench_cell import run_cell
    from dual_cache.eval.throughput.bench_models import PromptSource
    from dual_cache.runtime.streams import simulated_streams

    prompts = PromptSource(None, model.config.vocab_size, torch.device("cpu"))
    grid = small_grid(dual_options={"retrieval_threads": 1})
    with simulated_streams(max_delay_s=0.001):
        row = run_cell(model, prompts, "dual-no-repair", 72, 1, 16, grid)
    copy, host = row["idle_copy_fraction"], row["idle_host_fraction"]
    assert 0 <= copy <= 1 and 0 <= host <= 1
    assert row["overlap_ratio"] == pytest.approx(max(0.0, 1 - copy - host))
    assert f"({copy:.2f} / {host:.2f})" in bench_report.cell_table([row])
    plain = run_cell(model, prompts, "dual-no-repair", 72, 1, 16, grid)
    assert math.isnan(plain["idle_copy_fraction"]) and math.isnan(plain["idle_host_fraction"])


def test_sync_points_blocked_time_and_sampling_per_cell(model):
    """Every cell reports the launch thread's synchronization points and blocked milliseconds per steady-state step
    and its decoding; the default dual cell at batch 4 under sampling stays at the CI bound (issue 57: ≤ 2 per
    step), the synchronous repair of the default before it (`dual-sync-repair`) shows its per-layer waits."""
    from dual_cache.eval.throughput.bench_cell import run_cell
    from dual_cache.eval.throughput.bench_models import PromptSource

    prompts = PromptSource(None, model.config.vocab_size, torch.device("cpu"))
    grid = small_grid(temperature=1.0, top_p=0.9, new_tokens=8, warmup_steps=2,
                      dual_options={"early_layers": 0, "retrieval_threads": 1, "repair_drift": None})
    rows = {m: run_cell(model, prompts, m, 72, 4, 16, grid) for m in ("dual-self", "dual-sync-repair")}
    rows["dense"] = run_cell(model, prompts, "dense", 72, 4, None, grid)
    for method, row in rows.items():
        assert row["temperature"] == 1.0 and row["top_p"] == 0.9 and row["prompts"] == "needle"
        assert math.isfinite(row["sync_points_per_step"]) and row["blocked_ms_per_step"] >= 0, method
        assert sum(row["sync_points_by_op"].values()) == pytest.approx(row["sync_points_per_step"])
    assert rows["dual-self"]["sync_points_per_step"] <= 2
    assert rows["dense"]["blocked_ms_per_step"] == 0
    # random weights miss nearly every step: the synchronous repair waits in every layer of the missed rows
    assert rows["dual-sync-repair"]["sync_points_per_step"] > rows["dual-self"]["sync_points_per_step"]
    table = bench_report.cell_table(list(rows.values()))
    assert "sync/step" in table and "blocked ms/step" in table
    uncounted = run_cell(model, prompts, "dual-self", 72, 1, 16, small_grid(count_sync_points=False))
    assert math.isnan(uncounted["sync_points_per_step"]) and math.isfinite(uncounted["blocked_ms_per_step"])


def test_progress_names_each_cell_k_of_n_and_moves_inside_a_cell(model, monkeypatch):
    """With `progress`, one bar counts the grid's cells and names the running one ("cell k of N: method@budget
    context × batch"), and each cell draws its prefill (by layer) and decode (by token) bars; the JSON lines still
    come (through `tqdm.write`)."""
    from dual_cache.runtime import progress

    bars, written = [], []

    class Recorder:
        def __init__(self, total=None, desc="", **kwargs):
            self.total, self.desc, self.n, self.descriptions = total, desc, 0, []
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_description(self, text):
            self.descriptions.append(text)

        def close(self):
            pass

        @staticmethod
        def write(line):
            written.append(line)

    monkeypatch.setattr(bench, "tqdm", Recorder)
    monkeypatch.setattr(progress, "tqdm", Recorder)
    grid = small_grid(methods=("dense", "dual-self"), batches=(1,), contexts=(40,))
    bench.run_bench(model, None, grid, model_name="tiny", progress=True)
    cells = bars[0]
    assert cells.total == cells.n == 2
    assert cells.descriptions == ["cell 1 of 2: dense 40 tokens × 1", "cell 2 of 2: dual-self@16 40 tokens × 1"]
    prefill = [b for b in bars if b.desc == "prefill"]
    decode = [b for b in bars if b.desc == "decode"]
    assert prefill and all(b.n == b.total == LAYERS for b in prefill)  # one chunk: its layers
    assert decode and all(b.n == b.total for b in decode)
    assert sum(line.startswith("{") for line in written) == 2
