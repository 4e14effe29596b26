"""The server as evaluation harnesses use it (httpx, and the openai client), against uvicorn on 127.0.0.1 with the
embedded model: every prompt form of /v1/completions, logprobs and echo (the prompt's, exact: equal to the model's
own log-softmax), max_tokens 0 with echo, chat logprobs, the exact requests lm-evaluation-harness sends, every error
in OpenAI's shape, strict types, unimplemented fields refused, stream_options.include_usage."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch
from conftest import uvicorn_server
from fastapi import HTTPException

from dual_cache.serving import GenerationOptions, Scheduler
from dual_cache.serving.server import create_app

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(embedded):
    model, tokenizer = embedded
    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 64, "window": 16}, max_batch=8, prefix_block=32)
    app = create_app(scheduler, tokenizer, MODEL)

    @app.get("/test-only/unprocessable")
    async def unprocessable():  # the error handler's shape for any HTTP error a route raises
        raise HTTPException(422, "cannot process this")

    with uvicorn_server(app) as port:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            yield http, scheduler


def _model_logprobs(model, ids: list[int]) -> list[float]:
    """log P(ids[i] | ids[:i]) for i >= 1, from one dense forward of the model (the reference)."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _lm_eval_loglikelihood(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's parse of a loglikelihood response (LocalCompletionsAPI.parse_logprobs)."""
    out = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        values = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        out.append((sum(values), all(v == max(t.values()) for v, t in zip(values, tops))))
    return out


def test_every_prompt_form_gets_one_choice_per_prompt(client, embedded):
    http, _ = client
    _, tokenizer = embedded
    texts = ["The capital of France is", "One, two, three,"]
    ids = [tokenizer(t).input_ids for t in texts]
    base = {"max_tokens": 4, "temperature": 0}
    answers = {}
    for name, prompt in {"string": texts[0], "strings": texts, "ids": ids[0], "id lists": ids}.items():
        response = http.post("/v1/completions", json={**base, "prompt": prompt})
        assert response.status_code == 200, response.text
        body = response.json()
        answers[name] = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
        assert [c["index"] for c in body["choices"]] == list(range(len(answers[name])))
        assert body["usage"]["prompt_tokens"] == sum(len(i) for i in (ids if isinstance(prompt[0], (str, list))
                                                                        and len(prompt) == 2 else ids[:1]))
    assert answers["string"] == answers["ids"] == answers["strings"][:1] == answers["id lists"][:1]
    assert answers["strings"] == answers["id lists"]


def test_lm_eval_loglikelihood_requests_get_the_models_exact_logprobs(client, embedded):
    """lm-eval's loglikelihood payload, tokenized and batched: {"prompt": [[ids], ...], "max_tokens": 1,
    "logprobs": 1, "echo": true, ...}; the prompt's logprobs come from the prefill (300 tokens: two chunks)."""
    http, _ = client
    model, tokenizer = embedded
    context = tokenizer("Question: what is the capital of France?" + " Think about it." * 70 + "\nAnswer:").input_ids
    continuations = [tokenizer(" Paris").input_ids, tokenizer(" a small village").input_ids]
    prompts = [context + c for c in continuations]
    assert len(prompts[0]) > 256  # more than one prompt-logits chunk (rows.PROMPT_LOGITS_CHUNK)
    payload = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    response = http.post("/v1/completions", json=payload)
    assert response.status_code == 200, response.text
    body = response.json()
    for choice, ids in zip(body["choices"], prompts):
        logprobs = choice["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None and len(logprobs["text_offset"]) == len(ids) + 1
        reference = _model_logprobs(model, ids)
        assert max(abs(a - b) for a, b in zip(logprobs["token_logprobs"][1:len(ids)], reference)) < 1e-3
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    ctxlens = [len(context)] * 2
    (paris, paris_greedy), (village, _) = _lm_eval_loglikelihood(body, ctxlens)
    expected = [sum(_model_logprobs(model, ids)[len(context) - 1:]) for ids in prompts]
    assert math.isclose(paris, expected[0], abs_tol=1e-3) and math.isclose(village, expected[1], abs_tol=1e-3)
    assert paris > village


def test_echo_with_max_tokens_zero_scores_the_prompt_alone(client, embedded):
    http, _ = client
    model, tokenizer = embedded
    prompt = "The quick brown fox jumps over the lazy dog."
    body = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                              "logprobs": 0}).json()
    choice = body["choices"][0]
    ids = tokenizer(prompt).input_ids
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    values = choice["logprobs"]["token_logprobs"]
    assert len(values) == len(ids) and values[0] is None
    assert max(abs(a - b) for a, b in zip(values[1:], _model_logprobs(model, ids))) < 1e-3
    # echo without logprobs: the prompt's text, no logprobs
    plain = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True,
                                               "temperature": 0}).json()["choices"][0]
    assert plain["text"].startswith(prompt) and plain["logprobs"] is None


