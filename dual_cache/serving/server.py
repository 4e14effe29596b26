"""OpenAI-compatible HTTP server over the scheduler (FastAPI + uvicorn, the stack `transformers serve` uses).

    dual-decoder serve --model smollm2-135m --port 8000 --cache-config '{"budget": 256}'

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI's request and response shapes; `stream: true`
sends server-sent events ending `data: [DONE]`; the extra field `session` names a conversation whose cache idles in
host memory between requests), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). A bad request gets
a 400 JSON error in OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) before any work; a client
that disconnects cancels its request; the scheduler stops with the server (SIGINT / SIGTERM via uvicorn).
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .requests import GenerationOptions, RequestHandle
from .scheduler import Scheduler

POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields this server does not use

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    n: Literal[1] = 1
    session: str | None = Field(default=None, min_length=1)

    def options(self) -> GenerationOptions:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerationOptions(max_tokens=self.max_completion_tokens or self.max_tokens or 16,
                                 temperature=self.temperature, top_p=self.top_p, stop=tuple(stop), seed=self.seed)


class CompletionBody(_Body):
    prompt: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error"
                                                               if status < 500 else "server_error",
                                                               "param": param, "code": None}})


class TextStream:
    """Incremental detokenization of one request: the text that is safe to send after each token (no half
    UTF-8 character, nothing that could still become a stop string), and the final text cut before a stop."""

    def __init__(self, tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def text(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def delta(self, token_ids: list[int], final: bool) -> str:
        text = self.text(token_ids)
        end = len(text) if final else max(self.sent, len(text) - self.hold)
        if not final and text[self.sent:end].endswith("\ufffd"):
            end = self.sent
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece


def create_app(scheduler: Scheduler, tokenizer, model_name: str) -> FastAPI:
    """The FastAPI app serving `scheduler` (its lifespan stops the scheduler).

    Args:
        scheduler: a running `Scheduler`; tokenizer: the model's (prompts, chat template, detokenization);
        model_name: the id `/v1/models` lists and responses carry.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        scheduler.stop()

    app = FastAPI(title="dual-cache", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        if first.get("type") == "json_invalid":
            return _error(400, f"The request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}).")
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return _error(400, f"{where + ': ' if where else ''}{first.get('msg', 'invalid request')}", where)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": scheduler.started_at,
                                            "owned_by": "dual-cache"}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(scheduler.metrics()), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        ids = tokenizer(body.prompt, return_tensors="pt").input_ids[0]
        return await _serve(request, body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody, request: Request):
        if not getattr(tokenizer, "chat_template", None):
            return _error(400, f"{model_name} has no chat template: send a prompt to /v1/completions instead.",
                          "messages")
        messages = [m.model_dump() for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"][0]
        return await _serve(request, body, ids, chat=True)

    async def _serve(request: Request, body: _Body, ids, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(event: tuple) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop closed (shutdown)
                pass

        try:
            options = body.options()
            handle = scheduler.add_request(ids, options, session=body.session, on_event=on_event)
        except ValueError as error:
            return _error(400, str(error))
        except RuntimeError as error:
            return _error(503, str(error))
        stream = TextStream(tokenizer, options.stop)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{handle.id}"
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            return StreamingResponse(_sse(request, handle, events, stream, rid, created, kind, chat),
                                     media_type="text/event-stream")
        try:
            check_at = loop.time() + POLL_S
            while not handle.done or not events.empty():
                try:
                    await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    pass
                if loop.time() >= check_at:  # also while tokens keep coming (a step is shorter than POLL_S)
                    check_at = loop.time() + POLL_S
                    if await request.is_disconnected():
                        scheduler.cancel(handle)
                        return _error(499, "client disconnected")
        finally:
            if not handle.done:
                scheduler.cancel(handle)
        if handle.finish_reason == "error":
            return _error(500, handle.error or "generation failed")
        text = stream.text(handle.token_ids)
        choice: dict[str, Any] = {"index": 0, "finish_reason": _reason(handle)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice.update(text=text, logprobs=None)
        return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                "usage": _usage(handle)}

    async def _sse(request, handle: RequestHandle, events, stream: TextStream, rid, created, kind, chat):
        chunk_kind = kind + ".chunk" if chat else kind

        def chunk(delta: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                piece = {"role": "assistant", "content": ""} if first else ({} if delta is None else
                                                                            {"content": delta})
                choice = {"index": 0, "delta": piece, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            return "data: " + json.dumps({"id": rid, "object": chunk_kind, "created": created, "model": model_name,
                                          "choices": [choice]}) + "\n\n"

        try:
            if chat:
                yield chunk(None, None, first=True)
            while True:
                try:
                    kind_, _ = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                if kind_ == "token":
                    piece = stream.delta(handle.token_ids, final=False)
                    if piece:
                        yield chunk(piece, None)
                    continue
                if handle.finish_reason == "error":
                    yield "data: " + json.dumps({"error": {"message": handle.error, "type": "server_error"}}) + "\n\n"
                else:
                    piece = stream.delta(handle.token_ids, final=True)
                    if piece:
                        yield chunk(piece, None)
                    yield chunk(None, _reason(handle))
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away (or the stream ended): free its rows
            if not handle.done:
                scheduler.cancel(handle)

    return app


def _reason(handle: RequestHandle) -> str:
    return "length" if handle.finish_reason == "length" else "stop"


def _usage(handle: RequestHandle) -> dict:
    prompt, completion = int(handle.prompt.numel()), len(handle.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


PROMETHEUS = {  # metric: (scheduler.metrics() key, type, help)
    "dual_requests_running": ("running_requests", "gauge", "Requests decoding now"),
    "dual_requests_queued": ("queued_requests", "gauge", "Requests waiting for admission"),
    "dual_requests_total": ("requests", "counter", "Requests received"),
    "dual_requests_finished_total": ("finished", "counter", "Requests finished (any reason)"),
    "dual_requests_cancelled_total": ("cancelled", "counter", "Requests cancelled (client gone, or stopped)"),
    "dual_output_tokens_total": ("output_tokens", "counter", "Tokens generated by finished requests"),
    "dual_prefilled_tokens_total": ("prefilled_tokens", "counter", "Prompt tokens prefilled"),
    "dual_prefix_hit_tokens_total": ("prefix_hit_tokens", "counter",
                                     "Prompt tokens copied from the prefix cache instead of prefilled"),
    "dual_cached_prefixes": ("cached_prefixes", "gauge", "Prefixes held by the prefix cache"),
    "dual_decode_steps_total": ("decode_steps", "counter", "Decode steps of the running batch"),
    "dual_regroups_total": ("regroups", "counter", "Times rows joined or left the running batch"),
    "dual_tokens_per_second": ("tokens_per_second", "gauge", "Output tokens per second, recent window"),
    "dual_device_bytes": ("device_bytes", "gauge", "KV bytes on the compute device"),
    "dual_host_bytes": ("host_bytes", "gauge", "KV and index bytes in host memory"),
    "dual_sessions": ("sessions", "gauge", "Sessions known"),
    "dual_sessions_idle": ("idle_sessions", "gauge", "Sessions idle in host memory"),
    "dual_sessions_evicted_total": ("evicted_sessions", "counter", "Idle sessions evicted"),
    "dual_session_resumes_total": ("session_resumes", "counter", "Requests that continued a session's cache"),
    "dual_speculation_hit_rate": ("spec_hit_rate", "gauge", "Speculated tokens equal to the real ones"),
}


def prometheus_text(values: dict[str, float]) -> str:
    """Prometheus text exposition (format 0.0.4) of `Scheduler.metrics()`."""
    lines = []
    for name, (key, kind, text) in PROMETHEUS.items():
        value = float(values[key])
        shown = "NaN" if value != value else repr(value)
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {shown}"]
    return "\n".join(lines) + "\n"
