"""OpenAI-compatible HTTP server over the scheduler (FastAPI + uvicorn, the stack `transformers serve` uses).

    dual-decoder serve --model smollm2-135m --port 8000 --cache-config '{"budget": 256}'

Routes: `POST /v1/completions` (every OpenAI prompt form: a string, a list of strings, token ids, a list of token-id
lists; one choice per prompt), `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus text). `logprobs` returns each generated token's log-probability with its most likely alternatives;
`echo` returns the prompt before the completion, with its tokens' log-probabilities from the prefill (exact);
`max_tokens: 0` with `echo` scores a prompt alone. `stream: true` sends server-sent events ending `data: [DONE]`
(`stream_options.include_usage` adds a usage chunk); the extra field `session` names a conversation whose cache
idles in host memory between requests. Request bodies are validated strictly before any work (`protocol.py`); every
error, 404 / 405 / 422 / 500 included, is OpenAI's `{"error": {"message", "type", "param", "code"}}`. A client that
disconnects cancels its requests; the scheduler stops with the server (SIGINT / SIGTERM via uvicorn).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from ..runtime.extras import require

require("serve", "dual_cache.serving.server (`dual-decoder serve`)")

import torch  # noqa: E402 - after the check that names the extra
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from starlette.exceptions import HTTPException  # noqa: E402

from .openai_format import chat_logprobs, completion_logprobs, error_body, usage  # noqa: E402
from .prometheus import prometheus_text  # noqa: E402
from .protocol import ChatBody, CompletionBody  # noqa: E402
from .requests import RequestHandle  # noqa: E402
from .scheduler import Scheduler  # noqa: E402
from .text_stream import TextStream  # noqa: E402

logger = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting handler checks that its client is still connected


@dataclass
class Prompt:
    """One prompt of a request: its token ids `(P,)` int64 and, when it was given as text, that text (echoed)."""

    ids: torch.Tensor
    text: str | None = None


CANCELLED = ("The server stopped before this request finished (SIGINT / SIGTERM, or its scheduler was stopped); "
             "what it generated was discarded. Send it again.")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_body(status, message, param))


def _validation_message(error: dict) -> tuple[str, str | None]:
    """`(message, param)` of pydantic's first error, in words a client understands."""
    if error.get("type") == "json_invalid":
        return f"The request body is not valid JSON ({error.get('ctx', {}).get('error', 'parse error')}).", None
    ctx = error.get("ctx") or {}
    where = ".".join(str(p) for p in error.get("loc", ())[1:]) or None
    if "param" in ctx:  # protocol.py's own refusals carry the field they name
        return error.get("msg", "invalid request"), ctx["param"]
    if isinstance(error.get("input"), bool) and error.get("type") in ("int_type", "float_type"):
        kind = "an integer" if error["type"] == "int_type" else "a number"
        return f"{where}: expected {kind}, got a boolean ({json.dumps(error['input'])}).", where
    if error.get("type") == "extra_forbidden":
        return f"Unsupported field {where}: this server does not implement it (docs/serving.md).", where
    return f"{where + ': ' if where else ''}{error.get('msg', 'invalid request')}", where


