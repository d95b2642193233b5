"""The live view: engine snapshots from the engine thread to browsers, and to a recording.

The engine loop publishes a snapshot (a dict from
`stagewise.engine.snapshot.engine_snapshot`) after a step. The hub keeps the
latest one and a bounded history, and hands each one to its subscribers:

- every open `/api/events` stream (server-sent events, one `data: {json}` per
  snapshot). A browser that reads slower than the engine steps does not make
  the server buffer: each stream holds at most STREAM_QUEUE (4) snapshots
  waiting to be sent, and a newer one pushes the oldest out (the page then
  skips a step; the counters in each snapshot are totals, so nothing it
  draws goes wrong);
- a `RunRecorder`, which keeps every step and writes them as a trace JSON
  (`serve --record run.json`) that `stagewise view run.json` replays.

What watching may cost the engine is bounded (`ServerLimits`, each a flag of
`stagewise serve`): at most `view_publish_hz` live snapshots a second (the
engine does not even build the others, unless a recorder wants every step;
the last step before the engine goes idle is always shown), at most
`max_view_subscribers` streams (one more is answered 503), and a history of at
most `view_history_steps` snapshots and `view_history_mb` MB, kept as JSON
text so `/api/history` is sent without encoding it again.

Routes (`view_routes(hub)`): `GET /` the page, `GET /api/snapshot` the latest
snapshot (JSON, `null` before the first step), `GET /api/history` the recent
ones (`?since=STEP`: those after a step, for a page that missed some), `GET
/api/events` the stream. With `--api-key`, the three data routes need the key
too (`guard`): the page asks for it once and keeps it in a cookie, which its
fetch and EventSource calls send (an EventSource cannot send an Authorization
header; a cookie stays out of URLs and logs).

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
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stagewise.files import write_text_atomic
from stagewise.serve.limits import ServerLimits
from stagewise.trace.export import SCHEMA_NAME, SCHEMA_VERSION

HISTORY = ServerLimits.view_history_steps  # snapshots kept for a page that connects late
MAX_CARRIED = 256  # latency items of steps not shown live, carried into the next live snapshot
STREAM_QUEUE = 4  # snapshots that may wait for one /api/events reader (a slow one skips the oldest)
KEEPALIVE_S = 15.0  # an idle stream sends a comment line this often (proxies, dead clients)
PAGE = "view.html"  # in stagewise/serve/static/


def page_html(mode: str, run_name: str = "") -> str:
    """The page, told whether it is live (a server's /api/events) or a replay (/api/run of `run_name`)."""
    text = resources.files("stagewise.serve").joinpath("static", PAGE).read_text(encoding="utf-8")
    attrs = f'data-mode="{mode}"' + (f' data-run="{html.escape(run_name)}"' if run_name else "")
    return text.replace('<body data-mode="live">', f"<body {attrs}>", 1)


class ViewHub:
    """Latest snapshot, a bounded history, and the subscribers that get each new one."""

    def __init__(self, history: int | None = None, limits: ServerLimits | None = None):
        limits = limits or ServerLimits()
        self._lock = threading.Lock()
        self._latest: tuple[dict, str] | None = None  # (snapshot, its JSON)
        self._history: deque[tuple[int, str]] = deque()  # (step, JSON) of the recent live snapshots
        self._history_bytes = 0
        self._max_history = history if history is not None else limits.view_history_steps
        self._max_history_bytes = limits.view_history_bytes
        self._interval = 1 / limits.view_publish_hz if limits.view_publish_hz else 0.0
        self._last_live = -float("inf")  # time.monotonic() of the last live publish
        self.max_streams = limits.max_view_subscribers
        self._subscribers: list[Callable[[dict | None], None]] = []  # every step (recorders)
        self._streams: list[Callable[[dict | None, str], None]] = []  # live only (/api/events)
        self._carried: deque[dict] = deque(maxlen=MAX_CARRIED)  # latency items of steps not shown live
        self.closed = False

    def live_due(self) -> bool:
        """Is a live snapshot due (view_publish_hz allows one now)?"""
        return time.monotonic() - self._last_live >= self._interval

    def wants_every_step(self) -> bool:
        """Does a subscriber (a recorder) want a snapshot of every step?"""
        with self._lock:
            return bool(self._subscribers)

    def carry(self, latency: list[dict]) -> None:
        """A step not shown live: its tokens' TTFT / TBT join the next live snapshot's "latency"
        (the most recent MAX_CARRIED of them), so the page's latency chart misses few tokens."""
        with self._lock:
            self._carried.extend(latency)

    def publish(self, snapshot: dict, live: bool = True) -> None:
        """Called by the engine thread after a step: every-step subscribers get it; when `live`,
        the latest, the history and the streams too (with the latency of the steps in between,
        `carry`). A failing subscriber is dropped."""
        if not live:
            self.carry(snapshot.get("latency", ()))
        shown, text = snapshot, None
        if live:
            with self._lock:
                carried, self._carried = list(self._carried), deque(maxlen=MAX_CARRIED)
                prev = self._latest[0].get("step") if self._latest else None  # the live one before
            # "prev_step": the live snapshot before this one, so a page tells a step it missed (fetch it
            # from /api/history) from the steps the server never showed live (nothing to fetch)
            shown = {**snapshot, "latency": carried + snapshot.get("latency", []), "prev_step": prev}
            text = json.dumps(shown, separators=(",", ":"))
        with self._lock:
            if live:
                self._last_live = time.monotonic()
                self._latest = (snapshot, text)  # latest(): as published; its JSON: as shown
                self._history.append((snapshot.get("step"), text))
                self._history_bytes += len(text)
                while len(self._history) > self._max_history or (
                    self._history_bytes > self._max_history_bytes and len(self._history) > 1
                ):
                    self._history_bytes -= len(self._history.popleft()[1])
            subscribers = list(self._subscribers)
            streams = list(self._streams) if live else []
        for callback in subscribers:
            try:
                callback(snapshot)
            except Exception as exc:  # a recorder's full disk must not stop the engine
                self.unsubscribe(callback)
                print(f"view: a subscriber failed and was dropped ({exc})", file=sys.stderr)
        for wake in streams:
            wake(shown, text)

    def subscribe(self, callback: Callable[[dict | None], None]) -> Callable[[], None]:
        """`callback(snapshot)` after every step (None once the hub closes); -> unsubscribe."""
        with self._lock:
            self._subscribers.append(callback)
        return lambda: self.unsubscribe(callback)

    def unsubscribe(self, callback) -> None:
        with self._lock:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

    def open_stream(self, wake: Callable[[dict | None, str], None]) -> Callable[[], None] | None:
        """A live stream: `wake(snapshot, its JSON)` per live snapshot, (None, "") on close;
        -> close it, or None when max_streams are open already."""
        with self._lock:
            if len(self._streams) >= self.max_streams:
                return None
            self._streams.append(wake)

        def close() -> None:
            with self._lock:
                if wake in self._streams:
                    self._streams.remove(wake)

        return close

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._streams)

    def latest(self) -> dict | None:
        with self._lock:
            return self._latest[0] if self._latest else None

    def latest_json(self) -> str:
        with self._lock:
            return self._latest[1] if self._latest else "null"

    def history(self) -> list[dict]:
        return json.loads(self.history_json())

    def history_json(self, after: int | None = None) -> str:
        """The recent live snapshots (after step `after`) as one JSON array (joined, never encoded
        again)."""
        with self._lock:
            texts = [t for step, t in self._history if after is None or (step is not None and step > after)]
        return "[" + ",".join(texts) + "]"

    def close(self) -> None:
        """The server is stopping: every open stream ends (so shutdown does not wait on them)."""
        with self._lock:
            self.closed = True
            subscribers, streams = list(self._subscribers), list(self._streams)
        for callback in subscribers:
            try:
                callback(None)
            except Exception:
                pass
        for wake in streams:
            wake(None, "")


