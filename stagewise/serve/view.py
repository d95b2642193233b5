"""The live view: engine snapshots from the engine thread to browsers, and to a recording.

The engine loop calls `hub.publish(snapshot)` after every step (a dict from
`stagewise.engine.snapshot.engine_snapshot`). The hub keeps the latest one and
a bounded history, and hands each one to its subscribers:

- every open `/api/events` stream (server-sent events, one `data: {json}` per
  snapshot). A browser that reads slower than the engine steps does not make
  the server buffer: each stream holds at most one snapshot waiting to be
  sent, and a newer one replaces it (the page then skips a step; the
  counters in each snapshot are totals, so nothing it draws goes wrong);
- a `RunRecorder`, which keeps every step and writes them as a trace JSON
  (`serve --record run.json`) that `stagewise view run.json` replays.

Routes (`view_routes(hub)`): `GET /` the page, `GET /api/snapshot` the latest
snapshot (JSON, `null` before the first step), `GET /api/history` the recent
ones, `GET /api/events` the stream.

Threads: `publish` runs in the engine thread, the streams in the server's
asyncio loop; a stream is woken with `loop.call_soon_threadsafe`, never by
touching asyncio objects from the engine thread.
"""

import asyncio
import html
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.routing import Route

from stagewise.files import write_text_atomic
from stagewise.trace.export import SCHEMA_NAME, SCHEMA_VERSION

HISTORY = 600  # snapshots kept for a page that connects late (its charts start from them)
KEEPALIVE_S = 15.0  # an idle stream sends a comment line this often (proxies, dead clients)
PAGE = "view.html"  # in stagewise/serve/static/


def page_html(mode: str, run_name: str = "") -> str:
    """The page, told whether it is live (a server's /api/events) or a replay (/api/run of `run_name`)."""
    text = resources.files("stagewise.serve").joinpath("static", PAGE).read_text(encoding="utf-8")
    attrs = f'data-mode="{mode}"' + (f' data-run="{html.escape(run_name)}"' if run_name else "")
    return text.replace('<body data-mode="live">', f"<body {attrs}>", 1)


class ViewHub:
    """Latest snapshot, a bounded history, and the subscribers that get each new one."""

    def __init__(self, history: int = HISTORY):
        self._lock = threading.Lock()
        self._latest: dict | None = None
        self._history: deque[dict] = deque(maxlen=history)
        self._subscribers: list[Callable[[dict | None], None]] = []
        self._encoded: tuple[dict, str] | None = None  # (snapshot, its JSON): encoded once
        self.closed = False

    def publish(self, snapshot: dict) -> None:
        """Called by the engine thread after each step. A failing subscriber is dropped."""
        with self._lock:
            self._latest = snapshot
            self._history.append(snapshot)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(snapshot)
            except Exception as exc:  # a recorder's full disk must not stop the engine
                self.unsubscribe(callback)
                print(f"view: a subscriber failed and was dropped ({exc})", file=sys.stderr)

    def subscribe(self, callback: Callable[[dict | None], None]) -> Callable[[], None]:
        """`callback(snapshot)` after every publish (None once the hub closes); -> unsubscribe."""
        with self._lock:
            self._subscribers.append(callback)
        return lambda: self.unsubscribe(callback)

    def unsubscribe(self, callback) -> None:
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def latest(self) -> dict | None:
        with self._lock:
            return self._latest

    def history(self) -> list[dict]:
        with self._lock:
            return list(self._history)

    def encode(self, snapshot: dict) -> str:
        """JSON of a snapshot; every stream sending the same one shares one encoding."""
        with self._lock:
            if self._encoded is not None and self._encoded[0] is snapshot:
                return self._encoded[1]
        text = json.dumps(snapshot, separators=(",", ":"))
        with self._lock:
            self._encoded = (snapshot, text)
        return text

    def close(self) -> None:
        """The server is stopping: every open stream ends (so shutdown does not wait on them)."""
        with self._lock:
            self.closed = True
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(None)
            except Exception:
                pass


