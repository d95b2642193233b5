"""The engine snapshot, the trace's views (format version 2), the hub and its event stream, the recorder,
and what `stagewise view` refuses. The page itself is tested in a browser: test_view_browser.py."""

import json
import re
import sys
import threading
import time

import httpx
import jsonschema
import pytest
import uvicorn
from starlette.applications import Starlette

from stagewise import LLM, SamplingParams
from stagewise.config import EngineConfig
from stagewise.engine.snapshot import engine_snapshot
from stagewise.errors import StagewiseError
from stagewise.serve import server as serve_server
from stagewise.serve.replay import load_run
from stagewise.serve.view import RunRecorder, ViewHub, page_html, view_routes
from stagewise.trace.export import TRACE_SCHEMA, VIEW_SCHEMA, drop_times, to_json
from stagewise.trace.tracer import Tracer

PREFIX = "the cat sat on the mat and the dog sat on the log " * 2


def check_view(view: dict) -> None:
    """What every snapshot must satisfy, whatever the run."""
    jsonschema.validate(view, VIEW_SCHEMA)
    reqs, queues, kv = view["requests"], view["queues"], view["kv"]
    listed = queues["waiting"] + queues["running"] + queues["preempted"]
    assert len(listed) == len(set(listed)) and set(listed) <= set(reqs)
    for rid in queues["running"]:
        r = reqs[rid]
        assert r["status"] == "running" and 0 < r["num_computed_tokens"] <= r["num_tokens"]
        assert len(r["blocks"]) * kv["block_size"] >= r["num_computed_tokens"]  # its K/V fit its blocks
    for rid in queues["waiting"] + queues["preempted"]:
        assert reqs[rid]["blocks"] == [] and reqs[rid]["num_computed_tokens"] == 0  # waiting holds no KV
    held = [b for r in reqs.values() for b in r["blocks"]]
    assert len(set(held)) == kv["num_used"]  # every block in use has an owner
    assert sorted({b for b in held if held.count(b) > 1}) == kv["shared"]
    budget = view["budget"]
    scheduled = sum(r["num_scheduled"] for r in reqs.values())
    assert budget["prefill_tokens"] + budget["decode_tokens"] == scheduled <= budget["max_num_batched_tokens"]


