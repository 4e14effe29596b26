"""Helpers for the evaluation tests (no tests here): a character-level tokenizer and a tiny random Llama."""

from __future__ import annotations

import string

import torch

CHARS = string.printable  # 100 characters
VOCAB_SIZE = 128


def char_tokenizer():
    """A fast character-level tokenizer (ids < 128) with a tiny chat template; builds in milliseconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2}
    for ch in CHARS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}U: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    return tok


def tiny_model(seed: int = 0):
    """Tiny random-weight Llama over the character vocabulary (2 layers, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=2, pad_token_id=0, bos_token_id=None,
    )
    return LlamaForCausalLM(config).eval()
