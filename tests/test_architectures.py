"""At full budget (sink + window + budget cover the whole request) the dual cache reproduces the default cache's
greedy tokens, fp32, on every architecture listed here: tiny random-weight models built from transformers' own
configs (no Hub access). The README's "tested on N architectures" is `len(ARCHITECTURES)` (tests/test_readme.py)."""

from __future__ import annotations

import pytest
import torch
import transformers

ARCHITECTURES = (  # transformers model names (`<Name>Config`, `<Name>ForCausalLM`); Gemma3: its text model
    "Llama", "Mistral", "Mixtral", "Qwen2", "Qwen2Moe", "Qwen3", "Qwen3Moe", "Gemma", "Gemma2", "Gemma3",
    "Phi", "Phi3", "Olmo2", "Cohere", "GPTNeoX", "Starcoder2",
)
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=None, pad_token_id=0)


def build(name: str):
    """A tiny random-weight `<name>ForCausalLM` (2 layers, 4 query / 2 KV heads of 16; 4 experts for MoE models) in
    eval mode."""
    config_cls = getattr(transformers, "Gemma3TextConfig" if name == "Gemma3" else f"{name}Config")
    config = config_cls(**SMALL)
    if getattr(config, "head_dim", 16) != 16:
        config.head_dim = 16
    for field, value in (("num_experts", 4), ("num_local_experts", 4), ("num_experts_per_tok", 2),
                         ("moe_intermediate_size", 32), ("shared_expert_intermediate_size", 32)):
        if getattr(config, field, None) is not None:  # mixture-of-experts models: a few small experts
            setattr(config, field, value)
    torch.manual_seed(0)
    return getattr(transformers, f"{name}ForCausalLM")(config).eval()


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_full_budget_equals_the_default_cache(name):
    model = build(name)
    ids = torch.randint(3, 96, (2, 100), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # the second row left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    dense = model.generate(ids, **kwargs)
    dual = model.generate(ids, cache_implementation="dual", cache_config={"budget": 4096, "window": 16}, **kwargs)
    assert torch.equal(dense, dual)