def test_generated_tokens_logprobs_and_their_alternatives(client, embedded):
    http, _ = client
    body = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                              "temperature": 0, "logprobs": 2}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 3 == body["usage"]["completion_tokens"]
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]
    for value, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert value <= 0 and value == max(top.values()) and len(top) == 2  # greedy: the chosen is the likeliest
    assert logprobs["text_offset"] == [0, len(logprobs["tokens"][0]), len("".join(logprobs["tokens"][:2]))]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "temperature": 0,
                                                   "logprobs": True, "top_logprobs": 2}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] == 3
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] == c["top_logprobs"][0]["logprob"] for c in content)
    assert bytes(content[0]["bytes"]).decode() == content[0]["token"]


def test_lm_eval_generate_until_requests_through_both_endpoints(client, embedded):
    http, _ = client
    _, tokenizer = embedded
    # LocalCompletionsAPI, tokenized_requests=True, batch_size 2: token-id lists, `until` + eos as stop
    stop = ["\n\n", "Question:", "<|im_end|>"]
    completion = http.post("/v1/completions", json={
        "prompt": [tokenizer("Question: 2 + 2 = ?\nAnswer:").input_ids, tokenizer("Question: Capital of Italy?\n"
                                                                                  "Answer:").input_ids],
        "model": MODEL, "max_tokens": 8, "temperature": 0, "stop": stop, "seed": 1234})
    assert completion.status_code == 200, completion.text
    assert sorted(c["index"] for c in completion.json()["choices"]) == [0, 1]
    # LocalChatCompletion with --apply_chat_template: messages, stop[:4]
    chat = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the capital of Italy?"}], "model": MODEL,
        "max_tokens": 8, "temperature": 0, "stop": stop[:4], "seed": 1234})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["index"] == 0 and chat.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("method, path, status", [("GET", "/nowhere", 404), ("GET", "/v1/completions", 405),
                                                  ("GET", "/test-only/unprocessable", 422)])
def test_http_errors_are_openai_error_objects(client, method, path, status):
    http, _ = client
    response = http.request(method, path)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert path in error["message"]


def test_an_internal_failure_is_a_500_error_object(client, monkeypatch):
    http, scheduler = client

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(scheduler, "add_request", broken)
    response = http.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "KeyError" in error["message"]


