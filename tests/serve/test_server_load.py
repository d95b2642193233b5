"""`stagewise serve` under load and misbehaving clients: 100+ concurrent streams with none lost or
duplicated and every KV block free afterwards; a client that disconnects mid-stream; a full queue
(503); --api-key (401); static batching (--mode kv) giving the same greedy text; a request that fails
in an engine step (an error for it, the others untouched); the live view's hook; an idle loop."""

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from stagewise.config import EngineConfig
from stagewise.engine.llm import LLM
from stagewise.sampling_params import SamplingParams
from tests.serve.harness import running_server

PROMPTS = ["The quick brown fox", "Once upon a time", "In a hole in the ground", "It was a dark night", "Call me"]
NUM_CLIENTS = 120


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(tiny, engine_config=EngineConfig(max_num_seqs=16, num_kv_blocks=160))
    with running_server(llm) as running:
        yield running


@pytest.fixture(scope="module")
def references(tiny):
    """Greedy text of each (prompt, max_tokens) pair, from generate on an LLM of its own."""
    llm = LLM(tiny)
    pairs = sorted({(PROMPTS[i % len(PROMPTS)], 4 + i % 9) for i in range(NUM_CLIENTS)})
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in pairs]
    outs = llm.generate([p for p, _ in pairs], params)  # one call: the pairs share batches
    return {pair: out.text for pair, out in zip(pairs, outs)}


