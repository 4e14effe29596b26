"""The dual-token decode step (docs/design.md §2), one implementation for `generate()` (`decoding.py`) and the serving
scheduler (`serving/batch.py`).

A step feeds `[x_t, x̂_{t+1}]` per sequence at positions `[p, p+1]`, keeps only the real token's K/V (`crop(-1)`)
and returns both slots' logits, on the device. Everything it decides beforehand — the speculated tokens (on the
sequences the host already holds), the rows miss repair re-selects (`repair.RepairPolicy`) — is decided on the
host from values the caller has read back once for the step, and the step's inputs go to the device through
page-locked memory without a host wait (`streams.to_device`). So a step whose rows all hit waits for the device
exactly once, where the caller reads its sampled tokens (`tests/test_sync_points.py`).
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import torch

from ..config import DualDecoderConfig
from ..layer.repair import RepairPolicy
from ..model.inputs import ModelInputs, cache_kwarg_name, forward_inputs
from ..runtime.streams import to_device
from ..runtime.sync_points import uncounted
from .speculators import make_speculator


class StepOutput(NamedTuple):
    """What a decode step returns, on the device.

    Attributes:
        logits: `(B, V)` float32, the logits after the real token `x_t`.
        spec_logits: `(B, V)` float32, the logits after the speculated token `x̂_{t+1}` (None with one token per
            forward).
        hidden_states: when the model was asked for them (`output_hidden_states`), the real token's hidden states:
            per layer (embeddings first, as the model returns them) `(B, 1, hidden)`; else None.
    """

    logits: torch.Tensor
    spec_logits: torch.Tensor | None
    hidden_states: tuple[torch.Tensor, ...] | None


class DualStep:
    """Speculation, repair decisions and the forward of one decode step, for any cache of the model's.

    Args:
        model: the causal LM (on its device, in eval mode).
        config: the requests' `DualDecoderConfig` (speculator, miss repair, drift).

    Attributes:
        tokens_per_forward: 2 (real + speculated token), or 1 with `speculator="none"`.
        repair: the `RepairPolicy` of every step.
    """

    def __init__(self, model, config: DualDecoderConfig) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.cache_arg = cache_kwarg_name(model)
        self.speculator = make_speculator(config.speculator, config.ngram_size)
        self.tokens_per_forward = self.speculator.tokens_per_forward
        self.repair = RepairPolicy(config.miss_repair and self.tokens_per_forward == 2, config.repair_drift,
                                   self.device, config.drift_on_hit_steps)

    def propose(self, sequences: Sequence[torch.Tensor], chained: Sequence[int | None] | None,
                last_hit: Sequence[bool | None] | None, rows: Sequence[Hashable] | None = None) -> list[int] | None:
        """The speculated token of each sequence (`Speculator.propose`, on host values), or None with one token per
        forward.

        Args:
            sequences: per sequence, its `(T_i,)` int64 host token ids including the newest real token.
            chained: per sequence, the argmax of the last forward's speculated slot (None on its first step; None
                for all on every sequence's first step).
            last_hit: per sequence, whether the last speculated token hit (None as `chained`).
            rows: per sequence, the owner the speculator keys its per-sequence state by (the serving `Row`); None:
                the sequence's index (one `generate()` request).
        """
        if self.tokens_per_forward == 1:
            return None
        with uncounted():  # host tensors only: the sequences were read back already
            return self.speculator.propose(sequences, chained, last_hit, rows)

    def forward(self, cache, real: list[int], speculated: list[int] | None, positions: list[int],
                mask: torch.Tensor | None, live: list[bool], hit: list[bool] | None,
                inputs: ModelInputs | None = None) -> StepOutput:
        """Run the step on `cache` (between `end_prefill` and `end_request` of its request).

        Args:
            cache: the `DualDecoderCache` holding the sequences.
            real: per sequence, the real token `x_t` (pads for finished sequences).
            speculated: per sequence, the speculated token `x̂_{t+1}` (None with one token per forward).
            positions: per sequence, the position of `x_t` (its own count of real tokens before it).
            mask: `(B, n + q)` 0/1 attention mask on the device, the step's q new positions included; None when
                every position is real.
            live: per sequence, still generating (finished ones are fed pads and never repaired).
            hit: per sequence, whether the speculated token that chose this step's entries equalled `x_t` (False
                re-selects it in every layer); None on the request's first step (every live sequence re-selected).
            inputs: the request's other model inputs (`generate()`'s model keyword arguments), built around the
                step's tokens, mask and positions by the model's own `prepare_inputs_for_generation`; None feeds
                tokens, mask and positions alone.

        Returns:
            `StepOutput`: both slots' logits and, when asked for, the real token's hidden states.
        """
        q = self.tokens_per_forward
        call = cache.begin_step(self.repair.rows(live, hit))  # the step's plan, handed to every layer's attention
        tokens = [[r, s] for r, s in zip(real, speculated)] if q == 2 else [[r] for r in real]
        position_ids = [[p + i for i in range(q)] for p in positions]
        model_inputs = {"input_ids": to_device(tokens, self.device), "attention_mask": mask,
                        "position_ids": to_device(position_ids, self.device)}
        if inputs is not None:
            model_inputs = inputs.step(**model_inputs, cache=cache)
        outputs = self.model(**model_inputs, **forward_inputs(cache, self.cache_arg, q, call))
        if q == 2:
            cache.crop(-1)  # only the real token's K/V are kept
        logits = outputs.logits.float()
        hidden = getattr(outputs, "hidden_states", None)
        del outputs
        return StepOutput(logits[:, 0], logits[:, 1] if q == 2 else None,
                          None if hidden is None else tuple(h[:, :1] for h in hidden))
