"""`stagewise serve` through the official `openai` client: completions and chat, streaming and not,
stop strings, seeded sampling equal to `LLM.generate`, usage counts, bad input -> 400 naming the
field, /metrics, /v1/models. One server (tiny model) for the whole module."""

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stagewise.engine.llm import LLM
from stagewise.sampling_params import SamplingParams
from tests.serve.harness import running_server

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(tiny):
    with running_server(LLM(tiny)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny):
    """A second LLM over the same weights: what `generate` gives, outside the server's engine."""
    return LLM(tiny)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _ref(reference, prompt, chat=False, **params):
    return reference.generate([prompt], SamplingParams(**params), chat=chat)[0]


def test_completion_matches_generate_and_counts_usage(client, reference):
    ref = _ref(reference, PROMPT, max_tokens=12, temperature=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == "tiny"
    choice = out.choices[0]
    assert choice.index == 0 and choice.text == ref.text and choice.finish_reason == "length"
    assert choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12


def test_streamed_completion_is_the_same_text_with_a_usage_chunk(client, reference):
    ref = _ref(reference, PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == ref.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12


def test_chat_whole_and_streamed_use_the_chat_template(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ref = reference.generate([messages], SamplingParams(max_tokens=10, temperature=0), chat=True)[0]
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_eos_or_the_context(client):
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], temperature=0, stop=["e"]
    )  # a stop string ends it early, whatever the default
    assert out.choices[0].finish_reason in ("stop", "length")


def test_stop_strings_cut_the_text_as_generate_does(client, reference):
    full = _ref(reference, PROMPT, max_tokens=20, temperature=0).text
    stop = full[6:8]
    ref = _ref(reference, PROMPT, max_tokens=20, temperature=0, stop=[stop, "never-there"])
    assert ref.finish_reason == "stop"
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "never-there"]
    )
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == ref.text


def test_seeded_sampling_equals_generate(client, reference):
    params = dict(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=1234)
    ref = _ref(reference, PROMPT, **params)
    extra = {"top_k": 40}  # vLLM's extra sampling fields travel in the body
    a = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, extra_body=extra
    )
    b = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, extra_body=extra, stream=True
    )
    assert a.choices[0].text == ref.text == "".join(c.choices[0].text for c in b)
    assert a.usage.completion_tokens == len(ref.token_ids)


def test_ignore_eos_and_repetition_penalty_are_accepted(client, reference):
    ref = _ref(reference, PROMPT, max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"repetition_penalty": 1.3, "ignore_eos": True},
    )
    assert out.choices[0].text == ref.text


def _post(server, path, body, raw=False):
    content = body if raw else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=30)


BAD = [
    ("malformed JSON", "/v1/completions", b'{"prompt": "hi", ', 400, None, "not valid JSON"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("prompt missing", "/v1/completions", {"model": "tiny"}, 400, "prompt", "required"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt", "string"),
    ("empty prompt", "/v1/completions", {"prompt": "   "}, 400, "prompt", "empty"),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "int"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens must"),
    ("temperature negative", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "[0,"),
    ("top_p out of range", "/v1/completions", {"prompt": "hi", "top_p": 3}, 400, "top_p", "(0, 1]"),
    ("top_p a string", "/v1/completions", {"prompt": "hi", "top_p": "x"}, 400, "top_p", "number"),
    ("stop wrong type", "/v1/completions", {"prompt": "hi", "stop": 7}, 400, "stop", "stop"),
    ("seed a bool", "/v1/completions", {"prompt": "hi", "seed": True}, 400, "seed", "int"),
    ("stream not a bool", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", "bool"),
    ("n = 17", "/v1/completions", {"prompt": "hi", "n": 17}, 400, "n", "[1, 16]"),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    ("echo", "/v1/completions", {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model", "does not exist"),
    ("prompt too long", "/v1/completions", {"prompt": "word " * 3000}, 400, "prompt", "max_model_len"),
    (
        "prompt + max_tokens too long",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 5000},
        400,
        "max_tokens",
        "max_model_len",
    ),
    ("messages missing", "/v1/chat/completions", {"model": "tiny"}, 400, "messages", "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0]",
        "role",
    ),
    (
        "content a number",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0]",
        "content",
    ),
    (
        "max_completion_tokens bad",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2},
        400,
        "max_completion_tokens",
        "max_completion_tokens must",
    ),
]


@pytest.mark.parametrize("what, path, body, status, param, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_naming_the_field(server, what, path, body, status, param, words):
    r = _post(server, path, body, raw=isinstance(body, bytes))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"], error["message"]


def test_an_oversized_body_is_refused_413(server):
    r = _post(server, "/v1/completions", b'{"prompt": "' + b"x" * (17 * 2**20) + b'"}', raw=True)
    assert r.status_code == 413 and "MiB" in r.json()["error"]["message"]


def test_the_client_sees_the_errors_and_the_server_serves_on(server, client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model="tiny", prompt="hi", top_p=7)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    r = httpx.get(server.url + "/no/such/path")
    assert r.status_code == 404 and "error" in r.json()
    assert client.completions.create(model="tiny", prompt="still here", max_tokens=2).usage.completion_tokens == 2
    assert server.engine_idle()


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            key = sample.name + (
                "" if "finished_reason" not in sample.labels else f"[{sample.labels['finished_reason']}]"
            )
            values[key] = values.get(key, 0) + sample.value
    return values


def test_metrics_parse_and_move(server, client):
    before = _metrics(server)
    for name in (
        "stagewise:num_requests_running",
        "stagewise:num_requests_waiting",
        "stagewise:kv_cache_usage_perc",
        "stagewise:num_preemptions_total",
        "stagewise:prefix_cache_queries_total",
        "stagewise:prefix_cache_hits_total",
        "stagewise:time_to_first_token_seconds_count",
        "stagewise:inter_token_latency_seconds_count",
        "stagewise:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    client.completions.create(
        model="tiny", prompt="count me in", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = _metrics(server)
    assert after["stagewise:generation_tokens_total"] - before.get("stagewise:generation_tokens_total", 0) == 5
    assert after["stagewise:prompt_tokens_total"] > before.get("stagewise:prompt_tokens_total", 0)
    assert (
        after["stagewise:time_to_first_token_seconds_count"]
        == before["stagewise:time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["stagewise:inter_token_latency_seconds_count"]
        >= before["stagewise:inter_token_latency_seconds_count"] + 4
    )
    assert (
        after["stagewise:e2e_request_latency_seconds_count"]
        == before["stagewise:e2e_request_latency_seconds_count"] + 1
    )
    assert after["stagewise:prefix_cache_queries_total"] > before["stagewise:prefix_cache_queries_total"]
    assert after["stagewise:request_success_total[length]"] >= 1
    assert after["stagewise:num_requests_running"] == 0
