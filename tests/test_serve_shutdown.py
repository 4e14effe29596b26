"""`dual-decoder serve` stops on SIGINT (Ctrl-C) and SIGTERM as uvicorn users expect: one line saying it stopped, exit
status 0, no traceback — whether or not it served a request first. A subprocess serving a tiny random Llama with the
embedded model's tokenizer (a saved folder, `--model`)."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from dual_cache.model.loading import DEFAULT_GGUF_FILE, default_model_folder

    folder = tmp_path_factory.mktemp("tiny-served")
    tokenizer = AutoTokenizer.from_pretrained(default_model_folder(), gguf_file=DEFAULT_GGUF_FILE)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: dict | None = None) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


@pytest.mark.parametrize("served, sig", [(True, signal.SIGINT), (False, signal.SIGINT), (True, signal.SIGTERM)],
                         ids=["served-SIGINT", "idle-SIGINT", "served-SIGTERM"])
def test_serve_stops_on_a_signal_with_one_line_and_status_0(tiny_folder, tmp_path, served, sig):
    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as handle:
        # SIGINT as a terminal delivers it: a child of a non-interactive shell would inherit it ignored
        process = subprocess.Popen(
            [sys.executable, "-m", "dual_cache.cli", "serve", "--model", tiny_folder, "--port", str(port),
             "--cache-config", '{"budget": 8, "window": 4}'],
            stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.time() + 300
            while "Uvicorn running" not in log.read_text(errors="replace"):
                assert process.poll() is None and time.time() < deadline, log.read_text(errors="replace")[-3000:]
                time.sleep(0.2)
            if served:
                assert _request(port, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3}) == 200
            process.send_signal(sig)
            status = process.wait(120)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(30)
    text = log.read_text(errors="replace")
    assert status == 0, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    name = signal.Signals(sig).name
    assert f"dual-decoder serve: stopped on {name} after {int(served)} requests" in text