@pytest.mark.parametrize("body, needle, param", [
    ({"prompt": "Hi", "max_tokens": True}, "boolean", "max_tokens"),
    ({"prompt": "Hi", "logprobs": True}, "boolean", "logprobs"),
    ({"prompt": "Hi", "seed": False}, "boolean", "seed"),
    ({"prompt": "Hi", "temperature": True}, "boolean", "temperature"),
    ({"prompt": "Hi", "n": True}, "boolean", "n"),
    ({"prompt": ""}, "prompt is empty", "prompt"),
    ({"prompt": []}, "prompt is empty", "prompt"),
    ({"prompt": ["a", ""]}, "prompt[1] is empty", "prompt"),
    ({"prompt": [[]]}, "prompt is empty", "prompt"),
    ({"prompt": [1, "a"]}, "prompt must be a string", "prompt"),
    ({"prompt": [[1, 10**9]]}, "token ids must be in", "prompt"),
    ({"prompt": "Hi", "max_tokens": 0}, "needs echo", "max_tokens"),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs", "logprobs"),
    ({"prompt": "Hi", "best_of": 3}, "best_of (accepted only as 1)", "best_of"),
    ({"prompt": "Hi", "logit_bias": {"5": 10}}, "logit_bias", "logit_bias"),
    ({"prompt": "Hi", "tools": []}, "Unsupported field(s) tools", "tools"),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, "only allowed with stream", "stream_options"),
    ({"prompt": "Hi", "stream": True, "echo": True}, "not available with stream", "echo"),
    ({"prompt": "Hi", "echo": True, "logprobs": 1, "session": "s"}, "session", "session"),
])
def test_bad_completion_requests_are_refused_before_any_work(client, body, needle, param):
    http, scheduler = client
    before = scheduler.metrics()["requests"]
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["param"] == param, error
    assert scheduler.metrics()["requests"] == before


@pytest.mark.parametrize("body, needle, param", [
    ({"top_logprobs": 2}, "needs logprobs", "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format"),
    ({"max_completion_tokens": True}, "boolean", "max_completion_tokens"),
    ({"logprobs": True, "stream": True}, "not available with stream", "logprobs"),
])
def test_bad_chat_requests_are_refused(client, body, needle, param):
    http, _ = client
    response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert needle in error["message"] and error["param"] == param, error


def test_fields_accepted_on_purpose(client):
    http, _ = client
    response = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "model": "anything",
                                                  "user": "me", "frequency_penalty": 0, "presence_penalty": 0.0,
                                                  "best_of": 1, "logit_bias": {}, "suffix": None})
    assert response.status_code == 200, response.text


def _sse(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_streams_honour_include_usage_and_interleave_prompts(client):
    http, _ = client
    body = {"prompt": ["One, two,", "Red, green,"], "max_tokens": 4, "temperature": 0}
    plain = http.post("/v1/completions", json=body).json()
    chunks = _sse(http, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert all(c["usage"] is None for c in chunks[:-1])
    for choice in plain["choices"]:
        parts = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"] and parts[-1]["finish_reason"] == "length"
    without = _sse(http, "/v1/completions", {**body, "stream": True})
    assert all("usage" not in c for c in without)
    chat = _sse(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                               "stream": True, "stream_options": {"include_usage": True}})
    assert chat[-1]["choices"] == [] and chat[-1]["usage"]["completion_tokens"] == 3


def test_the_openai_client(client):
    openai = pytest.importorskip("openai")
    http, _ = client
    api = openai.OpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused", max_retries=0)
    reply = api.completions.create(model=MODEL, prompt=["The capital of France is", "2 + 2 ="], max_tokens=2,
                                   temperature=0, logprobs=1, echo=True)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text.startswith("The capital of France is") and reply.choices[0].logprobs.tokens
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       temperature=0, logprobs=True, top_logprobs=1)
    assert len(chat.choices[0].logprobs.content) == 2
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert refused.value.body["param"] == "prompt"


def test_prompt_logprobs_are_exact_on_dense_rows_and_refused_with_a_session(embedded):
    model, tokenizer = embedded
    ids = tokenizer("A short prompt for the dense rows of the scheduler.").input_ids
    scheduler = Scheduler(model, tokenizer, dense=True, max_batch=2)
    try:
        handle = scheduler.add_request(ids, GenerationOptions(max_tokens=1, temperature=0, prompt_logprobs=0))
        assert handle.wait(120)
        values = [e.logprob for e in handle.prompt_logprobs]
        assert max(abs(a - b) for a, b in zip(values, _model_logprobs(model, ids))) < 1e-3
    finally:
        scheduler.stop()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        GenerationOptions(prompt_logprobs=True)
