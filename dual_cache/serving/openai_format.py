"""OpenAI response pieces built from finished requests: the legacy completion `logprobs` object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), the chat `logprobs.content` list, `usage`, and the error object."""

from __future__ import annotations

from typing import Sequence

from .logprobs import TokenLogprob


def token_text(tokenizer, token: int) -> str:
    """The text of one token as OpenAI lists it (the tokenizer's decoding of that token alone)."""
    return tokenizer.decode([token])


def _top(tokenizer, entry: TokenLogprob) -> dict[str, float]:
    """`{text: logprob}` of an entry's alternatives and of its own token (OpenAI always lists the chosen token), most
    likely first; two tokens with the same text keep the likelier one."""
    out: dict[str, float] = {}
    for token, logprob in (*entry.top, (entry.token, entry.logprob)):
        out.setdefault(token_text(tokenizer, token), logprob)
    return out


def completion_logprobs(tokenizer, prompt: Sequence[int] | None, prompt_entries: Sequence[TokenLogprob],
                        generated: Sequence[TokenLogprob], start: int = 0) -> dict:
    """The legacy completion `logprobs` object of one choice.

    Args:
        tokenizer: the model's (token texts). prompt: the prompt's token ids when echoed (its first token gets None
            for its logprob and alternatives: nothing precedes it), else None.
        prompt_entries: the prompt's tokens after the first (`RequestHandle.prompt_logprobs`), when echoed.
        generated: the returned generated tokens (`RequestHandle.token_logprobs`, cut to the returned count).
        start: the character offset of the first generated token when the prompt is not echoed.

    Returns:
        `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, one entry per echoed prompt token then per
        generated token; `text_offset` is each token's offset in the choice's text, summing the tokens' texts.
    """
    tokens, values, tops = [], [], []
    if prompt is not None:
        tokens.append(token_text(tokenizer, prompt[0]))
        values.append(None)
        tops.append(None)
    for entry in (*(prompt_entries if prompt is not None else ()), *generated):
        tokens.append(token_text(tokenizer, entry.token))
        values.append(entry.logprob)
        tops.append(_top(tokenizer, entry))
    offsets, at = [], 0 if prompt is not None else start
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, generated: Sequence[TokenLogprob], top: int) -> dict:
    """The chat `logprobs` object: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}`, one entry
    per generated token, each with its `top` most likely alternatives."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top[:top]]}
                        for e in generated]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's `usage` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 422: "unprocessable_entity", 499: "client_disconnected",
               503: "unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object: `{"error": {"message", "type", "param", "code"}}` (type `invalid_request_error` for
    4xx, `server_error` for 5xx)."""
    return {"error": {"message": message, "type": "invalid_request_error" if status < 500 else "server_error",
                      "param": param, "code": ERROR_CODES.get(status)}}
