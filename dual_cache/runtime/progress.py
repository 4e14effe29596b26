"""Progress bars (tqdm) for runs that are silent for minutes on a CPU, the same everywhere: a `generate()` call's
prefill by layer (every prefill chunk's layers, so a one-chunk prompt moves too) and its decode by token, whatever
the cache (`GenerationProgress`); the benchmark's cells by cell, with the cell's name (`eval/throughput/bench.py`).
Bars go to stderr and only to a terminal; `--quiet` turns them off (`shown`).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.generation.streamers import BaseStreamer


def shown(quiet: bool = False, stream: Any = None) -> bool:
    """Whether to draw progress bars: not `quiet`, and `stream` (default stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    return not quiet and bool(getattr(stream, "isatty", lambda: False)())


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM, in order (`get_decoder().layers`, else the first module list
    as long as `num_hidden_layers`); `[]` when neither is found."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return list(layers)
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and count and len(module) == count:
            return list(module)
    return []


def _positions_of(args: tuple, kwargs: dict) -> int:
    """Positions a decoder layer's call processes (its hidden states' second axis; 0 when not found)."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    return hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 else 0


class PrefillBar:
    """A bar over the decoder-layer calls of a prompt's prefill: `chunks × layers` steps, one per layer call that
    processes more than two positions (a prefill chunk: decode steps feed one or two, a probe forward one).
    Forward pre-hooks on the layers move it; `close()` removes them (idempotent).

    Args:
        model: the causal LM. prompt_tokens: prompt positions the prefill feeds. chunk_tokens: positions per prefill
            forward (the prompt in one forward: `prompt_tokens` or more). desc: the bar's label. enabled: False
            draws nothing and registers no hook.
    """

    def __init__(self, model: torch.nn.Module, prompt_tokens: int, chunk_tokens: int, desc: str = "prefill",
                 enabled: bool = True) -> None:
        layers = decoder_layers(model) if enabled else []
        chunks = max(1, math.ceil(prompt_tokens / max(1, chunk_tokens)))
        self._hooks = []
        self.bar = None
        if enabled and layers:
            self.bar = tqdm(total=chunks * len(layers), desc=desc, unit="layer", file=sys.stderr, leave=False,
                            dynamic_ncols=True)
            self._hooks = [layer.register_forward_pre_hook(self._step, with_kwargs=True) for layer in layers]

    def _step(self, module, args, kwargs) -> None:
        if self.bar is not None and _positions_of(args, kwargs) > 2:
            self.bar.update(1)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class GenerationProgress(BaseStreamer):
    """A transformers streamer that shows one `generate()` call's progress: the prefill by layer (`PrefillBar`),
    then the decode by token (one step per `put` after the prompt's), and hands every `put` / `end` on to `inner`.
    Works with any cache (the dense default one included). Use as a context manager, or call `close()`, so the
    hooks go on every exit path.

    Args:
        model: the causal LM. prompt_tokens: prompt positions the prefill feeds. chunk_tokens: positions per prefill
            forward (`DualDecoderConfig.prefill_chunk_size`; the dense cache prefills in one forward: pass
            `prompt_tokens`). new_tokens: tokens to generate (the decode bar's total).
        desc: a label put before "prefill" / "decode". enabled: False draws nothing (`shown()` decides).
        decode_bar: False keeps the decode bar off (when `inner` prints the text as it comes).
        inner: a streamer to hand every call on to (e.g. a `TextStreamer`), or None.
    """

    def __init__(self, model: torch.nn.Module, prompt_tokens: int, chunk_tokens: int, new_tokens: int,
                 desc: str = "", enabled: bool = True, decode_bar: bool = True,
                 inner: BaseStreamer | None = None) -> None:
        self.inner = inner
        self.enabled = enabled
        self.new_tokens = new_tokens
        self.desc = f"{desc} " if desc else ""
        self.decode_bar = decode_bar
        self.prefill = PrefillBar(model, prompt_tokens, chunk_tokens, f"{self.desc}prefill", enabled)
        self.decode = None
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
        else:
            if self.prefill is not None:  # the first generated token: the prefill is done
                self.prefill.close()
                self.prefill = None
                if self.enabled and self.decode_bar:
                    self.decode = tqdm(total=self.new_tokens, desc=f"{self.desc}decode", unit="token",
                                       file=sys.stderr, leave=False, dynamic_ncols=True)
            if self.decode is not None:
                self.decode.update(1)
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        self.close()
        if self.inner is not None:
            self.inner.end()

    def close(self) -> None:
        """Remove the hooks and close the bars (idempotent)."""
        if self.prefill is not None:
            self.prefill.close()
            self.prefill = None
        if self.decode is not None:
            self.decode.close()
            self.decode = None

    def __enter__(self) -> "GenerationProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
