"""How a decode step turns logits into the real token and the next speculated token (docs/design.md §2, step 4).

Greedy: both are argmaxes. Sampling: the real token is an exact sample of the processed scores' softmax (all of
`generate()`'s logits processors apply); the speculated token is its best guess of the *next* real token. Drawn
independently, the two agree rarely under sampling (a guess that misses chooses the next step's entries for a token
that is not fed). **Coupled sampling** shares the randomness instead (Gumbel-max: `argmax(scores + G)` with `G`
i.i.d. standard Gumbel is an exact sample of `softmax(scores)`): the noise `G_{t+2}` that will pick the real token
`x_{t+2}` is drawn one step early and also picks the speculated `x̂_{t+2}` from the speculated slot's processed
scores. Where the guess `x̂_{t+1}` hit, the two slots' scores are those of the same context, so the guess equals the
sample as often as under greedy decoding. The real token stays an exact sample: the noise that picks it was drawn
before, and independently of, the scores it is added to (the speculated token is fed after the real one, which
does not attend to it).

Noise is float64 (`-log(-log U)`, `U` uniform in `[0, 1)`: `U = 0` gives `-inf`, never `+inf`), from torch's global
generator on the logits' device, so a seeded run is reproducible; it draws other random numbers than
`torch.multinomial`, so `coupled=False` keeps the default cache's tokens for a seed (one `multinomial` per step,
as `GenerationMixin._sample` draws). Under coupled sampling the speculated slot's scores go through the same logits
processors, on the sequence extended by the speculated token (as transformers' assisted decoding scores its
candidate positions), so the processors are called twice per step; otherwise (greedy, or `coupled=False`) the guess
is the argmax of the speculated slot's raw logits and the processors are called once per step, as transformers
calls them (a processor that keeps state between calls, like a forced-token schedule, is safe there).
"""

from __future__ import annotations

import torch


def gumbel_noise(shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None = None) -> torch.Tensor:
    """`shape` float64 i.i.d. standard Gumbel noise on `device` (from `generator`, or torch's global one)."""
    uniform = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    return uniform.log_().neg_().log_().neg_()


def gumbel_argmax(scores: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`argmax(scores + noise)` over the last axis: with Gumbel `noise` of the same shape, an exact sample of
    `softmax(scores)` (`-inf` scores are never picked). scores: `(..., V)` float; returns `(...,)` int64."""
    return (scores.double() + noise).argmax(dim=-1)


class StepSampler:
    """Picks a decode step's real tokens and speculated tokens, keeping the coupling noise between steps.

    Args:
        do_sample: sample (else greedy).
        coupled: with `do_sample`, share each real token's Gumbel noise with the speculated token drawn one step
            earlier (`DualDecoderConfig.coupled_sampling`); False samples with `torch.multinomial` as transformers'
            `_sample` does (and guesses with the argmax of the speculated slot's scores, as under greedy decoding).
        generator: the random generator (None: torch's global one).
    """

    def __init__(self, do_sample: bool, coupled: bool = True, generator: torch.Generator | None = None) -> None:
        self.do_sample = do_sample
        self.coupled = do_sample and coupled
        self.generator = generator
        self._noise: torch.Tensor | None = None  # (B, V) float64: the noise of the next real token

    def real(self, scores: torch.Tensor) -> torch.Tensor:
        """The real next token per sequence from `(B, V)` processed scores: `(B,)` int64 on their device."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        if not self.coupled:
            probs = torch.softmax(scores, dim=-1)
            return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
        noise = self._noise
        if noise is None or noise.shape != scores.shape:  # the first step: nothing was drawn for it yet
            noise = gumbel_noise(tuple(scores.shape), scores.device, self.generator)
        self._noise = None
        return gumbel_argmax(scores, noise)

    def speculated(self, scores: torch.Tensor) -> torch.Tensor:
        """The model's guess for the token after the speculated one, from the speculated slot's `(B, V)` processed
        scores: their argmax, or under coupled sampling a Gumbel-max sample with the next real token's noise (drawn
        here). Returns `(B,)` int64 on their device."""
        if not self.coupled:
            return scores.argmax(dim=-1)
        self._noise = gumbel_noise(tuple(scores.shape), scores.device, self.generator)
        return gumbel_argmax(scores, self._noise)
