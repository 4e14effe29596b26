"""The OpenAI request bodies the server takes (`/v1/completions`, `/v1/chat/completions`), validated strictly before
any work: a boolean is not an integer, a string is not a number, an empty prompt is refused, and a field the server
does not implement is refused with a 400 naming it. Two kinds of fields are accepted without being used, on purpose
(docs/serving.md lists them): `ACCEPTED_UNUSED`, and `NO_OP_VALUES` at the value that asks for nothing.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from .logprobs import MAX_TOP
from .requests import GenerationOptions

ACCEPTED_UNUSED = {  # field: why it is accepted and not used
    "model": "a server serves one model; responses carry the id /v1/models lists",
    "user": "an end-user id for the caller's own records",
}
NO_OP_VALUES = {  # fields accepted only at the value that changes nothing (null too)
    "frequency_penalty": 0, "presence_penalty": 0, "best_of": 1, "logit_bias": {}, "suffix": "",
}


def _refuse(message: str, param: str | None) -> PydanticCustomError:
    """A validation error whose message is `message` and whose OpenAI `param` is `param`."""
    return PydanticCustomError("invalid_request", message, {"param": param})


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a last chunk with the usage and no choices."""

    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Body(BaseModel):
    """Fields both endpoints take (OpenAI's meaning; `session` is this server's extension)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    user: str | None = None
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    session: str | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _refuse("The request body must be a JSON object.", None)
        unknown = [k for k in data if k not in cls.model_fields
                   and not (k in NO_OP_VALUES and not isinstance(data[k], bool)
                            and data[k] in (None, NO_OP_VALUES[k]))]
        if unknown:
            names = [f"{k} (accepted only as {json.dumps(NO_OP_VALUES[k])})" if k in NO_OP_VALUES else k
                     for k in unknown]
            raise _refuse(f"Unsupported field(s) {', '.join(names)}: this server does not implement them "
                          "(docs/serving.md lists the fields it takes).", unknown[0])
        return {k: v for k, v in data.items() if k not in NO_OP_VALUES}

    @model_validator(mode="after")
    def _stream_options(self) -> "_Body":
        if self.stream_options is not None and not self.stream:
            raise _refuse("stream_options is only allowed with stream: true.", "stream_options")
        try:  # the scheduler's own checks (seed range, stop strings, ...), before any work
            self.options()
        except ValueError as error:
            raise _refuse(str(error), str(error).split(" ", 1)[0]) from None
        return self

    def options(self) -> GenerationOptions:
        """The scheduler's `GenerationOptions` of each prompt of this request."""
        raise NotImplementedError

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionBody(_Body):
    """`/v1/completions`. `prompt`: a string, a list of strings, a list of token ids or a list of token-id lists
    (one choice per prompt); `echo` returns the prompt before the completion (with its tokens' logprobs when
    `logprobs` is set); `max_tokens: 0` with `echo` scores a prompt without generating."""

    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)
    echo: bool = False

    @model_validator(mode="after")
    def _completion(self) -> "CompletionBody":
        self.prompt = _prompt_list(self.prompt)
        if self.max_tokens == 0 and not self.echo:
            raise _refuse("max_tokens 0 generates nothing: it needs echo: true (to score the prompt alone).",
                          "max_tokens")
        if self.stream and (self.echo or self.logprobs is not None):
            raise _refuse("echo and logprobs are not available with stream: true; send the request without "
                          "streaming.", "echo" if self.echo else "logprobs")
        if self.session is not None and self.echo and self.logprobs is not None:
            raise _refuse("A session request cannot return its prompt's logprobs (echo with logprobs): the "
                          "session's stored tokens are not prefilled again.", "session")
        return self

    def options(self) -> GenerationOptions:
        """The scheduler's options of each prompt (max_tokens 0 runs one token that is not returned)."""
        return GenerationOptions(max_tokens=max(1, 16 if self.max_tokens is None else self.max_tokens),
                                 temperature=self.temperature, top_p=self.top_p, stop=self.stops(), seed=self.seed,
                                 logprobs=self.logprobs,
                                 prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else None)

    @property
    def returned_tokens(self) -> int:
        """Generated tokens a choice returns at most (0 with max_tokens 0)."""
        return 16 if self.max_tokens is None else self.max_tokens


class TextPart(BaseModel):
    """A text part of a message's content (`{"type": "text", "text": ...}`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """A chat message: its role and its content (a string, or a list of text parts, joined)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatBody(_Body):
    """`/v1/chat/completions`: `messages` rendered with the tokenizer's chat template; `logprobs` (bool) and
    `top_logprobs` (alternatives per token) return each generated token's logprob."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP)

    @model_validator(mode="after")
    def _chat(self) -> "ChatBody":
        if self.top_logprobs is not None and not self.logprobs:
            raise _refuse("top_logprobs needs logprobs: true.", "top_logprobs")
        if self.stream and self.logprobs:
            raise _refuse("logprobs are not available with stream: true; send the request without streaming.",
                          "logprobs")
        return self

    def options(self) -> GenerationOptions:
        return GenerationOptions(max_tokens=self.max_completion_tokens or self.max_tokens or 16,
                                 temperature=self.temperature, top_p=self.top_p, stop=self.stops(), seed=self.seed,
                                 logprobs=(self.top_logprobs or 0) if self.logprobs else None)


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request, each a non-empty string or a non-empty list of token ids."""
    def ids(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str) or ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                  or all(ids(p) for p in prompt)):
        prompts = prompt
    else:
        raise _refuse("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists.",
                      "prompt")
    for i, one in enumerate(prompts):
        if not one:
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise _refuse(f"{where} is empty: give at least one token of text (or one token id) to continue.",
                          "prompt")
    return prompts
