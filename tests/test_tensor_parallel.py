"""Tensor parallelism (issue 42): each rank's dual cache holds its own KV heads; generate() on 2 ranks (gloo, CPU)
equals the single-process runs; the tensor-parallel server (rank 0 decides, every rank runs the same forwards)
answers as the single-process server does, survives cancellations, stops cleanly and never waits for a dead rank.

The multi-rank cases launch `torchrun` from the test with OMP_NUM_THREADS=1 (two ranks share this machine's cores).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import dual_cache
from conftest import tiny_llama
from dual_cache import DualDecoderCache
from dual_cache.cli.serve import serve_arguments
from dual_cache.config import DualDecoderConfig, usable_cores
from dual_cache.host.memory import HostMemory
from dual_cache.model.tensor_parallel import TensorShard, load_kwargs, shard_of
from dual_cache.serving import GenerationOptions, Scheduler
from dual_cache.serving.distributed import TPGroup, digest
from dual_cache.serving.launch import rank_environment, torchrun_command
from dual_cache.serving.tp_scheduler import TPScheduler

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
FULL = {"budget": 4096, "window": 16, "retrieval_threads": 0}
PARTIAL_EXACT = {"budget": 32, "n_sink": 4, "window": 16, "early_layers": 0, "selector": "exact"}
PARTIAL_LOWBIT = {"budget": 32, "n_sink": 4, "window": 16, "early_layers": 0}


def _as_tp(model, size: int, plan: dict | None = None):
    """`model` as transformers marks a tensor-parallel one (its plan, its size), without splitting it."""
    model._tp_size = size
    if plan is not None:
        model._tp_plan = plan
    return model


# --- one process: what a rank's cache holds ---------------------------------------------------------------------
def test_shard_of_reads_the_plan_and_refuses_heads_it_cannot_split():
    model = tiny_llama()  # 4 query / 2 KV heads, Llama's plan splits q/k/v column-wise
    assert shard_of(model) == TensorShard(kv_heads=2, model_kv_heads=2)
    shard = shard_of(_as_tp(tiny_llama(), 2))
    assert (shard.size, shard.kv_heads, shard.model_kv_heads, shard.rank) == (2, 1, 2, 0)
    assert "rank 0 of 2 (1 of 2 KV heads)" == shard.describe()
    with pytest.raises(ValueError, match="2 KV heads, which 4 tensor-parallel ranks cannot split evenly"):
        shard_of(_as_tp(tiny_llama(), 4))
    with pytest.raises(ValueError, match="4 query heads, which 3 tensor-parallel ranks"):
        shard_of(_as_tp(tiny_llama(), 3))
    unit = {"model.layers.*.self_attn.q_proj": "unit_colwise", "model.layers.*.self_attn.k_proj": "unit_colwise"}
    fake = SimpleNamespace(config=tiny_llama().config, _tp_size=4, tp_plan=unit)
    assert shard_of(fake).kv_heads == 1  # 2 heads over 4 ranks: whole heads, each replicated twice
    whole = SimpleNamespace(config=tiny_llama().config, _tp_size=2, tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    assert shard_of(whole).kv_heads == 2  # attention left whole: every rank holds every head
    assert load_kwargs(1) == {}
    with pytest.raises(ValueError, match="tp_size"):
        load_kwargs(0)


def test_the_cache_sizes_itself_from_the_shard_it_is_given(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    model = _as_tp(tiny_llama(), 2)
    cache = DualDecoderCache(model.config, budget=16)
    whole = cache.host_bytes_needed(1, 1000, torch.float32, prompt_tokens=1000)
    cache.check_model(model.config)  # a config knows nothing of ranks: the whole model
    assert cache.kv_heads == 2
    cache.check_model(model)
    assert cache.kv_heads == 1 and cache.shard.ranks_per_host == 2
    assert cache.host_bytes_needed(1, 1000, torch.float32, prompt_tokens=1000) * 2 == whole
    stats = cache.stats()
    assert (stats["tp_rank"], stats["tp_size"], stats["kv_heads"]) == (0, 2, 1)
    # a rank's share of the host: the default allowance is divided among the ranks of one host
    monkeypatch.setattr("dual_cache.host.memory.available_host_bytes", lambda: 10_000_000)
    memory = HostMemory()
    memory.ranks_per_host = 2
    assert memory.limit == 4_500_000
    with pytest.raises(Exception, match="this rank's share: 2 ranks on this host"):
        memory.check(5_000_000, "a request")
    # retrieval threads: the host's cores divided among its ranks (CUDA; CPU keeps 0)
    config = DualDecoderConfig()
    cores = usable_cores()
    assert config.threads_for(torch.device("cuda"), 2) == max(1, cores // 2)
    assert config.threads_for(torch.device("cpu"), 2) == 0
    # K/V of another head count than the cache was sized for are refused, not stored
    wrong = DualDecoderCache(model.config, budget=16)
    wrong.check_model(model)
    wrong.begin_request(1, 16, torch.float32, torch.device("cpu"), None, 8)
    with pytest.raises(ValueError, match="gave 2 KV heads; this DualDecoderCache was sized for 1"):
        wrong.update(torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16), 0)
    wrong.close()
    cache.close()


def test_a_cache_holding_one_shard_refuses_another():
    model = tiny_llama()
    cache = DualDecoderCache(model.config, budget=16)
    model.generate(torch.ones(1, 8, dtype=torch.long), max_new_tokens=2, cache=cache, do_sample=False)
    with pytest.raises(ValueError, match="stores 2 KV heads per layer"):
        cache.check_model(_as_tp(tiny_llama(), 2))
    cache.close()


def test_cli_checks_and_the_launch_command(monkeypatch):
    from dual_cache.cli.main import main

    assert main(["serve", "--tp", "0"]) == 2
    assert main(["serve", "--tp-timeout", "0"]) == 2
    assert main(["serve", "--max-host-bytes", "-5"]) == 2  # before the model loads
    args = SimpleNamespace(host="127.0.0.1", port=8001, max_batch=4, prefix_block=0, tp=2, tp_timeout=60.0,
                           model="m", cache_config=DualDecoderConfig(budget=64, layer_budgets={1: 8}),
                           max_host_bytes=None, dense=False)
    argv = serve_arguments(args)
    command = torchrun_command(2, argv)
    assert command[:4] == [PYTHON, "-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=2" in command and command[-len(argv):] == argv
    parsed = DualDecoderConfig.from_json(argv[argv.index("--cache-config") + 1])
    assert parsed == args.cache_config
    assert rank_environment(2, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    assert int(rank_environment(2, {})["OMP_NUM_THREADS"]) >= 1
    with pytest.raises(ValueError):
        torchrun_command(1, argv)
    monkeypatch.setenv("WORLD_SIZE", "3")  # under torchrun, --tp must match its world
    assert main(["serve", "--tp", "2"]) == 2


def test_digest_is_stable_across_processes():
    assert digest([1, 2, 3]) == digest([1, 2, 3]) != digest([1, 2, 4])
    out = subprocess.run([PYTHON, "-c", "from dual_cache.serving.distributed import digest; print(digest([1, 2, 3]))"],
                         capture_output=True, text=True, check=True)
    assert int(out.stdout) == digest([1, 2, 3]) < 2**56


# --- one rank: the tensor-parallel scheduler in a group of one ----------------------------------------------------
@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = TPGroup(timeout_s=60)
    try:
        yield group
    finally:
        group.close()
        dist.destroy_process_group()


def test_tp_scheduler_of_one_rank_equals_the_scheduler(group_of_one):
    model = tiny_llama(seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (n,), generator=gen) for n in (40, 90, 25, 60)]
    new = [6, 12, 4, 9]
    plain = Scheduler(model, cache_config=PARTIAL_LOWBIT, max_batch=3)
    expected = [plain.add_request(p, GenerationOptions(max_tokens=n, temperature=0)) for p, n in zip(prompts, new)]
    assert all(h.wait(300) for h in expected)
    plain.stop()
    exits = []
    scheduler = TPScheduler(model, cache_config=PARTIAL_LOWBIT, max_batch=3, group=group_of_one,
                            on_exit=exits.append)
    try:
        handles = [scheduler.add_request(p, GenerationOptions(max_tokens=n, temperature=0))
                   for p, n in zip(prompts, new)]
        sampled = scheduler.add_request(prompts[0], GenerationOptions(max_tokens=3, temperature=0.7))
        long = scheduler.add_request(prompts[1], GenerationOptions(max_tokens=500, temperature=0))
        assert sampled.options.seed is not None  # drawn on rank 0, sent to every rank
        assert all(h.wait(300) for h in handles + [sampled])
        assert [h.token_ids for h in handles] == [h.token_ids for h in expected]
        while len(long.token_ids) < 3:
            time.sleep(0.01)
        scheduler.cancel(long)  # acts at the next turn boundary
        assert long.wait(60) and long.finish_reason == "cancelled" and len(long.token_ids) < 500
        assert scheduler.wait_idle(60)
        metrics = scheduler.metrics()
        assert metrics["finished"] == 6 and metrics["cancelled"] == 1 and metrics["turns"] > 0
    finally:
        scheduler.stop()
    assert exits == [None] and scheduler.failure is None
    assert not scheduler._loop.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        scheduler.add_request(prompts[0], GenerationOptions(max_tokens=2))


# --- two ranks: generate() --------------------------------------------------------------------------------------
def _torchrun(nproc: int, script: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                           *script], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=environment)


def _save_tiny(folder: Path, kv_heads: int, q_heads: int, seed: int = 0, layers: int = 3) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=16 * q_heads, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=16,
                         max_position_embeddings=4096, eos_token_id=None, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def _batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(B, max(lengths))` prompts and their mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 96, (n,), generator=gen)
        mask[i, width - n:] = 1
    return ids, mask


def _two_rank_generate(tmp_path: Path, lengths: list[int], new: int, ranks: int = 2, kv_heads: int = 2,
                       q_heads: int = 4, uneven: bool = True):
    model_dir = _save_tiny(tmp_path / "model", kv_heads=kv_heads, q_heads=q_heads)
    ids, mask = _batch(lengths, seed=1)
    cases = {"dense": None, "full": FULL, "exact": PARTIAL_EXACT, "lowbit": PARTIAL_LOWBIT}
    spec = {"model": model_dir, "input_ids": ids.tolist(), "attention_mask": mask.tolist(), "max_new_tokens": new,
            "cases": cases}
    if uneven:
        spec["uneven"] = _save_tiny(tmp_path / "uneven", kv_heads=3, q_heads=6)
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "out"
    out.mkdir()
    run = _torchrun(ranks, ["tests/tp_rank_generate.py", str(tmp_path / "spec.json"), str(out)], timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    single = {}
    for name, config in cases.items():
        cache = None if config is None else DualDecoderCache(model.config, **config)
        output = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                return_dict_in_generate=True, output_logits=True,
                                **({} if cache is None else {"cache": cache}))
        single[name] = {"tokens": output.sequences[:, ids.shape[1]:].tolist(),
                        "logits": torch.stack(output.logits, dim=1),
                        "stats": None if cache is None else cache.stats()}
        if cache is not None:
            cache.close()
    return results, single


def _check_ranks(results, single, ranks: int) -> dict:
    """Every rank's tokens equal the single-process run's; host and device KV bytes per rank are 1/ranks; returns
    the largest logit difference per case (reduction order: the ranks sum partial products across ranks)."""
    assert single["full"]["tokens"] == single["dense"]["tokens"]  # full budget is dense attention
    differences = {}
    for rank, result in enumerate(results):
        for name, reference in single.items():
            case = result["cases"][name]
            assert case["tokens"] == reference["tokens"], (rank, name)
            difference = (torch.tensor(case["logits"]) - reference["logits"]).abs().max().item()
            differences[name] = max(differences.get(name, 0.0), difference)
            if reference["stats"] is not None:
                stats = case["stats"]
                assert (stats["tp_rank"], stats["tp_size"]) == (rank, ranks)
                for key in ("host_bytes", "device_bytes", "dense_equivalent_bytes"):
                    assert stats[key] * ranks == reference["stats"][key], (rank, name, key)
    return differences


def test_two_ranks_generate_equals_one_process_and_halves_host_bytes(tmp_path):
    results, single = _two_rank_generate(tmp_path, lengths=[300, 180], new=10)
    differences = _check_ranks(results, single, ranks=2)
    print("largest logit difference per case:", differences)
    assert max(differences.values()) < 1e-4  # the same math summed in another order
    for result in results:  # 3 KV heads over 2 ranks: refused before the cache did any work
        assert "3 KV heads, which 2 tensor-parallel ranks cannot split evenly" in result["uneven"]["error"]
        assert result["uneven"]["requests"] == 0


@pytest.mark.slow
def test_two_ranks_generate_at_2k_context_batch_3(tmp_path):
    results, single = _two_rank_generate(tmp_path, lengths=[2048, 1500, 900], new=24, uneven=False)
    _check_ranks(results, single, ranks=2)


@pytest.mark.slow
def test_three_ranks_generate_one_kv_head_each(tmp_path):
    results, single = _two_rank_generate(tmp_path, lengths=[400, 250], new=10, ranks=3, kv_heads=3, q_heads=6,
                                         uneven=False)
    _check_ranks(results, single, ranks=3)


# --- two ranks: the server --------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    """A tiny random Llama (2 KV heads) with the embedded model's tokenizer, saved for `--model`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dual_cache.model.loading import DEFAULT_GGUF_FILE, default_model_folder

    folder = tmp_path_factory.mktemp("served")
    tokenizer = AutoTokenizer.from_pretrained(default_model_folder(), gguf_file=DEFAULT_GGUF_FILE)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class TPServer:
    """`dual-decoder serve --tp 2` in a subprocess, its log in a file."""

    def __init__(self, model: str, log: Path, cache_config: dict) -> None:
        self.port, self.log = _free_port(), log
        self.handle = open(log, "w")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.process = subprocess.Popen(
            [PYTHON, "-m", "dual_cache.cli", "serve", "--tp", "2", "--model", model, "--port", str(self.port),
             "--cache-config", json.dumps(cache_config), "--max-batch", "8", "--tp-timeout", "300"],
            stdout=self.handle, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.time() + 600
        while "Uvicorn running" not in self.text():
            assert self.process.poll() is None and time.time() < deadline, self.text()[-4000:]
            time.sleep(0.5)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def rank_pids(self) -> dict[int, int]:
        found = re.findall(r"\[rank (\d)\] INFO rank \d of 2 serving \(pid (\d+)", self.text())
        return {int(rank): int(pid) for rank, pid in found}

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            self.handle.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        for pid in self.rank_pids().values():
            _kill_quietly(pid)
        self.handle.close()


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _post(port: int, path: str, body: dict, timeout: float = 600):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return connection.getresponse(), connection


def _json(port: int, path: str, body: dict) -> tuple[int, dict]:
    response, connection = _post(port, path, body)
    try:
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _metrics(port: int) -> dict[str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    connection.request("GET", "/metrics")
    text = connection.getresponse().read().decode()
    connection.close()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


REQUESTS = [("/v1/completions", {"prompt": f"Request {i}: the list of things to buy is", "max_tokens": n})
            for i, n in enumerate([4, 20, 9, 31, 14])] + [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                              "max_tokens": 17}),
]


