"""Each dual forward's model inputs, built as transformers' `generate()` builds them.

`generate()` hands its decoding loop the model's keyword arguments (`model_kwargs`): besides the cache, the
attention mask and the positions, whatever the model takes — GPT-2's `token_type_ids`, a vision-language model's
`pixel_values`, `output_hidden_states`, any input a model adds. transformers' own loop builds every forward's inputs
from them with the model's `prepare_inputs_for_generation` (which slices per-position inputs to the forward's
tokens, gives prefill-only inputs such as `pixel_values` to the first forward only, and applies the model's own
rules) and extends the per-position ones by one position per new token with the model's
`_update_model_kwargs_for_generation`. `ModelInputs` does both for the dual loop, with the loop's own tokens, mask,
positions and cache in their place:

- a prefill chunk ending at input position `end` gets the per-position inputs up to `end`, as transformers' chunked
  prefill gives them, and the prefill-only inputs (a prompt with those must fit one chunk, as in transformers);
- a decode step `[x_t, x̂_{t+1}]` gets them extended by one more position for the speculated token, which gets
  what transformers would give the position after `x_t` (GPT-2's `token_type_ids`: `x_t`'s type again);
- after each sampled token `advance()` extends them by its position.

What the dual path cannot serve is refused before any work (`runtime/refusals.py`). `DualStep` without `ModelInputs`
(the serving scheduler, which has no model keyword arguments) feeds tokens, mask and positions alone.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers.generation import utils as generation_utils

from ..runtime.refusals import refuse

CACHE_KWARGS = ("cache", "past_key_values")  # transformers ≥5.24 / 5.22–5.23
# What the dual loop supplies itself: never taken from `model_kwargs` as they are
LOOP_INPUTS = (*CACHE_KWARGS, "attention_mask", "position_ids", "inputs_embeds", "input_ids", "use_cache",
               "logits_to_keep", "dual_cache")
# Inputs transformers gives the first forward of a request only (its prefill); a short list for versions without it
PREFILL_ONLY = getattr(generation_utils, "MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL",
                       ("pixel_values", "pixel_values_videos", "image_sizes", "input_features", "input_values"))
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids", "moe_mm_token_type_ids")  # per-position model inputs


def cache_kwarg_name(model: torch.nn.Module, method: str = "forward") -> str:
    """Name of the argument of `model.<method>` (`forward` or `prepare_inputs_for_generation`) that takes the cache on
    the installed transformers: the one its signature names (`cache` from 5.24, `past_key_values` before), and for a
    method that takes only `**kwargs` (a wrapped forward, a model's own `prepare_inputs_for_generation` that hands its
    keywords on) the one transformers' own `GenerationMixin.prepare_inputs_for_generation` takes, so no deprecated
    name is passed."""
    for function in (getattr(model, method), generation_utils.GenerationMixin.prepare_inputs_for_generation):
        params = inspect.signature(function).parameters
        for name in ("cache", "past_key_values"):
            if name in params:
                return name
    return "past_key_values"


def forward_inputs(cache, cache_arg: str, logits_to_keep: int, call) -> dict[str, Any]:
    """The keyword arguments every dual forward carries: the cache as the model's cache argument (`cache_arg`), the
    forward's plan as `dual_cache` (`call.DualCall`: it routes the call's attention to the dual cache,
    `layer/routing.py`), `use_cache=True` and `logits_to_keep`."""
    return {cache_arg: cache, "dual_cache": call, "use_cache": True, "logits_to_keep": logits_to_keep}


def input_positions(model_kwargs: dict, attention_mask: torch.Tensor | None, batch: int, length: int,
                    device: torch.device) -> torch.Tensor:
    """`(batch, length)` int64 positions of the input's tokens: `model_kwargs["position_ids"]` when given (generate()
    puts transformers' own there), else as transformers computes them (the count of real tokens before each, pads at
    0; `0..length-1` without a mask).

    Raises:
        ValueError: for `position_ids` of another shape than `(batch or 1, length)` (e.g. 3-D multimodal RoPE
            positions), before any work.
    """
    given = model_kwargs.get("position_ids")
    if given is not None:
        if given.dim() != 2 or given.shape[-1] != length or given.shape[0] not in (1, batch):
            raise refuse("position_ids of another shape than (batch, input length)",
                         f"position_ids of shape {tuple(given.shape)} for an input of {batch} × {length} tokens")
        return given.to(device=device, dtype=torch.long).expand(batch, length)
    if attention_mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


class ModelInputs:
    """The model inputs of one `generate()` request's forwards beyond tokens, mask, positions and cache.

    Args:
        model: the causal LM (its `prepare_inputs_for_generation` and `_update_model_kwargs_for_generation` apply).
        model_kwargs: `generate()`'s model keyword arguments (what `_sample` receives); the loop's own
            (`LOOP_INPUTS`) are left out.
        cache_arg: the forward argument that takes the cache (`"cache"` or `"past_key_values"`).
        prompt_tokens: input positions the prefill feeds (the new ones, on a continued cache).
        chunk_tokens: the prefill's chunk length (`DualDecoderConfig.prefill_chunk_size`).

    Raises:
        ValueError: before any work, for prefill-only inputs (`PREFILL_ONLY`, e.g. `pixel_values`) with a prompt of
            more than one prefill chunk, or a model whose `_update_model_kwargs_for_generation` cannot extend its
            inputs without the forward's outputs (`refusals.REFUSED`).
    """

    def __init__(self, model, model_kwargs: dict, cache_arg: str, prompt_tokens: int, chunk_tokens: int) -> None:
        self.model = model
        self.cache_arg = cache_arg
        self.prepare_cache_arg = cache_kwarg_name(model, "prepare_inputs_for_generation")
        self.kwargs = {k: v for k, v in model_kwargs.items() if k not in LOOP_INPUTS}
        prefill_only = [k for k in PREFILL_ONLY if self.kwargs.get(k) is not None]
        if prefill_only and prompt_tokens > chunk_tokens:
            raise refuse("prefill-only model inputs over several prefill chunks",
                         f"{prefill_only} with {prompt_tokens} prompt tokens in prefill chunks of {chunk_tokens}")
        try:
            self._extended(dict(self.kwargs))  # a dry run: the model's update needs nothing the loop lacks
        except Exception as error:  # noqa: BLE001 - any failure of the model's own code is the refusal
            raise refuse("model inputs updated from the model's outputs",
                         f"{type(model).__name__}._update_model_kwargs_for_generation failed without the forward's "
                         f"outputs ({type(error).__name__}: {error})") from error

    def _extended(self, kwargs: dict) -> dict:
        """`kwargs` extended by one position, as transformers extends them after a new token."""
        return self.model._update_model_kwargs_for_generation({}, kwargs, num_new_tokens=1)

    def _prepared(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, length: int, mask,
                  position_ids: torch.Tensor, cache, first: bool, kwargs: dict) -> dict:
        inputs = self.model.prepare_inputs_for_generation(
            input_ids, next_sequence_length=length, attention_mask=mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, is_first_iteration=first, **{self.prepare_cache_arg: cache}, **kwargs,
        )
        return {k: v for k, v in inputs.items() if k not in (*CACHE_KWARGS, "use_cache", "logits_to_keep")}

    def prefill(self, tokens: torch.Tensor, end: int, mask: torch.Tensor | None, position_ids: torch.Tensor,
                cache) -> dict[str, Any]:
        """The model inputs of a prefill chunk (without `forward_inputs`).

        Args:
            tokens: the chunk: `(B, c)` int64 ids or `(B, c, hidden)` embeddings of input positions `[end - c, end)`.
            end: the input position after the chunk.
            mask: `(B, end)` 0/1 attention mask up to the chunk's end, or None.
            position_ids: `(B, c)` int64 positions of the chunk's tokens.
            cache: the request's `DualDecoderCache`.
        """
        kwargs = {k: (v[..., :end] if k in TOKEN_TYPES and v is not None else v) for k, v in self.kwargs.items()}
        embeds = tokens.is_floating_point()
        ids = tokens.new_zeros(tokens.shape[:1] + (0,), dtype=torch.long) if embeds else tokens
        return self._prepared(ids, tokens if embeds else None, tokens.shape[1], mask, position_ids, cache, True,
                              kwargs)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
             cache) -> dict[str, Any]:
        """The model inputs of a decode step (without `forward_inputs`).

        Args:
            input_ids: `(B, q)` int64: the real token, and the speculated one when q = 2.
            attention_mask: `(B, n + q)` 0/1 attention mask including the step's positions, or None.
            position_ids: `(B, q)` int64 positions of the step's tokens.
            cache: the request's `DualDecoderCache`.
        """
        q = input_ids.shape[1]
        kwargs = self.kwargs if q == 1 else self._extended(dict(self.kwargs))  # the speculated token's position
        return self._prepared(input_ids, None, q, attention_mask, position_ids, cache, False, kwargs)

    def advance(self) -> None:
        """A real token was appended to every sequence: extend the per-position inputs by its position."""
        self.kwargs = self._extended(dict(self.kwargs))
