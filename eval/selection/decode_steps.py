"""Real decode steps of the dual loop, recorded for the selection-analysis tools (`miss_candidates`,
`resident_candidates`): the model decodes as the dual loop does, with dense attention (transformers' `DynamicCache`),
each step feeding the real token and the speculated one (`[x_t, x̂_{t+1}]`, the library's own `SelfSpeculator`)
and keeping only the real token's K/V; every full-attention layer's queries and keys of the step are kept.

Greedy (`temperature` 0) or sampled as the library samples (`sampling.StepSampler`, coupled Gumbel-max: the noise
that draws the next real token also draws the speculated slot's guess, at `temperature`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...generate.sampling import StepSampler
from ...generate.speculators import SelfSpeculator
from ...model.inputs import cache_kwarg_name

RECORDER = "dual_decode_steps_recorder"
_recorded: dict | None = None  # layer -> (query (1, H_q, q, D), keys (1, H_kv, n, D), scaling) of the last call


def _recorder(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """SDPA attention that keeps each full-attention layer's queries and keys of the call (float32, host)."""
    if _recorded is not None and getattr(module, "sliding_window", None) is None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        _recorded[module.layer_idx] = (query.detach().float(), key.detach().float(), scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


def use_recorder(model) -> None:
    """Route `model`'s attention through the recorder (SDPA with the model's own SDPA mask)."""
    AttentionInterface.register(RECORDER, _recorder)
    AttentionMaskInterface.register(RECORDER, sdpa_mask)
    model.set_attn_implementation(RECORDER)


@dataclass
class StepRecord:
    """One recorded decode step of one prompt (batch 1).

    Attributes:
        step: the step's index (0: the first decode step). position: the real token's position (its count of
            tokens before it); the speculated token sits at `position + 1`.
        hit: whether the speculated token that chose this step's entries equalled the real one (None on step 0,
            whose entries the prompt's last query chose).
        real, spec: per full-attention layer, the real and the speculated token's query `(1, H_q, D)` float32.
        keys: per full-attention layer, every key so far `(1, H_kv, position + 2, D)` float32 (the step's two
            tokens last). scaling: per layer, the softmax scale.
    """

    step: int
    position: int
    hit: bool | None
    real: dict[int, torch.Tensor]
    spec: dict[int, torch.Tensor]
    keys: dict[int, torch.Tensor]
    scaling: dict[int, float]


def full_attention_layers(model) -> list[int]:
    """The model's full-attention layers (every layer without `layer_types`)."""
    text = model.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    return [i for i, kind in enumerate(kinds) if kind == "full_attention"]


def dual_steps(model, ids: list[int], steps: int, temperature: float = 0.0, seed: int = 0) -> Iterator[StepRecord]:
    """Decode `steps` tokens after the prompt `ids` the way the dual loop does (dense attention), yielding each step's
    record. The model must use the recorder (`use_recorder`). Sampling draws from torch's global generator, seeded
    with `seed` here."""
    global _recorded
    speculator = SelfSpeculator()
    sampler = StepSampler(temperature > 0)
    scale = 1.0 / temperature if temperature > 0 else 1.0
    cache = DynamicCache(config=model.config)
    cache_arg = cache_kwarg_name(model)
    torch.manual_seed(seed)
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1, **{cache_arg: cache}).logits
            position = len(ids)
            real_token = int(sampler.real(logits[:, -1].float() * scale)[0])
            sequence = list(ids) + [real_token]
            guess = speculator.propose([torch.tensor(sequence)], None, None)[0]
            hit = None
            for step in range(steps):
                _recorded = {}
                out = model(torch.tensor([[real_token, guess]]), use_cache=True, **{cache_arg: cache},
                            position_ids=torch.tensor([[position, position + 1]]), logits_to_keep=2)
                cache.crop(-1)
                recorded, _recorded = _recorded, None
                yield StepRecord(step, position, hit, {layer: q[:, :, 0] for layer, (q, _, _) in recorded.items()},
                                 {layer: q[:, :, 1] for layer, (q, _, _) in recorded.items()},
                                 {layer: k for layer, (_, k, _) in recorded.items()},
                                 {layer: s for layer, (_, _, s) in recorded.items()})
                next_real = int(sampler.real(out.logits[:, 0].float() * scale)[0])
                chained = int(sampler.speculated(out.logits[:, 1].float() * scale)[0])
                hit = next_real == guess
                sequence.append(next_real)
                guess = speculator.propose([torch.tensor(sequence)], [chained], [hit])[0]
                real_token, position = next_real, position + 1
    finally:
        _recorded = None