async def _events(hub: ViewHub, request: Request):
    """One browser's stream: at most one snapshot waits for it; a newer one replaces it."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    box: dict = {}  # "snap": the snapshot to send next; "end": the hub closed

    def on_publish(snapshot: dict | None) -> None:  # engine thread
        if snapshot is None:
            box["end"] = True
        else:
            box["snap"] = snapshot  # replaces one not yet sent: coalesced, never queued
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the server's loop is gone
            pass

    latest = hub.latest()
    if latest is not None:
        box["snap"] = latest
    unsubscribe = hub.subscribe(on_publish)

    async def stream():
        try:
            yield "retry: 1000\n\n"
            while not hub.closed and not box.get("end"):
                snap = box.pop("snap", None)
                if snap is not None:
                    yield f"event: snapshot\ndata: {hub.encode(snap)}\n\n"
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    if await request.is_disconnected():
                        break
                wake.clear()
        finally:
            unsubscribe()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def view_routes(hub: ViewHub) -> list[Route]:
    """The page and its API, to add to the server's routes."""

    async def index(request: Request):
        return HTMLResponse(page_html("live"))

    async def snapshot(request: Request):
        return JSONResponse(hub.latest())

    async def history(request: Request):
        return JSONResponse(hub.history())

    async def events(request: Request):
        return await _events(hub, request)

    return [
        Route("/", index, methods=["GET"]),
        Route("/api/snapshot", snapshot, methods=["GET"]),
        Route("/api/history", history, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
    ]


class RunRecorder:
    """A hub subscriber that keeps every step and writes a trace JSON (version 2) on close().

    The document has the trace's shape (`stagewise.trace.export`): the model, no prelude, one
    step per engine step with the scheduled requests, the scheduler's queues and the full
    snapshot under "view", but no stage records (a server does not trace shapes). Steps are
    kept in memory as encoded JSON, a few kB each.
    """

    def __init__(self, path: str | Path, model_info: dict):
        self.path = Path(path)
        self.model_info = {**model_info, "mode": "paged", "recorded_by": "stagewise serve --record"}
        self._steps: list[str] = []  # one encoded step each
        self._lock = threading.Lock()
        self._t0: float | None = None  # time of the first snapshot
        self._ttft: list[float] = []
        self._tbt: list[float] = []
        self._requests: set[str] = set()
        self.closed = False

    def __call__(self, snapshot: dict | None) -> None:
        if snapshot is None:
            return  # the hub closed; the server calls close() itself
        with self._lock:
            if self.closed:
                return
            if self._t0 is None:
                self._t0 = snapshot["time"]
            self._steps.append(json.dumps(self._step(snapshot), separators=(",", ":")))
            self._requests.update(snapshot["requests"])
            for item in snapshot["latency"]:
                (self._ttft if "ttft_ms" in item else self._tbt).append(item.get("ttft_ms", item.get("tbt_ms")))

    def _step(self, snap: dict) -> dict:
        scheduled = [
            {
                "request_id": rid,
                "num_computed_tokens": r["num_computed_tokens"],
                "num_tokens": r["num_tokens"],
                "num_scheduled": r["num_scheduled"],
                "phase": r["phase"],
            }
            for rid, r in snap["requests"].items()
            if r["num_scheduled"]
        ]
        kv, queues = snap["kv"], snap["queues"]
        start_us = (snap["time"] - self._t0) * 1e6
        return {
            "index": snap["step"],
            "mode": "paged",
            "rank": 0,
            "requests": scheduled,
            "batch": {},
            "scheduler": {
                "waiting": queues["waiting"] + queues["preempted"],
                "kv_blocks_in_use": kv["num_used"],
                "kv_blocks_total": kv["num_blocks"],
            },
            "stages": [],
            "sampled": {},
            "text": {},
            "start_us": start_us,
            "dur_us": float(snap["budget"].get("step_ms", 0.0)) * 1e3,
            "view": snap,
        }

    def close(self) -> Path:
        """Write the document atomically (a reader never sees half of it); later steps are ignored."""
        with self._lock:
            self.closed = True
            steps = list(self._steps)
            summary = {
                "requests": len(self._requests),
                "steps": len(steps),
                "ttft_ms": round(sum(self._ttft) / len(self._ttft), 2) if self._ttft else None,
                "tbt_ms": round(sum(self._tbt) / len(self._tbt), 2) if self._tbt else None,
                "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
        head = {"schema": SCHEMA_NAME, "version": SCHEMA_VERSION, "model": self.model_info, "prelude": []}
        text = json.dumps(head)[:-1] + ', "steps": [\n' + ",\n".join(steps) + "\n]"
        text += ', "summary": ' + json.dumps(summary) + "}\n"
        return write_text_atomic(self.path, text)
