"""A prompt as one user turn in the model's chat format (its tokenizer's chat template), as token ids."""

from __future__ import annotations


def format_chat(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn with the generation prompt (plain encoding without a template):
    transformers' `apply_chat_template` with `add_generation_prompt=True`."""
    if getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(out["input_ids"])
    return tokenizer(text)["input_ids"]
