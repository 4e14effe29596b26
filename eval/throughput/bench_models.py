"""Models and prompts of the throughput benchmark: a random-weight Llama-3.1-8B-shaped model (nothing downloaded),
a tiny random model for tests, the embedded model or any path / Hub id; needle or natural-text prompts or random ids;
byte sizes of weights and of a full KV cache."""

from __future__ import annotations

import torch

NAMED_MODELS = ("embedded", "tiny", "llama8b")


def llama31_8b_config():
    """A `LlamaConfig` shaped like Llama-3.1-8B (32 layers, 32 query / 8 KV heads, head_dim 128, bf16)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=None, pad_token_id=0,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
        dtype="bfloat16",
    )


def tiny_llama_config():
    """A tiny `LlamaConfig` (3 layers, 4 query / 2 KV heads, head_dim 16) for smoke runs and tests."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=None, pad_token_id=0,
    )


def random_model(config, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random-weight causal LM from `config`, built directly in `dtype` on `device` (no weights download)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def load_bench_model(name: str, device: torch.device):
    """`(model, tokenizer or None)` for a model name of `--model` (see `NAMED_MODELS`) or a path / Hub id.

    Raises:
        ValueError: for `llama8b` without CUDA (16 GB of bf16 weights; a CPU run would measure nothing useful).
    """
    if name == "tiny":
        return random_model(tiny_llama_config(), torch.float32, device), None
    if name == "llama8b":
        if device.type != "cuda":
            raise ValueError("--model llama8b needs --device cuda (a random 8B model in bf16).")
        return random_model(llama31_8b_config(), torch.bfloat16, device), None
    from ...model.loading import load_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return load_model(None if name == "embedded" else name, dtype=dtype, device=str(device))


class PromptSource:
    """Batches of prompts, one seed per row (row `b` of a batch uses seed `b`, so the rows differ): for a model with
    a tokenizer, word-needle questions over the Python reference (`kind="needle"`) or passages of the RULER essay
    haystack asked to be continued (`kind="natural"`, `eval/quality/natural_text.py`: the decode workload of long
    requests that do not copy from each other), left-padded to the longest row; random ids without a tokenizer.

    Raises:
        ValueError: an unknown `kind`, or `"natural"` without a tokenizer (a random-weight model).
    """

    def __init__(self, tokenizer, vocab_size: int, device: torch.device, kind: str = "needle") -> None:
        if kind not in ("needle", "natural"):
            raise ValueError(f"prompt kind must be 'needle' or 'natural', got {kind!r}.")
        if kind == "natural" and tokenizer is None:
            raise ValueError("natural-text prompts need a model with a tokenizer (random-weight models get random "
                             "ids); use --prompts needle or a real model.")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.device = device
        self.kind = kind
        self._cache: dict[tuple[int, int], list[int]] = {}

    def _ids(self, context: int, seed: int) -> list[int]:
        key = (context, seed)
        if key not in self._cache:
            if self.kind == "natural":
                from ..quality.natural_text import natural_prompt_ids

                self._cache[key] = natural_prompt_ids(self.tokenizer, context, seed)
            else:
                from ...model.chat import format_chat
                from ...model.needle_prompt import make_needle_prompt

                prompt = make_needle_prompt(self.tokenizer, context, seed=seed)
                self._cache[key] = format_chat(self.tokenizer, prompt.text)
        return self._cache[key]

    def batch(self, batch: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(input_ids, attention_mask)`, both `(batch, P)` int64 on the model's device."""
        if self.tokenizer is None:
            rows = []
            for seed in range(batch):
                generator = torch.Generator().manual_seed(seed)
                rows.append(torch.randint(1, self.vocab_size, (context,), generator=generator))
            ids = torch.stack(rows)
            return ids.to(self.device), torch.ones_like(ids).to(self.device)
        rows = [self._ids(context, seed) for seed in range(batch)]
        width = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        ids = torch.full((batch, width), pad, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for b, row in enumerate(rows):
            ids[b, width - len(row):] = torch.tensor(row)
            mask[b, width - len(row):] = 1
        return ids.to(self.device), mask.to(self.device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied weights counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def kv_bytes_estimate(model_config, batch: int, tokens: int, dtype: torch.dtype) -> int:
    """Full KV bytes of `batch` sequences of `tokens` tokens: `2 × L × H_kv × tokens × D × dtype bytes × batch`."""
    text = model_config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * text.num_hidden_layers * kv_heads * tokens * head_dim * item * batch
