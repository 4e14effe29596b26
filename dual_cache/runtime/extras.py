"""The optional parts of dual-cache and the packages each needs (pyproject.toml's extras).

The core (`import dual_cache`, `generate(cache_implementation="dual")`) needs torch and transformers only. A module or
command that needs an extra calls `require(extra, what)` before importing its packages, so a missing extra fails with
one line naming the extra to install instead of a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util

# extra: the top-level modules its packages install (pyproject.toml lists the packages and their versions)
EXTRAS: dict[str, tuple[str, ...]] = {
    "serve": ("fastapi", "uvicorn"),
    "eval": ("datasets", "evaluate", "rouge", "jieba", "fuzzywuzzy", "wonderwords", "punkt", "mpmath", "matplotlib"),
    "gguf": ("gguf", "accelerate"),  # transformers loads a GGUF file only with accelerate
}


class MissingExtraError(ImportError):
    """An optional part of dual-cache is used without its extra installed; the message is one line naming the
    extra and the command that installs it."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (none: the extra is installed).

    Raises:
        KeyError: `extra` is not one of `EXTRAS`.
    """
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Raise `MissingExtraError` unless every package of `extra` is installed.

    Args:
        extra: a key of `EXTRAS` (`"serve"`, `"eval"`, `"gguf"`).
        what: what needs it, for the message (e.g. "`dual-decoder serve`").

    Raises:
        MissingExtraError: one line: what needs which extra, the missing modules, and the install command.
        KeyError: `extra` is not one of `EXTRAS`.
    """
    absent = missing(extra)
    if absent:
        raise MissingExtraError(f"{what} needs the `{extra}` extra (missing: {', '.join(absent)}); install it with "
                                f"pip install 'dual-cache[{extra}]'")
