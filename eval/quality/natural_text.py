"""Natural-text prompts: distinct passages of the RULER essay haystack (the Python Language Reference shipped with
CPython, `dual_cache.model.needle_prompt.reference_document`), each asked to be continued — the decode workload of a
batch of long requests whose next tokens a speculator cannot copy from its own batch-mates.
"""

from __future__ import annotations

import random

from ...model.chat import format_chat
from ...model.needle_prompt import reference_document

CUE = "\n\nContinue the text above in the same style."


def natural_prompt_ids(tokenizer, tokens: int, seed: int) -> list[int]:
    """Token ids of a passage of the reference document (offset drawn from `seed`) asking for its continuation, in
    the model's chat format (plain text for a tokenizer without a chat template, whose base model continues it as a
    completion), at most `tokens` tokens long (within a few tokens of it).

    Raises:
        ValueError: for `tokens` < 64 or more than the document holds.
    """
    return passage_prompt_ids(tokenizer, reference_document().split(" "), tokens, seed, CUE)


def passage_prompt_ids(tokenizer, words: list[str], tokens: int, seed: int, cue: str) -> list[int]:
    """Token ids of a passage of `words` (offset drawn from `seed` in the first half) followed by `cue`, in the
    model's chat format (plain text without `cue` for a tokenizer without a chat template), at most `tokens` tokens
    long (within a few tokens of it).

    Raises:
        ValueError: for `tokens` < 64 or more than `words` hold after the offset.
    """
    if tokens < 64:
        raise ValueError(f"a natural-text prompt needs at least 64 tokens, got {tokens}.")
    start = random.Random(seed).randrange(0, len(words) // 2)
    chat = bool(getattr(tokenizer, "chat_template", None))
    # about 1.3 tokens per word of this document: take enough words, then cut the token ids
    passage = " ".join(words[start : start + int(tokens * 1.5)])
    if not chat:
        ids = tokenizer(passage)["input_ids"]
        if len(ids) < tokens:
            raise ValueError(f"the document holds fewer than {tokens} tokens after offset {start}.")
        return ids[:tokens]
    formatted_cue = format_chat(tokenizer, cue)
    overhead = len(formatted_cue) - len(tokenizer(cue, add_special_tokens=False)["input_ids"])
    body = tokenizer(passage, add_special_tokens=False)["input_ids"][: tokens - len(formatted_cue) - overhead]
    ids = format_chat(tokenizer, tokenizer.decode(body) + cue)
    return ids[:tokens] if len(ids) <= tokens + 8 else ids[-tokens:]