def _answers(port: int) -> list:
    """The REQUESTS sent at once (greedy), their answers in order."""
    answers: list = [None] * len(REQUESTS)

    def send(i: int) -> None:
        path, body = REQUESTS[i]
        answers[i] = _json(port, path, dict(body, temperature=0))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(REQUESTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    return [(status, body["choices"][0], body["usage"]) for status, body in answers]


def _single_process_answers(model_dir: str) -> list:
    import uvicorn

    from dual_cache.model.loading import load_model
    from dual_cache.serving.server import create_app

    model, tokenizer = load_model(model_dir)
    scheduler = Scheduler(model, tokenizer, cache_config=FULL, max_batch=8)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(scheduler, tokenizer, model_dir), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        return _answers(port)
    finally:
        server.should_exit = True
        thread.join(60)


@pytest.mark.slow
def test_tp_server_answers_as_one_process_cancels_and_stops_cleanly(served_model, tmp_path):
    expected = _single_process_answers(served_model)
    server = TPServer(served_model, tmp_path / "serve.log", FULL)
    try:
        pids = server.rank_pids()
        assert sorted(pids) == [0, 1]
        assert _answers(server.port) == expected
        # a streamed request whose client goes away mid-stream: cancelled on every rank at one turn boundary
        response, connection = _post(server.port, "/v1/completions", {"prompt": "Count slowly:", "max_tokens": 2000,
                                                                      "temperature": 0, "stream": True})
        for _ in range(6):
            response.readline()
        connection.close()
        deadline = time.time() + 300
        while _metrics(server.port)["dual_requests_cancelled_total"] < 1:
            assert time.time() < deadline
            time.sleep(0.2)
        # sampled with a seed: every rank samples the same tokens (a different token would stop the group)
        status, sampled = _json(server.port, "/v1/completions", {"prompt": "Once", "max_tokens": 12,
                                                                 "temperature": 0.9, "seed": 5})
        assert status == 200 and sampled["usage"]["completion_tokens"] == 12
        assert _answers(server.port) == expected  # still the same answers after the cancellation
        metrics = _metrics(server.port)
        assert metrics["dual_requests_total"] == 2 * len(REQUESTS) + 2
        os.kill(server.process.pid, signal.SIGTERM)
        assert server.wait(120) == 0, server.text()[-4000:]
    finally:
        server.kill()
    log = server.text()
    assert "differ" not in log and "lost a rank" not in log
    # every rank took the same requests and emitted the same tokens, then stopped
    stopped = re.findall(r"\[rank (\d)\] INFO rank \d stopped: (.*)", log)
    assert sorted(rank for rank, _ in stopped) == ["0", "1"], log[-4000:]
    assert len({summary for _, summary in stopped}) == 1, stopped
    assert f"{2 * len(REQUESTS) + 2} requests" in stopped[0][1] and "(1 cancelled)" in stopped[0][1]
    assert not any(_alive(pid) for pid in pids.values())


@pytest.mark.slow
def test_tp_server_stops_when_a_rank_dies(served_model, tmp_path):
    server = TPServer(served_model, tmp_path / "serve.log", FULL)
    try:
        pids = server.rank_pids()
        result = {}

        def long_request() -> None:
            result["answer"] = _json(server.port, "/v1/completions", {"prompt": "Go on:", "max_tokens": 3000,
                                                                      "temperature": 0})

        client = threading.Thread(target=long_request)
        client.start()
        deadline = time.time() + 300
        while _metrics(server.port)["dual_requests_running"] < 1:
            assert time.time() < deadline
            time.sleep(0.2)
        time.sleep(1.0)
        os.kill(pids[1], signal.SIGKILL)
        assert server.wait(120) != 0
        client.join(120)
    finally:
        server.kill()
    log = server.text()
    assert re.search(r"\[rank 0\] ERROR rank 0: the tensor-parallel group lost a rank", log), log[-4000:]
    assert "[rank 0] INFO rank 0 stopped after a failure" in log
    status, body = result["answer"]
    # the running request fails with the collective's error (mid-forward) or the group's (at a turn boundary)
    assert status == 500 and re.search(r"lost a rank|Connection|closed", body["error"]["message"]), body
    assert not any(_alive(pid) for pid in pids.values())