class _Stream(StreamingResponse):
    """A streaming response that gives its stream's place back however it ends (even unsent)."""

    def __init__(self, content, release: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _events(hub: ViewHub, request: Request):
    """One browser's stream: at most STREAM_QUEUE snapshots wait for it; a newer one pushes the oldest out."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    waiting: deque[str] = deque(maxlen=STREAM_QUEUE)  # the snapshots (JSON) to send, oldest first
    box: dict = {}  # "end": the hub closed

    def on_publish(snapshot: dict | None, text: str) -> None:  # engine thread
        if snapshot is None:
            box["end"] = True
        else:
            waiting.append(text)  # a reader this far behind skips the oldest: bounded, never a growing queue
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the server's loop is gone
            pass

    latest = hub.latest_json()
    close = hub.open_stream(on_publish)
    if close is None:
        message = (
            f"the live view has {hub.max_streams} streams open already (--max-view-subscribers); "
            "close another page or retry later"
        )
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        return JSONResponse(error, status_code=503)
    if latest != "null":
        waiting.appendleft(latest)

    async def stream():
        try:
            yield "retry: 1000\n\n"
            while not hub.closed and not box.get("end"):
                text = waiting.popleft() if waiting else None
                if text is not None:
                    yield f"event: snapshot\ndata: {text}\n\n"
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield ": keepalive\n\n"
                    if await request.is_disconnected():
                        break
                wake.clear()
        finally:
            close()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return _Stream(stream(), close, media_type="text/event-stream", headers=headers)


def view_routes(hub: ViewHub, guard: Callable[[Request], None] | None = None) -> list[Route]:
    """The page and its API, to add to the server's routes. `guard(request)` raises to refuse a
    data route (the server's --api-key); the page itself holds no data and is always served."""
    check = guard or (lambda request: None)

    async def index(request: Request):
        return HTMLResponse(page_html("live"))

    async def snapshot(request: Request):
        check(request)
        return Response(hub.latest_json(), media_type="application/json")

    async def history(request: Request):
        check(request)
        since = request.query_params.get("since")  # only the steps after this one (a page filling a gap)
        try:
            after = None if since is None else int(since)
        except ValueError:
            error = {"message": f"since must be a step number, got {since!r}", "type": "invalid_request_error"}
            return JSONResponse({"error": {**error, "param": "since", "code": None}}, status_code=400)
        return Response(hub.history_json(after), media_type="application/json")

    async def events(request: Request):
        check(request)
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

    @property
    def num_steps(self) -> int:
        with self._lock:
            return len(self._steps)

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