def _guarded(route):
    """A route whose unexpected exceptions become a 500 error object (logged), answered on the route's own
    connection: Starlette's handler for `Exception` answers too but then re-raises, and the server drops the
    connection a client may be reusing."""
    @functools.wraps(route)
    async def guarded(*args, **kwargs):
        try:
            return await route(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a bug; the client gets JSON and the log the traceback
            logger.exception("request failed")
            return _error(500, f"Internal error: {type(error).__name__}: {error}")
    return guarded


def create_app(scheduler: Scheduler, tokenizer, model_name: str) -> FastAPI:
    """The FastAPI app serving `scheduler` (its lifespan stops the scheduler).

    Args:
        scheduler: a running `Scheduler`; tokenizer: the model's (prompts, chat template, detokenization);
        model_name: the id `/v1/models` lists and responses carry.
    """
    vocab = scheduler.model.config.get_text_config(decoder=True).vocab_size

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        scheduler.stop()

    app = FastAPI(title="dual-cache", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(error.errors()[0] if error.errors() else {})
        return _error(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, error: HTTPException) -> JSONResponse:  # 404, 405, ...
        return JSONResponse(status_code=error.status_code, headers=getattr(error, "headers", None),
                            content=error_body(error.status_code, f"{request.method} {request.url.path}: "
                                                                  f"{error.detail}"))

    @app.exception_handler(Exception)
    async def _failed(request: Request, error: Exception) -> JSONResponse:  # outside the routes (see _guarded)
        return _error(500, f"Internal error: {type(error).__name__}: {error}")

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
    @_guarded
    async def completions(body: CompletionBody, request: Request):
        prompts = []
        for i, prompt in enumerate(body.prompt):
            where = "prompt" if len(body.prompt) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
                if not ids.numel():
                    return _error(400, f"{where} has no tokens: give text the tokenizer encodes.", "prompt")
                prompts.append(Prompt(ids, prompt))
            else:
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    return _error(400, f"{where}: token ids must be in [0, {vocab}), got {bad[:5]}.", "prompt")
                prompts.append(Prompt(torch.tensor(prompt, dtype=torch.long)))
        return await _serve(request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    @_guarded
    async def chat(body: ChatBody, request: Request):
        if not getattr(tokenizer, "chat_template", None):
            return _error(400, f"{model_name} has no chat template: send a prompt to /v1/completions instead.",
                          "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"][0]
        return await _serve(request, body, [Prompt(ids)], chat=True)

    async def _serve(request: Request, body: CompletionBody | ChatBody, prompts: list[Prompt], chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def listener(index: int):
            def on_event(event: tuple) -> None:
                try:
                    loop.call_soon_threadsafe(events.put_nowait, (index, event))
                except RuntimeError:  # the event loop closed (shutdown)
                    pass
            return on_event

        options = body.options()
        handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                handles.append(scheduler.add_request(prompt.ids, options, session=body.session,
                                                     on_event=listener(i)))
        except (ValueError, RuntimeError) as error:
            for handle in handles:
                scheduler.cancel(handle)
            return _error(400 if isinstance(error, ValueError) else 503, str(error), _param(error, body))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{handles[0].id}"
        created = int(time.time())
        if body.stream:
            return StreamingResponse(_sse(request, body, handles, events, rid, created, chat),
                                     media_type="text/event-stream")
        try:
            check_at = loop.time() + POLL_S
            while not all(h.done for h in handles) or not events.empty():
                try:
                    await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    pass
                if loop.time() >= check_at:  # also while tokens keep coming (a step is shorter than POLL_S)
                    check_at = loop.time() + POLL_S
                    if await request.is_disconnected():
                        return _error(499, "client disconnected")
        finally:
            for handle in handles:
                if not handle.done:
                    scheduler.cancel(handle)
        failed = next((h for h in handles if h.finish_reason == "error"), None)
        if failed is not None:
            return _error(500, failed.error or "generation failed")
        if any(h.finish_reason == "cancelled" for h in handles):  # the server stopped: never a cut answer as "stop"
            return _error(503, CANCELLED)
        choices = [_choice(body, i, handle, prompt, chat) for i, (handle, prompt) in enumerate(zip(handles, prompts))]
        returned = sum(len(_returned(body, h)) for h in handles)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": choices,
                "usage": usage(sum(int(h.prompt.numel()) for h in handles), returned)}

    def _choice(body, index: int, handle: RequestHandle, prompt: Prompt, chat: bool) -> dict[str, Any]:
        tokens = _returned(body, handle)
        text = TextStream(tokenizer, handle.options.stop).text(tokens)
        reason = "length" if not chat and body.max_tokens == 0 else _reason(handle)
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": chat_logprobs(tokenizer, handle.token_logprobs[:len(tokens)], body.top_logprobs or 0)
                    if body.logprobs else None}
        echoed = prompt.text if prompt.text is not None else tokenizer.decode(prompt.ids)
        logprobs = None
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, prompt.ids.tolist() if body.echo else None,
                                           handle.prompt_logprobs, handle.token_logprobs[:len(tokens)])
        return {"index": index, "text": (echoed if body.echo else "") + text, "logprobs": logprobs,
                "finish_reason": reason}

    async def _sse(request, body, handles: list[RequestHandle], events, rid, created, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        streams = [TextStream(tokenizer, h.options.stop) for h in handles]

        def chunk(index: int, delta: str | None, reason: str | None, first: bool = False) -> str:
            if chat:
                piece = {"role": "assistant", "content": ""} if first else ({} if delta is None else
                                                                            {"content": delta})
                choice = {"index": index, "delta": piece, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": index, "text": delta or "", "finish_reason": reason, "logprobs": None}
            data = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice]}
            if include_usage:
                data["usage"] = None
            return "data: " + json.dumps(data) + "\n\n"

        try:
            if chat:
                yield chunk(0, None, None, first=True)
            open_ = set(range(len(handles)))
            while open_:
                try:
                    index, (event, _) = await asyncio.wait_for(events.get(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return
                    continue
                handle = handles[index]
                if event == "token":
                    piece = streams[index].delta(handle.token_ids, final=False)
                    if piece:
                        yield chunk(index, piece, None)
                    continue
                if handle.finish_reason in ("error", "cancelled"):
                    failure = error_body(500, handle.error or "generation failed") if handle.finish_reason == "error" \
                        else error_body(503, CANCELLED)
                    yield "data: " + json.dumps(failure) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
                piece = streams[index].delta(handle.token_ids, final=True)
                if piece:
                    yield chunk(index, piece, None)
                yield chunk(index, None, _reason(handle))
                open_.discard(index)
            if include_usage:
                total = usage(sum(int(h.prompt.numel()) for h in handles), sum(len(h.token_ids) for h in handles))
                yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": model_name,
                                             "choices": [], "usage": total}) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or the stream ended): free its rows
            for handle in handles:
                if not handle.done:
                    scheduler.cancel(handle)

    return app


def run_http(scheduler, tokenizer, model_name: str, host: str, port: int, on_server=None) -> None:
    """Serve `scheduler` over HTTP with uvicorn until SIGINT / SIGTERM (or `server.should_exit`).

    Args:
        on_server: called with the `uvicorn.Server` before it starts (to stop it from another thread).
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # SIGINT / SIGTERM: running requests end after their step,
            scheduler.cancel_all()  # so their connections close and uvicorn's graceful shutdown does not wait
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(create_app(scheduler, tokenizer, model_name), host=host, port=port,
                                   log_level="info"))
    if on_server is not None:
        on_server(server)
    server.run()


def _param(error: Exception, body) -> str | None:
    """The request field a refused request should change (`admission.RequestError.param`), as the client named it:
    a chat request that gave `max_completion_tokens` gets that name for "max_tokens"."""
    param = getattr(error, "param", None)
    if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    return param


def _returned(body, handle: RequestHandle) -> list[int]:
    """The generated tokens a choice returns (none for a completion with max_tokens 0: its one token is dropped)."""
    limit = body.max_tokens if isinstance(body, CompletionBody) and body.max_tokens is not None else None
    return handle.token_ids if limit is None else handle.token_ids[:limit]


def _reason(handle: RequestHandle) -> str:
    return "length" if handle.finish_reason == "length" else "stop"
