"""Shared fixtures: tiny random-weight models built from configs, and the embedded SmolLM2 model."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import torch

import dual_cache  # noqa: F401  (registers cache_implementation="dual")


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def tiny_qwen2_mqa(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=2048, eos_token_id=None, pad_token_id=0,
    )
    return Qwen2ForCausalLM(config).eval()


def tiny_gemma3(seed: int = 0):
    """Gemma-3-style text model: sliding-window layers mixed with full-attention layers."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=24, max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        eos_token_id=None, pad_token_id=0, bos_token_id=1,
    )
    return Gemma3ForCausalLM(config).eval()


TINY_MODELS = {"llama": tiny_llama, "qwen2-mqa": tiny_qwen2_mqa, "gemma3": tiny_gemma3}


def six_layer_llama(seed: int):
    """Six full-attention layers (4 query / 2 KV heads, head_dim 16): enough layers for the pipeline's lookahead."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, eos_token_id=None, pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def record_selections(cache) -> list:
    """What each decode step's attention read of every layer's resident set (`gpu_check.record_attended`)."""
    from dual_cache.eval.gpu_check import record_attended

    return record_attended(cache)


@pytest.fixture(scope="session")
def embedded():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once per session."""
    return dual_cache.load_default_model()


@contextlib.contextmanager
def uvicorn_server(app):
    """Run the ASGI `app` with uvicorn on a free port of 127.0.0.1 in a thread; yields the port, then stops it."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    instance = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=instance.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not instance.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        instance.should_exit = True
        thread.join(30)
        assert not thread.is_alive()
