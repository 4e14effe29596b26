"""Own-words prompts (issue 71): passages of legal text and code documentation, each asked to be continued in the
model's own words — decoding whose next tokens prompt lookup cannot copy from the prompt, though every short n-gram
of it occurs there.

The corpus ships with every CPython: its licence (`LICENSE.txt` of the standard library) followed by the docstrings
of a fixed list of standard-library modules (their public classes and functions, in sorted order).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sysconfig
from pathlib import Path

from .natural_text import passage_prompt_ids

CUE = "\n\nContinue the text above in your own words."
MODULES = ("argparse", "ast", "collections", "difflib", "email.message", "functools", "http.client", "inspect",
           "json", "logging", "pathlib", "shutil", "subprocess", "tarfile", "textwrap", "typing", "unittest.case",
           "zipfile")


@functools.cache
def own_words_document() -> str:
    """CPython's licence text (empty where the install lacks it), then the standard-library docstrings."""
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    parts = [licence.read_text(encoding="utf-8", errors="replace")] if licence.exists() else []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in sorted(vars(module)):
            value = getattr(module, attr)
            doc = inspect.getdoc(value) if not attr.startswith("_") and (inspect.isclass(value) or
                                                                         inspect.isfunction(value)) else None
            if doc and getattr(value, "__module__", None) == name:
                parts.append(f"{attr}: {doc}")
    return "\n\n".join(parts)


def own_words_prompt_ids(tokenizer, tokens: int, seed: int) -> list[int]:
    """Token ids of a passage of `own_words_document` (offset from `seed`) asking for its continuation in the
    model's own words, chat-formatted, at most `tokens` tokens (`natural_text.passage_prompt_ids`).

    Raises:
        ValueError: for `tokens` < 64 or more than the document holds after the offset.
    """
    return passage_prompt_ids(tokenizer, own_words_document().split(" "), tokens, seed, CUE)
