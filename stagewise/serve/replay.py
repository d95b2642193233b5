"""Replaying a recorded run: read a trace JSON, check it can be replayed, serve it to the page.

A run recorded by `trace ... --format json --out run.json` (paged mode) or by
`stagewise serve --record run.json` is a trace document of format version 2:
each step carries the engine's snapshot after it under "view". `load_run`
refuses, in one line, anything the page could not replay: a missing or
unreadable file, text that is not JSON, a JSON that is not a stagewise trace,
an older format version, or a trace without views (mode kv or naive have no
blocks to show). `replay_app` serves the page in replay mode at `/` and the
run at `/api/run`, stripped to what the page draws (the stage records of a
trace can be megabytes and the page never reads them). As the live server,
it answers only an IP literal or localhost in the Host header (the run holds
the prompts' text: a page whose name was re-pointed here must not read it).
"""

import json
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from stagewise.errors import StagewiseError
from stagewise.serve.guards import HostCheck
from stagewise.serve.view import page_html
from stagewise.trace.export import SCHEMA_NAME, SCHEMA_VERSION

VIEW_KEYS = ("step", "queues", "requests", "kv", "budget", "latency")  # what the page reads of a view


def load_run(path: str | Path) -> dict:
    """The run at `path`, reduced to {schema, version, model, summary, steps: [{index, view}]}."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise StagewiseError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise StagewiseError(f"{path} is a folder, not a trace JSON") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise StagewiseError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise StagewiseError(f"{path} is not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA_NAME:
        raise StagewiseError(f"{path} is not a stagewise trace (write one with: trace ... --format json --out FILE)")
    version = doc.get("version")
    if version != SCHEMA_VERSION:
        raise StagewiseError(
            f"{path} is trace format version {version}; stagewise view replays version {SCHEMA_VERSION} "
            "(record the run again with this stagewise)"
        )
    steps = doc.get("steps")
    if not isinstance(steps, list):
        raise StagewiseError(f"{path}: 'steps' is not a list")
    out = []
    for i, step in enumerate(steps):
        view = step.get("view") if isinstance(step, dict) else None
        if view is None:
            continue
        if not isinstance(view, dict) or any(k not in view for k in VIEW_KEYS):
            raise StagewiseError(f"{path}: step {i} has a damaged view (it needs {', '.join(VIEW_KEYS)})")
        out.append({"index": step.get("index", i), "view": view})
    if not out:
        mode = (doc.get("model") or {}).get("mode", "?")
        raise StagewiseError(f"{path} has no engine views to replay (traced in mode {mode}; replay needs --mode paged)")
    model = doc.get("model") if isinstance(doc.get("model"), dict) else {}
    return {"schema": SCHEMA_NAME, "version": version, "model": model, "summary": doc.get("summary"), "steps": out}


def replay_app(run: dict, name: str) -> Starlette:
    """The page in replay mode at `/`, and `run` (from `load_run`) at `/api/run`."""
    page = page_html("replay", run_name=name)

    async def index(request: Request):
        return HTMLResponse(page)

    async def run_json(request: Request):
        return JSONResponse(run)

    routes = [Route("/", index, methods=["GET"]), Route("/api/run", run_json, methods=["GET"])]
    return Starlette(routes=routes, middleware=[Middleware(HostCheck, allowed=())])
