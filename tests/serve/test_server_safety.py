"""What a web page, a careless client or a hostile one can do to `stagewise serve`, over real HTTP: a body
that is not declared JSON (415), a Host name nobody allowed (403: DNS rebinding), the live view's data
without the --api-key (401, or the page's cookie), fields the server cannot honour (400 by name),
bodies no JSON API takes (400, never 500), too many stop strings (400), the openai client's
models.retrieve. One server (tiny model, an API key, small limits) for the module."""

import json
import socket
import time

import httpx
import openai
import pytest

from stagewise.engine.llm import LLM
from stagewise.serve.limits import ServerLimits
from stagewise.serve.view import ViewHub
from tests.serve.harness import running_server

KEY = "class-secret"
LIMITS = ServerLimits(max_stop_strings=3, max_stop_length=10, header_timeout_s=0.5, idle_timeout_s=0.5)


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(LLM(tiny), api_key=KEY, hub=ViewHub(limits=LIMITS), limits=LIMITS) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


AUTH = {"Authorization": f"Bearer {KEY}"}


def _post(server, body, content_type="application/json", path="/v1/completions", headers=None):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": content_type, **AUTH, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=30)


def _error(response, status: int, param=None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- what a web page may send ----


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""])
def test_a_body_not_declared_json_is_refused_415(server, content_type):
    """A cross-site form or fetch can send these without a CORS preflight: none may run a completion."""
    message = _error(_post(server, {"prompt": "hi", "max_tokens": 1}, content_type), 415)
    assert "Content-Type: application/json" in message


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/vnd.api+json"])
def test_json_content_types_are_taken(server, content_type):
    assert _post(server, {"prompt": "hi", "max_tokens": 1}, content_type).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"])
def test_a_host_name_nobody_allowed_is_refused_403(server, host):
    """DNS rebinding: evil.example resolved to 127.0.0.1 still says Host: evil.example."""
    for path in ("/v1/models", "/api/snapshot", "/health"):
        r = httpx.get(server.url + path, headers={"Host": host, **AUTH})
        assert "--allowed-hosts" in _error(r, 403, "Host")
    assert "--allowed-hosts" in _error(_post(server, {"prompt": "hi"}, headers={"Host": host}), 403, "Host")


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1:1", "10.1.2.3", "[::1]:8000"])
def test_ip_literals_and_localhost_are_answered(server, host):
    assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200


def test_allowed_hosts_opens_the_named_ones(tiny):
    limits = ServerLimits(allowed_hosts=("teacher.lan",))
    with running_server(LLM(tiny), limits=limits) as running:
        assert httpx.get(running.url + "/health", headers={"Host": "TEACHER.lan:8000"}).status_code == 200
        assert httpx.get(running.url + "/health", headers={"Host": "other.lan"}).status_code == 403
    with running_server(LLM(tiny), limits=ServerLimits(allowed_hosts=("*",))) as running:
        assert httpx.get(running.url + "/health", headers={"Host": "anything.example"}).status_code == 200


# ---- --api-key covers the live view's data ----


def test_the_view_data_needs_the_key_as_a_header_or_the_pages_cookie(server, client):
    client.completions.create(model="tiny", prompt="something private", max_tokens=2)
    for path in ("/api/snapshot", "/api/history", "/api/events"):
        assert _error(httpx.get(server.url + path), 401).startswith("this server has an API key")
        bad = httpx.get(server.url + path, cookies={"stagewise_api_key": "guess"})
        assert bad.status_code == 401
    assert httpx.get(server.url + "/api/history", headers=AUTH).status_code == 200
    with httpx.Client(base_url=server.url, cookies={"stagewise_api_key": KEY}) as browser:
        assert browser.get("/api/snapshot").json()["step"] >= 0
        assert browser.get("/api/history").json()
        with browser.stream("GET", "/api/events") as events:
            assert events.status_code == 200
        assert browser.get("/v1/models").status_code == 401  # the cookie opens the view only, never /v1
    page = httpx.get(server.url + "/")  # the page holds no data: it asks for the key
    assert page.status_code == 200 and 'id="key-form"' in page.text
    assert (
        httpx.get(server.url + "/health").status_code == 200 and httpx.get(server.url + "/metrics").status_code == 200
    )


# ---- fields refused by name ----


@pytest.mark.parametrize(
    "field, value, path",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}], "/v1/chat/completions"),
        ("tool_choice", "auto", "/v1/chat/completions"),
        ("functions", [{"name": "f"}], "/v1/chat/completions"),
        ("response_format", {"type": "json_object"}, "/v1/chat/completions"),
        ("suffix", " the end", "/v1/completions"),
        ("n", True, "/v1/completions"),
        ("n", 17, "/v1/completions"),
    ],
)
def test_fields_the_server_cannot_honour_are_refused_by_name(server, field, value, path):
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], field: value}
    assert _error(_post(server, body, path=path), 400, field)


def test_n_one_as_a_json_number_is_fine(server):
    assert _post(server, {"prompt": "hi", "max_tokens": 1, "n": 1.0}).status_code == 200


