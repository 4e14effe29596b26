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
    if tokens < 64:
        raise ValueError(f"a natural-text prompt needs at least 64 tokens, got {tokens}.")
    words = reference_document().split(" ")
    start = random.Random(seed).randrange(0, len(words) // 2)
    chat = bool(getattr(tokenizer, "chat_template", None))
    # about 1.3 tokens per word of this document: take enough words, then cut the token ids
    passage = " ".join(words[start : start + int(tokens * 1.5)])
    if not chat:
        ids = tokenizer(passage)["input_ids"]
        if len(ids) < tokens:
            raise ValueError(f"the reference document holds fewer than {tokens} tokens after offset {start}.")
        return ids[:tokens]
    cue = format_chat(tokenizer, CUE)
    overhead = len(cue) - len(tokenizer(CUE, add_special_tokens=False)["input_ids"])
    body = tokenizer(passage, add_special_tokens=False)["input_ids"][: tokens - len(cue) - overhead]
    ids = format_chat(tokenizer, tokenizer.decode(body) + CUE)
    return ids[:tokens] if len(ids) <= tokens + 8 else ids[-tokens:]