async def _stream_one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[str, int, int]:
    """One streaming client: -> (text, chunks with text, completion tokens from the usage chunk)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, pieces, used, done = [], 0, None, False
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                pieces += bool(choice["text"])
                text.append(choice["text"])
    assert done, "the stream ended without [DONE]"
    return "".join(text), pieces, used


def test_many_concurrent_streams_lose_nothing_and_free_every_block(server, references):
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + i % 9) for i in range(NUM_CLIENTS)]

    async def main():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(_stream_one(http, server.url, p, n) for p, n in jobs))

    results = asyncio.run(main())
    assert len(results) == NUM_CLIENTS
    for (prompt, n), (text, _, used) in zip(jobs, results):
        assert used == n  # every token came, none twice (the engine's own count)
        assert text == references[(prompt, n)]  # ... and the text is each request's own, in order
    assert server.engine_idle(), "requests or KV blocks left in the engine"
    metrics = httpx.get(server.url + "/metrics").text
    assert 'stagewise:request_success_total{finished_reason="length",model_name="tiny"}' in metrics


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    runner = server.state.llm.engine
    body = {
        "model": "tiny",
        "prompt": "A long story",
        "max_tokens": 800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            got = [line for line, _ in zip((x for x in lines if x.startswith("data: ")), range(3))]
            assert len(got) == 3
            assert runner.block_manager.num_used_blocks > 0  # it holds KV while it decodes
        # the connection is closed here, long before 800 tokens
    assert server.engine_idle(), "the abandoned request still holds KV blocks"
    assert 'finished_reason="abort"' in httpx.get(server.url + "/metrics").text  # it left unfinished
    out = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model="tiny", prompt="next", max_tokens=3
    )
    assert out.usage.completion_tokens == 3


def test_a_non_streaming_client_that_hangs_up_aborts_too(server):
    body = {"model": "tiny", "prompt": "Another long story", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    assert server.engine_idle(), "the request of a client that hung up still runs"


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_full_queue_answers_503_and_the_server_serves_on(tiny):
    llm = LLM(tiny, engine_config=EngineConfig(max_num_seqs=1))
    loop_of = {}

    def post(http, prompt, max_tokens=2):
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        return http.post(loop_of["url"] + "/v1/completions", json=body)

    with running_server(llm, max_queue=1) as server, httpx.Client(timeout=30) as http:
        loop, loop_of["url"] = server.state.loop, server.url
        with ThreadPoolExecutor(2) as pool:
            with llm._lock:  # the engine loop steps under the LLM's lock: held, the engine stands still
                first = pool.submit(post, http, "first", 200)  # long: it holds the seat
                _wait(lambda: loop.num_waiting() == 1)  # submitted, not yet scheduled
            _wait(lambda: loop.num_waiting() == 0)  # it took the one seat (max_num_seqs=1) ...
            with llm._lock:  # ... and the engine stands still again while it holds the seat
                second = pool.submit(post, http, "second", 200)
                _wait(lambda: loop.num_waiting() == 1)  # waits for the seat: the queue (1) is full
                third = post(http, "third")
                assert third.status_code == 503, third.text
                assert "queue is full" in third.json()["error"]["message"]
            assert first.result().status_code == second.result().status_code == 200
        assert server.engine_idle()
        ok = post(http, "one more")
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_api_key(tiny):
    with running_server(LLM(tiny), api_key="s3cret") as server:
        for key in ("wrong", ""):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "x", max_retries=0)
            if not key:
                client = client.with_options(default_headers={"Authorization": ""})
            with pytest.raises(openai.AuthenticationError):
                client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(server.url + "/health").status_code == 200  # open, as in vLLM


def test_static_batching_mode_gives_the_same_greedy_text_and_drops_a_leaver(tiny, references):
    llm = LLM(tiny, mode="kv", engine_config=EngineConfig(max_num_seqs=4))
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + i % 9) for i in range(10)]
    with running_server(llm, mode="kv") as server:

        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(_stream_one(http, server.url, p, n) for p, n in jobs))

        results = asyncio.run(main())
        for (prompt, n), (text, _, used) in zip(jobs, results):
            assert used == n and text == references[(prompt, n)]
        # a stream ends with its last token; the loop drops the request when its step returns, a moment later
        _wait(lambda: server.state.loop.num_in_flight() == 0)
        body = {"prompt": "Long", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", server.url + "/v1/completions", json=body) as response:
                assert next(x for x in response.iter_lines() if x.startswith("data: "))
        _wait(lambda: server.state.loop.num_in_flight() == 0)  # a static row aborted: the batch ends early
        assert 'finished_reason="abort"' in httpx.get(server.url + "/metrics").text
        short = httpx.post(server.url + "/v1/completions", json={"prompt": "next", "max_tokens": 3}, timeout=30)
        assert short.json()["usage"]["completion_tokens"] == 3


def test_the_live_view_gets_one_snapshot_per_engine_step(tiny):
    from stagewise.serve.view import ViewHub

    hub = ViewHub()
    seen = []
    hub.subscribe(lambda snap: seen.append(snap) if snap is not None else None)
    llm = LLM(tiny)
    with running_server(llm, hub=hub) as server:
        body = {"prompt": "Watch me", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 200
        steps = llm.engine.stats.steps
        _wait(lambda: len(seen) == steps)  # the last one is published just after the last token went out
        assert [s["step"] for s in seen] == list(range(steps))  # one per step, in order, from 0
        assert seen[-1]["finished"] and seen[-1]["finished"][0]["finish_reason"] == "length"
        assert httpx.get(server.url + "/api/snapshot").json()["step"] == steps - 1
        page = httpx.get(server.url + "/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]


def _cpu_ticks(native_id: int) -> int:
    """user + system clock ticks a thread of this process has run (Linux /proc)."""
    fields = open(f"/proc/self/task/{native_id}/stat").read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads Linux /proc")
def test_an_idle_server_sleeps_instead_of_spinning(server):
    thread = server.state.loop._thread
    assert server.engine_idle()
    before = _cpu_ticks(thread.native_id)
    time.sleep(1.0)
    assert _cpu_ticks(thread.native_id) - before <= 1  # a spinning loop would burn ~100 ticks a second


def test_a_request_that_fails_in_a_step_ends_with_an_error_and_the_others_go_on(tiny, references):
    llm = LLM(tiny)
    make_request = llm.make_request

    def poisoning(prompt, params, chat=False):
        if prompt.startswith("poison"):  # valid when checked, then made to fail in every step it joins
            object.__setattr__(params, "top_k", 10**20)  # (int64 overflow when the sampling tensors are built)
        return make_request(prompt, params, chat=chat)

    llm.make_request = poisoning
    good = (PROMPTS[0], 12)
    with running_server(llm) as server:

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                healthy = _stream_one(http, server.url, *good)
                whole = http.post(server.url + "/v1/completions", json={"prompt": "poison whole", "max_tokens": 4})
                streamed = http.post(
                    server.url + "/v1/completions", json={"prompt": "poison stream", "max_tokens": 4, "stream": True}
                )
                return await asyncio.gather(healthy, whole, streamed)

        (text, _, used), whole, streamed = asyncio.run(main())
        assert (text, used) == (references[good], 12)  # the healthy one is untouched
        assert whole.status_code == 500 and "failed in an engine step" in whole.json()["error"]["message"]
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "failed in an engine step" in json.loads(events[-2])["error"]["message"]
        assert server.engine_idle()


def test_if_the_engine_loop_dies_the_server_says_so_instead_of_hanging(tiny, capfd):
    llm = LLM(tiny)
    with running_server(llm) as server:
        loop = server.state.loop

        def broken(results):
            raise RuntimeError("a bug in the loop")

        loop._deliver = broken  # the thread's next step raises outside any request's blame
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 500 and "engine loop stopped" in r.json()["error"]["message"]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "a bug in the loop" in health.json()["error"]
        again = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert again.status_code == 503 and "engine loop stopped" in again.json()["error"]["message"]
    assert "error: the engine loop stopped (RuntimeError: a bug in the loop)" in capfd.readouterr().err


def test_speculative_decoding_behind_the_server_gives_the_same_greedy_text(tiny, references):
    llm = LLM(tiny, speculative_config="ngram:3")  # several tokens of a request may come from one step
    jobs = [(PROMPTS[i % len(PROMPTS)], 4 + i % 9) for i in range(6)]
    with running_server(llm) as server:

        async def main():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(_stream_one(http, server.url, p, n) for p, n in jobs))

        for (prompt, n), (text, _, used) in zip(jobs, asyncio.run(main())):
            assert used == n and text == references[(prompt, n)]
        assert server.engine_idle()
