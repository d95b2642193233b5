"""The server's books tell the truth: gauges and the live view settle when the last client leaves
mid-stream, /health fails once a tensor-parallel rank has died, and what watching costs is bounded
(live snapshots a second, open view streams)."""

import contextlib
import os
import signal
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from stagewise.engine.llm import LLM
from stagewise.serve.limits import ServerLimits
from stagewise.serve.view import ViewHub
from tests.serve.harness import running_server


def _gauges(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _wait(check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_gauges_and_the_view_settle_when_the_last_client_leaves(tiny):
    hub = ViewHub(limits=ServerLimits(view_publish_hz=0))
    with running_server(LLM(tiny), hub=hub) as server:
        body = {"prompt": "Long", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            _wait(lambda: next(lines).startswith("data: ") and _gauges(server)["stagewise:num_requests_running"] == 1)
        assert server.engine_idle()  # the request was aborted, its blocks freed
        _wait(lambda: hub.latest()["queues"]["running"] == [])  # the view shows it gone ...
        gauges = _gauges(server)  # ... and so do the gauges, with no later request to update them
        assert gauges["stagewise:num_requests_running"] == 0 and gauges["stagewise:kv_cache_usage_perc"] == 0
        assert hub.latest()["kv"]["num_used"] == 0 and hub.latest()["budget"]["num_scheduled_requests"] == 0


def test_live_snapshots_are_rate_limited_but_a_recorder_gets_every_step(tiny):
    hub = ViewHub(limits=ServerLimits(view_publish_hz=2))
    recorded = []
    hub.subscribe(lambda snap: recorded.append(snap["step"]) if snap is not None else None)
    llm = LLM(tiny)
    with running_server(llm, hub=hub) as server:
        start = time.monotonic()
        body = {"prompt": "Count", "max_tokens": 60, "ignore_eos": True}
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        elapsed = time.monotonic() - start
        steps = llm.engine.stats.steps
        _wait(lambda: len(recorded) == steps)
        history = hub.history()
        live = [s["step"] for s in history]
    assert recorded == list(range(steps))  # every step, for the recording
    assert len(live) <= 2 * elapsed + 2 < steps, (len(live), elapsed, steps)  # at most 2 a second, live
    assert live[-1] == steps - 1  # the last step before the engine went idle is always shown
    assert sum(len(s["latency"]) for s in history) == 60  # every token's TTFT / TBT reaches the chart
    assert [s["prev_step"] for s in history] == [None, *live[:-1]]  # a page tells a missed step from a skipped one


def test_view_streams_beyond_the_limit_get_503_and_a_closed_one_frees_its_place(tiny):
    hub = ViewHub(limits=ServerLimits(max_view_subscribers=2))
    with running_server(LLM(tiny), hub=hub) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        with contextlib.ExitStack() as second_page:
            with http.stream("GET", "/api/events") as first:
                second = second_page.enter_context(http.stream("GET", "/api/events"))
                assert first.status_code == second.status_code == 200 and hub.num_streams == 2
                refused = http.get("/api/events", timeout=10)
                assert refused.status_code == 503
                assert "--max-view-subscribers" in refused.json()["error"]["message"]
            _wait(lambda: hub.num_streams == 1)  # a page closed: its place comes back
            with http.stream("GET", "/api/events") as third:
                assert third.status_code == 200
        _wait(lambda: hub.num_streams == 0)
        hub.close()  # the server stops at once


def test_health_fails_once_a_tensor_parallel_rank_died(tiny):
    llm = LLM(tiny, tensor_parallel_size=2)
    try:
        with running_server(llm) as server:
            assert httpx.get(server.url + "/health").json() == {"status": "ok"}
            worker = llm.model.ranks.processes[1]
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
            health = httpx.get(server.url + "/health")
            assert health.status_code == 503 and "rank 1 exited" in health.json()["error"]
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 503 and "rank 1 exited" in r.json()["error"]["message"]
    finally:
        llm.shutdown()
