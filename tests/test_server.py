"""The OpenAI-compatible server, through a real HTTP client against uvicorn on 127.0.0.1 (embedded model):
completions and chat, streamed and not, 4xx errors, 50 concurrent clients with 10 disconnecting mid-stream."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
from conftest import uvicorn_server

from dual_cache.serving import Scheduler
from dual_cache.serving.server import create_app

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(embedded):
    model, tokenizer = embedded
    before = {t.name for t in threading.enumerate()}
    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 64, "window": 16}, max_batch=8)
    with uvicorn_server(create_app(scheduler, tokenizer, MODEL)) as port:
        yield port, scheduler
    assert scheduler.metrics()["running_requests"] == 0
    leftover = {t.name for t in threading.enumerate()} - before
    assert not {n for n in leftover if n.startswith("dual-")}, leftover


def _post(port: int, path: str, body, timeout: float = 120):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return response, connection


def _json(port: int, path: str, body):
    response, connection = _post(port, path, body)
    try:
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _events(response) -> list:
    """The data fields of a server-sent event stream, `[DONE]` included."""
    out = []
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            out.append(line[6:])
    return out


def test_health_models_and_metrics(server):
    port, _ = server
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    for path in ("/health", "/v1/models", "/metrics"):
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read().decode()
        assert response.status == 200, (path, body)
        if path == "/v1/models":
            assert json.loads(body)["data"][0]["id"] == MODEL
        if path == "/metrics":
            assert "# TYPE dual_requests_running gauge" in body and "dual_host_bytes" in body
    connection.close()


def test_completion_and_chat_plain_and_streamed_agree(server):
    port, _ = server
    status, plain = _json(port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6,
                                                     "temperature": 0})
    assert status == 200 and plain["object"] == "text_completion"
    assert plain["usage"]["completion_tokens"] == 6 and plain["choices"][0]["finish_reason"] == "length"
    response, connection = _post(port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6,
                                                           "temperature": 0, "stream": True})
    events = _events(response)
    connection.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    status, chat = _json(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0})
    assert status == 200 and chat["object"] == "chat.completion"
    answer = chat["choices"][0]["message"]["content"]
    assert "Paris" in answer
    response, connection = _post(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 12,
                                                                "temperature": 0, "stream": True})
    events = _events(response)
    connection.close()
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == answer
    # a stop string ends the text before it
    status, cut = _json(port, "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0,
                                                       "stop": ["Paris"]})
    assert status == 200 and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == answer[:answer.index("Paris")]


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", b"{not json", "not valid JSON"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "word " * 9000, "max_tokens": 4}, "positions"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "role"),
])
def test_bad_requests_get_a_400_that_says_what_to_change(server, path, body, needle):
    port, scheduler = server
    before = scheduler.metrics()["requests"]
    status, error = _json(port, path, body)
    assert status == 400 and needle in error["error"]["message"] + str(error["error"]["param"])
    assert scheduler.metrics()["requests"] == before  # refused before any work


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens", "lower max_tokens to at most"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
     "max_completion_tokens", "lower max_tokens to at most"),
    ("/v1/completions", {"prompt": "word " * 9000, "max_tokens": 4}, "prompt", "shorten it to at most 8191 tokens"),
])
def test_a_request_past_the_positions_names_the_field_to_change(server, path, body, param, needle):
    port, _ = server
    status, error = _json(port, path, body)
    assert status == 400 and error["error"]["param"] == param and needle in error["error"]["message"]
    assert "(1 tokens)" not in error["error"]["message"]


def test_fifty_concurrent_clients_ten_disconnecting_mid_stream(server):
    port, scheduler = server
    results: dict[int, object] = {}

    def client(i: int) -> None:
        body = {"prompt": f"Count to ten, number {i}:", "max_tokens": 40 if i < 10 else 6, "temperature": 0,
                "stream": True}
        try:
            response, connection = _post(port, "/v1/completions", body)
            if i < 10:  # read one event, then drop the connection
                while not response.readline().startswith(b"data: "):
                    pass
                connection.sock.shutdown(socket.SHUT_RDWR)
                connection.close()
                results[i] = "dropped"
                return
            events = _events(response)
            connection.close()
            results[i] = events
        except Exception as error:  # noqa: BLE001 - recorded for the assertion
            results[i] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    for i in range(10, 50):
        events = results[i]
        assert isinstance(events, list) and events[-1] == "[DONE]", (i, events)
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")
    assert scheduler.wait_idle(120)
    metrics = scheduler.metrics()
    print("cancelled", metrics["cancelled"])
    assert metrics["cancelled"] >= 5  # the dropped clients' requests stopped early (none of the others)
    assert metrics["running_requests"] == 0 and metrics["queued_requests"] == 0
    assert metrics["device_bytes"] == 0 and metrics["host_bytes"] == 0


def test_a_non_streaming_client_that_disconnects_is_cancelled(server):
    """Tokens arrive faster than the handler's poll interval; the disconnect is still noticed."""
    port, scheduler = server
    assert scheduler.wait_idle(120)
    before = scheduler.metrics()
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0})
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    time.sleep(1.0)
    sock.close()
    assert scheduler.wait_idle(120)
    after = scheduler.metrics()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["output_tokens"] - before["output_tokens"] < 300


def test_prometheus_text_writes_nan_as_prometheus_reads_it():
    from dual_cache.serving.prometheus import PROMETHEUS, prometheus_text

    values = {key: 1.0 for key, _, _ in PROMETHEUS.values()}
    values["spec_hit_rate"] = float("nan")
    lines = prometheus_text(values).splitlines()
    assert "dual_speculation_hit_rate NaN" in lines and "dual_requests_running 1.0" in lines


def test_requests_cut_short_by_a_stop_are_503_not_finished_answers(embedded):
    """A stopped scheduler cancels running and queued requests: the clients get the OpenAI error object (503), a
    stream an error event, never `finish_reason: "stop"` on a cut answer."""
    model, tokenizer = embedded
    scheduler = Scheduler(model, tokenizer, cache_config={"budget": 64, "window": 16}, max_batch=1)
    long = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0}
    answers = {}
    with uvicorn_server(create_app(scheduler, tokenizer, MODEL)) as port:
        def ask(name, body):
            if body.get("stream"):
                response, connection = _post(port, "/v1/completions", body)
                answers[name] = (response.status, _events(response))
                connection.close()
            else:
                answers[name] = _json(port, "/v1/completions", body)

        clients = [threading.Thread(target=ask, args=("running", long)),
                   threading.Thread(target=ask, args=("stream", {**long, "stream": True})),
                   threading.Thread(target=ask, args=("queued", long))]
        for client in clients:
            client.start()
            time.sleep(0.3)
        deadline = time.monotonic() + 60
        while not scheduler.metrics()["running_requests"] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # a few decode steps of the running request
        scheduler.cancel_all()
        for client in clients:
            client.join(120)
    scheduler.stop()
    for name in ("running", "queued"):
        status, body = answers[name]
        assert status == 503 and "stopped before this request finished" in body["error"]["message"], (name, body)
    status, events = answers["stream"]
    assert status == 200 and events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["type"] == "server_error" and "stopped before" in last["error"]["message"], last
    assert all('"finish_reason": "stop"' not in e for e in events), events