# ---- bodies no JSON API takes: 400, never 500 ----

MALFORMED = [
    ("100k-deep array", b"[" * 100_000 + b"]" * 100_000, None),
    ("100k-deep object", b'{"a":' * 100_000 + b"1" + b"}" * 100_000, None),
    ("5000-digit number", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("NaN", b'{"prompt": "hi", "temperature": NaN}', None),
    ("Infinity", b'{"prompt": "hi", "temperature": -Infinity}', None),
    ("lone surrogate in model", b'{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("lone surrogate in prompt", b'{"prompt": "a\\udfff"}', "prompt"),
    ("lone surrogate in stop", b'{"prompt": "hi", "stop": ["\\ud834"]}', "stop"),
    ("bytes that are not UTF-8", b'{"prompt": "\xff\xfe"}', None),
    ("huge max_tokens", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}", "max_tokens"),
    ("huge seed", b'{"prompt": "hi", "seed": 1' + b"0" * 400 + b"}", "seed"),
    ("1e400 temperature", b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
]


@pytest.mark.parametrize("body, param", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_bodies_get_400_naming_what_is_wrong(server, body, param):
    message = _error(_post(server, body), 400, param)
    assert message.isascii() and "internal error" not in message


def test_a_lone_surrogate_in_a_chat_message_is_400(server):
    body = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'
    assert _error(_post(server, body, path="/v1/chat/completions"), 400, "messages[0].content")


# ---- stop strings: a bounded cost ----


def test_too_many_or_too_long_stop_strings_are_refused_by_name(server):
    assert "--max-stop-strings" in _error(_post(server, {"prompt": "hi", "stop": ["a", "b", "c", "d"]}), 400, "stop")
    assert "--max-stop-length" in _error(_post(server, {"prompt": "hi", "stop": ["x" * 11]}), 400, "stop")
    ok = _post(server, {"prompt": "hi", "max_tokens": 3, "stop": ["a", "b", "x" * 10]})
    assert ok.status_code == 200


# ---- the openai client's models.retrieve ----


def test_models_retrieve(client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


# ---- connections that never finish their request ----


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing the connection; fails if it is still open after `seconds`."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the connection was still open after {seconds} s (received {got[:80]!r})")
    return got


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def test_a_connection_that_sends_nothing_or_half_its_headers_is_closed(server):
    start = time.monotonic()
    with _connect(server) as idle, _connect(server) as trickle:
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-")
        assert _closed_within(idle, 10) == b""
        assert _closed_within(trickle, 10) == b""
    assert time.monotonic() - start < 5  # header_timeout_s = 0.5 s here (60 s by default)


def test_a_body_that_stops_coming_is_answered_408(server):
    with _connect(server) as sock:
        head = (
            "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"prompt": ')
        answer = _closed_within(sock, 10)
    assert answer.startswith(b"HTTP/1.1 408") and b"--idle-timeout" in answer
    assert httpx.get(server.url + "/health").status_code == 200  # and the server serves on


# ---- a sweep: every field, every hostile value: a 4xx or a 200, never a 5xx ----

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "seed", "stop", "stream", "stream_options", "ignore_eos", "n", "best_of", "logprobs",
    "top_logprobs", "echo", "presence_penalty", "frequency_penalty", "logit_bias", "tools", "response_format",
    "suffix", "user",
]  # fmt: skip
HOSTILE = [
    True, 0, -1, 1.5, 2**63, -(2**63) - 1, 1e308, "", "x" * 5000, "\u0000", [], [[None]], {"a": {}}, ["x"] * 100,
]  # fmt: skip
CHAT_FIELDS = ("model", "messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "response_format")


def test_no_field_value_gets_a_5xx(server):
    base = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bad = []
    with httpx.Client(base_url=server.url, headers={"Content-Type": "application/json", **AUTH}, timeout=30) as http:
        for path, fields in (("/v1/completions", FIELDS), ("/v1/chat/completions", CHAT_FIELDS)):
            for field in fields:
                for value in HOSTILE:
                    body = {**base, field: value}
                    if field not in ("max_tokens", "max_completion_tokens"):
                        body["max_tokens"] = 1  # a body that is valid after all generates one token only
                    r = http.post(path, content=json.dumps(body))
                    refused_in_shape = r.status_code == 200 or "error" in r.json()  # OpenAI's error JSON
                    if r.status_code >= 500 or not refused_in_shape:
                        bad.append((path, field, value, r.status_code, r.text[:120]))
    assert not bad, bad[:10]


def test_the_replay_server_checks_the_host_too():
    """`stagewise view run.json` serves a recorded run (its prompts' text): no rebinding there either."""
    from starlette.testclient import TestClient

    from stagewise.serve.replay import replay_app

    with TestClient(replay_app({"schema": "stagewise.trace", "steps": []}, "run.json")) as http:
        assert http.get("/api/run", headers={"Host": "127.0.0.1:8001"}).status_code == 200
        assert http.get("/api/run", headers={"Host": "evil.example:8001"}).status_code == 403