def test_trace_steps_carry_the_engine_view(tiny):
    """A paged run with a shared prefix and preemption: each step's view agrees with the step itself."""
    ecfg = EngineConfig(block_size=4, num_kv_blocks=18, max_num_seqs=3, max_num_batched_tokens=32)
    llm = LLM(tiny, mode="paged", engine_config=ecfg)
    prompts = [PREFIX + "one", PREFIX + "two", "x y"]
    with Tracer() as tracer:
        llm.generate(prompts, SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    doc = to_json(tracer)
    assert doc["version"] == 2
    jsonschema.validate(doc, TRACE_SCHEMA)
    for step in doc["steps"]:
        view = step["view"]
        check_view(view)
        assert view["step"] == step["index"]
        scheduled = {r["request_id"]: r["num_scheduled"] for r in step["requests"]}
        assert {rid: r["num_scheduled"] for rid, r in view["requests"].items() if r["num_scheduled"]} == scheduled
        assert set(step["sampled"]) == {x["request_id"] for x in view["latency"]}  # whose token came out
    views = [s["view"] for s in doc["steps"]]
    assert any(v["kv"]["shared"] for v in views), "the second prompt shares the first one's prefix blocks"
    assert any(v["queues"]["preempted"] for v in views), "18 blocks are too few for all three: preemption"
    assert any(v["queues"]["waiting"] for v in views)
    assert {f["request_id"] for v in views for f in v["finished"]} == {"req-0", "req-1", "req-2"}
    assert views[-1]["kv"]["num_used"] == 0 and not any(views[-1]["queues"].values())
    ttft = [x for v in views for x in v["latency"] if "ttft_ms" in x]
    assert sorted(x["request_id"] for x in ttft) == ["req-0", "req-1", "req-2"]  # one first token each
    assert all(x["ttft_ms"] > 0 for x in ttft)
    drop_times(tracer)  # untimed (trace --no-timing): the view's clock and latencies go too
    untimed = to_json(tracer)["steps"]
    assert all(s["view"]["time"] == s["index"] for s in untimed)
    assert all(x.get("ttft_ms", x.get("tbt_ms")) is None for s in untimed for x in s["view"]["latency"])


def test_kv_mode_has_no_view_and_is_refused_for_replay(tiny, tmp_path):
    llm = LLM(tiny, mode="kv")
    with Tracer() as tracer:
        llm.generate(["hello"], SamplingParams(max_tokens=2, temperature=0))
    doc = to_json(tracer)
    jsonschema.validate(doc, TRACE_SCHEMA)
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(StagewiseError, match="no engine views to replay .*mode kv.*--mode paged"):
        load_run(path)


def test_load_run_refuses_what_it_cannot_replay(tmp_path):
    cases = {
        "missing.json": (None, "no such file"),
        "folder": ("DIR", "is a folder"),
        "broken.json": ('{"schema": "stagewise.trace", ', "is not JSON \\(line 1"),
        "other.json": ('{"traceEvents": []}', "is not a stagewise trace"),
        "v1.json": (
            '{"schema": "stagewise.trace", "version": 1, "steps": []}',
            "version 1; stagewise view replays version 2",
        ),
        "damaged.json": (
            '{"schema": "stagewise.trace", "version": 2, "steps": [{"view": {"step": 0}}]}',
            "step 0 has a damaged view",
        ),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text == "DIR":
            path.mkdir()
        elif text is not None:
            path.write_text(text)
        with pytest.raises(StagewiseError, match=message):
            load_run(path)


def test_recorder_writes_a_replayable_trace(tiny, tmp_path):
    """The recorder as a hub subscriber over a hand-stepped engine: a version-2 trace that replays."""
    llm = LLM(tiny, mode="paged", engine_config=EngineConfig(block_size=4, num_kv_blocks=32))
    hub = ViewHub(history=4)
    path = tmp_path / "run.json"
    path.write_text("old")  # replaced whole, never appended to
    recorder = RunRecorder(path, llm.describe())
    hub.subscribe(recorder)
    published = []
    llm.add_request(PREFIX, SamplingParams(max_tokens=3, ignore_eos=True))
    llm.add_request("hello", SamplingParams(max_tokens=5, ignore_eos=True))
    step = 0
    while llm.has_unfinished_requests():
        llm.step()
        step += 1
        snap = engine_snapshot(llm.engine, step_index=step, step_stats={"step_ms": 1.5}, now=time.time())
        hub.publish(snap)
        published.append(snap)
    shown = [{k: v for k, v in s.items() if k != "prev_step"} for s in hub.history()]  # prev_step: the page's
    assert hub.latest() is published[-1] and shown == published[-4:]  # bounded history
    assert path.read_text() == "old"  # nothing written before close()
    recorder.close()
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, TRACE_SCHEMA)
    assert doc["model"]["name"] == "tiny" and doc["summary"]["requests"] == 2 and doc["summary"]["steps"] == step
    assert [s["view"] for s in doc["steps"]] == json.loads(json.dumps(published))
    assert [s["index"] for s in load_run(path)["steps"]] == list(range(1, step + 1))
    for s in doc["steps"]:
        check_view(s["view"])
        assert s["dur_us"] == 1500.0


def test_a_failing_subscriber_is_dropped(capsys):
    hub = ViewHub()
    got = []

    def broken(snapshot):
        raise OSError("No space left on device")

    hub.subscribe(broken)
    hub.subscribe(got.append)
    hub.publish({"step": 1})
    hub.publish({"step": 2})
    assert got == [{"step": 1}, {"step": 2}]
    assert capsys.readouterr().err.count("No space left on device") == 1


class _Server:
    """The view's routes alone, under uvicorn in a thread, on a free loopback port."""

    def __init__(self, hub: ViewHub):
        sock = serve_server.bind("127.0.0.1", 0)
        self.url, self.sock = serve_server.url_of(sock), sock
        config = uvicorn.Config(Starlette(routes=view_routes(hub)), log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def read_events(res, out: list) -> None:
    for line in res.iter_lines():
        if line.startswith("data: "):
            out.append(json.loads(line[6:]))


def test_event_stream_coalesces_for_a_slow_reader_and_ends_on_close():
    """A client that does not read while 300 large snapshots are published gets only some of them
    (the server never queues more than one per client), the last one among them; close() ends the stream.
    The history keeps the latest of them within its byte bound (8 MB by default: 40 of these)."""
    hub = ViewHub()
    pad = "x" * 200_000  # large snapshots: the socket buffers fill after a few
    with _Server(hub) as srv:
        assert httpx.get(srv.url + "/api/snapshot").json() is None  # before the first step
        with httpx.stream("GET", srv.url + "/api/events", timeout=30) as res:
            assert res.headers["content-type"].startswith("text/event-stream")
            while not hub.num_streams:  # the stream has subscribed
                time.sleep(0.01)
            for step in range(300):
                hub.publish({"step": step, "pad": pad})
            time.sleep(0.5)
            got: list = []
            reader = threading.Thread(target=read_events, args=(res, got))
            reader.start()
            deadline = time.monotonic() + 20
            while (not got or got[-1]["step"] != 299) and time.monotonic() < deadline:
                time.sleep(0.05)
            hub.close()
            reader.join(10)
            assert not reader.is_alive(), "close() ends the stream"
        steps = [e["step"] for e in got]
        assert steps[-1] == 299 and steps == sorted(set(steps)) and len(steps) < 100, steps
        assert httpx.get(srv.url + "/api/snapshot").json()["step"] == 299
        history = httpx.get(srv.url + "/api/history")
        assert len(history.content) <= 8 * 2**20
        assert [s["step"] for s in history.json()] == list(range(300 - len(history.json()), 300))
        assert len(history.json()) == 8 * 2**20 // len(json.dumps({"step": 299, "pad": pad}, separators=(",", ":")))
        # a page that got step 299 after 290 fills its gap with the steps after 290
        assert [s["step"] for s in httpx.get(srv.url + "/api/history?since=290").json()] == list(range(291, 300))
        bad = httpx.get(srv.url + "/api/history?since=x")
        assert bad.status_code == 400 and "since must be a step number" in bad.json()["error"]["message"]


def test_page_is_self_contained():
    """No script, style, font or image from anywhere but the page itself (the machine may be offline)."""
    page = page_html("live")
    assert '<body data-mode="live">' in page and 'id="queue-running"' in page and 'id="kv-grid"' in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert "@import" not in page and not re.search(r"url\(\s*['\"]?(https?:)?//", page)
    assert '<body data-mode="replay" data-run="a&amp;b.json">' in page_html("replay", run_name="a&b.json")


V1 = '{"schema": "stagewise.trace", "version": 1, "steps": []}'
V1_WHY = " is trace format version 1; stagewise view replays version 2 (record the run again with this stagewise)"


@pytest.mark.parametrize(
    "content, why",
    [
        (None, ": no such file"),
        ("{", " is not JSON (line 1: Expecting property name enclosed in double quotes)"),
        (V1, V1_WHY),
    ],
)
def test_view_command_refuses_a_bad_file_in_one_line(content, why, tmp_path, monkeypatch, capsys):
    """The command in-process (its main() with its own argv): exit 2, one line, before any socket."""
    from stagewise import cli

    bad = tmp_path / "run.json"
    if content is not None:
        bad.write_text(content)
    monkeypatch.setattr(sys, "argv", ["stagewise", "view", str(bad)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.strip().splitlines() == [f"error: {bad}{why}"]


@pytest.mark.model
def test_smollm_trace_replays(smollm, tmp_path):
    llm = LLM(smollm, mode="paged", backend="naive")  # naive: no GEMM calibration, the tracer sees every stage
    with Tracer() as tracer:
        llm.generate(["The capital of France is", "Tell me a story"], SamplingParams(max_tokens=2, temperature=0))
    path = tmp_path / "run.json"
    path.write_text(json.dumps(to_json(tracer)))
    steps = load_run(path)["steps"]
    assert len(steps) == 2
    for s in steps:
        check_view(s["view"])
    assert steps[0]["view"]["budget"]["prefill_tokens"] > 0 and steps[-1]["view"]["finished"]
