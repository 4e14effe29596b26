"""Log-probabilities of tokens under the model's distribution, as the server returns them (`logprobs`, `echo`).

A token's log-probability is `log_softmax` of the model's raw logits at the position before it (float32; before
any temperature or top-p, so it does not depend on how the request samples), with the `top` most likely tokens at
that position beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP = 20  # alternatives per token at most (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely tokens at its position.

    Attributes:
        token: the token id. logprob: its natural-log probability (<= 0).
        top: `(token id, logprob)` of the most likely tokens at its position, most likely first (as many as asked).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """The log-probability of each of `tokens` under the logits of the position before it.

    Args:
        logits: `(N, V)` raw logits (any float dtype, any device); row `i` is the distribution `tokens[i]` was
            drawn from.
        tokens: `(N,)` int64 token ids in `[0, V)`.
        top: most likely tokens to report per position, in `[0, MAX_TOP]`.

    Returns:
        N `TokenLogprob`s, in order.

    Raises:
        ValueError: mismatched shapes, or `top` out of range.
    """
    if logits.dim() != 2 or tokens.dim() != 1 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(f"token_logprobs needs (N, V) logits and (N,) tokens, got {tuple(logits.shape)} and "
                         f"{tuple(tokens.shape)}.")
    if not 0 <= top <= MAX_TOP:
        raise ValueError(f"top must be in [0, {MAX_TOP}], got {top}.")
    if not tokens.numel():
        return []
    logprobs = torch.log_softmax(logits.to("cpu", torch.float32), dim=-1)
    chosen = logprobs.gather(1, tokens.to("cpu", torch.long)[:, None])[:, 0].tolist()
    if top:
        values, indices = logprobs.topk(min(top, logprobs.shape[1]), dim=-1)
        best = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        best = [()] * len(chosen)
    return [TokenLogprob(int(t), lp, b) for t, lp, b in zip(tokens.tolist(), chosen, best)]
