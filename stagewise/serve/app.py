"""The Starlette application of `stagewise serve`: routes, streaming, errors.

    GET  /health                 200 {"status": "ok"} once the engine loop runs
    GET  /v1/models              the one model served
    POST /v1/completions         text in, text out       (stream: server-sent events)
    POST /v1/chat/completions    messages in, a message out, through the model's chat template
    GET  /metrics                Prometheus text (serve/metrics.py)
    GET  /, /api/...             the live view of the scheduler, when a ViewHub is given

A streamed answer is a series of server-sent events, one per text delta, each
a JSON chunk shaped as OpenAI's, then `data: [DONE]`:

    data: {"id": "cmpl-...", "object": "text_completion", "choices": [{"index": 0, "text": " upon", ...}]}

    data: [DONE]

Each handler turns the JSON into a `Request` (tokenizing in a worker thread, so a
long prompt does not stall the event loop), hands it to the engine loop, and
reads its events from an asyncio queue. A client that goes away (the stream's
connection closes, or a non-streaming client hangs up) aborts its request: its
KV blocks are free at the next step. Every refusal is OpenAI's error JSON, and
the server serves on after each one.

`--api-key`: requests under /v1 must send `Authorization: Bearer <key>` (401
otherwise); /health, /metrics and the live view stay open, as in vLLM.
"""

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stagewise.errors import StagewiseError
from stagewise.serve import protocol
from stagewise.serve.engine_loop import EngineLoop
from stagewise.serve.handle import Handle
from stagewise.serve.metrics import CONTENT_TYPE, ServerMetrics
from stagewise.serve.protocol import APIError, ParsedRequest

MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused (413) while it arrives


@dataclasses.dataclass
class ServerState:
    llm: object  # the stagewise LLM being served
    loop: EngineLoop  # the one thread that steps its engine
    metrics: ServerMetrics
    model_name: str  # the name clients pass as "model"
    api_key: str | None  # required as a bearer token under /v1 when set
    hub: object | None = None  # the live view's ViewHub, or None

    def begin_shutdown(self) -> None:
        """A signal arrived: no new requests, and the live view's streams end (nothing waits on them)."""
        self.loop.stop_accepting()
        if self.hub is not None:
            self.hub.close()


def create_app(
    llm,
    *,
    mode: str = "paged",
    max_queue: int = 1024,
    api_key: str | None = None,
    hub=None,
    model_name: str | None = None,
) -> Starlette:
    """An app serving `llm`; its engine loop starts and stops with the app (its lifespan)."""
    name = model_name or llm.describe()["name"]
    metrics = ServerMetrics(name)
    state = ServerState(llm, EngineLoop(llm, mode, max_queue, metrics, hub), metrics, name, api_key, hub)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop.start()
        try:
            yield
        finally:
            if hub is not None:
                hub.close()
            state.loop.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    if hub is not None:
        from stagewise.serve.view import view_routes

        routes += view_routes(hub)
    handlers = {APIError: api_error, HTTPException: http_error, Exception: unexpected_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = state
    return app


# ---- errors ----


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown path 404, wrong method 405) in OpenAI's error shape."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return JSONResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    return JSONResponse(err.body(), status_code=500)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _check_key(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
        raise APIError(
            401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
        )


# ---- small routes ----


async def health(request: Request) -> JSONResponse:
    loop = _state(request).loop
    if not loop.alive():
        return JSONResponse({"status": "error", "error": loop.failure or "the engine loop is not running"}, 503)
    return JSONResponse({"status": "ok"})


async def models(request: Request) -> JSONResponse:
    state = _state(request)
    _check_key(request, state)
    card = {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "stagewise",
        "max_model_len": state.llm.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


async def metrics_page(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


# ---- completions ----


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def _read_json(request: Request):
    """The body as JSON; one larger than MAX_BODY_BYTES is refused (413) before it is all read."""
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB")
        parts.append(part)
    raw = b"".join(parts)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from None


async def _complete(request: Request, chat: bool) -> Response:
    state = _state(request)
    _check_key(request, state)
    body = await _read_json(request)
    parsed = protocol.parse_request(body, chat=chat, model_name=state.model_name)
    req = await run_in_threadpool(_make_request, state, parsed)
    handle = Handle(req, asyncio.get_running_loop())
    state.loop.submit(handle)  # 503 when the queue is full
    rid = protocol.new_id(chat)
    if parsed.stream:
        return StreamingResponse(
            _stream(state, handle, parsed, rid),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(request, state, handle, parsed, rid)


def _make_request(state: ServerState, parsed: ParsedRequest):
    """Tokenize and check one request (a worker thread); APIError 400 names the field at fault."""
    llm = state.llm
    field = "messages" if parsed.chat else "prompt"
    try:
        req = llm.make_request(parsed.prompt, parsed.params, chat=parsed.chat)
    except StagewiseError as exc:
        param = "max_tokens" if "max_tokens" in str(exc) else field
        raise APIError(400, str(exc), param=param) from None
    engine = llm.engine if state.loop.mode == "paged" else None
    if not parsed.max_tokens_given:  # chat without max_tokens: the rest of the context, as vLLM does
        room = llm.max_model_len - req.num_prompt_tokens
        if engine is not None:  # and what the KV cache can hold
            bm = engine.block_manager
            room = min(room, bm.num_blocks * bm.block_size - req.num_prompt_tokens)
        if room < 1:
            raise APIError(400, f"the prompt ({req.num_prompt_tokens} tokens) leaves no room to generate", field)
        req.params = dataclasses.replace(req.params, max_tokens=room)
    if engine is not None:
        try:
            engine.check_fits(req)
        except StagewiseError as exc:
            raise APIError(400, str(exc), param="max_tokens") from None
    return req


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failure(event) -> APIError:
    if event.finish_reason == "error":
        return APIError(500, event.error or "the request failed in an engine step")
    return APIError(503, "the server stopped before the request finished", kind="server_error")


async def _stream(state: ServerState, handle: Handle, parsed: ParsedRequest, rid: str):
    """Server-sent events: a chunk per text delta, the finish reason, usage if asked, [DONE]."""
    model, chat = state.model_name, parsed.chat
    try:
        if chat:  # OpenAI's first chat chunk names the role
            yield _sse(protocol.chunk_object(rid, model, chat, "", None, first=True))
        while True:
            event = await handle.events.get()
            if event.finished and event.finish_reason in ("error", "abort"):
                yield _sse(_failure(event).body())
                break
            if event.text or event.finished:
                reason = event.finish_reason if event.finished else None
                yield _sse(protocol.chunk_object(rid, model, chat, event.text, reason))
            if event.finished:
                if parsed.include_usage:
                    counts = _usage(handle)
                    yield _sse(protocol.usage_chunk(rid, model, chat, counts))
                break
        yield "data: [DONE]\n\n"
    finally:  # the client left (the task is cancelled here) or the stream ended
        state.loop.abort(handle)  # a no-op for a finished request


async def _whole(request: Request, state: ServerState, handle: Handle, parsed: ParsedRequest, rid: str):
    """Collect the whole answer; a client that hangs up meanwhile aborts the request."""

    async def collect() -> tuple[str, object]:
        parts = []
        while True:
            event = await handle.events.get()
            parts.append(event.text)
            if event.finished:
                return "".join(parts), event

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector, watcher = asyncio.ensure_future(collect()), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({collector, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
            state.loop.abort(handle)
    if not collector.done() or collector.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    text, last = collector.result()
    if last.finish_reason in ("error", "abort"):
        raise _failure(last)
    return JSONResponse(
        protocol.completion_object(rid, state.model_name, parsed.chat, text, last.finish_reason, _usage(handle))
    )


def _usage(handle: Handle) -> dict:
    req = handle.request  # finished: the engine thread no longer changes it
    return protocol.usage(req.num_prompt_tokens, len(req.output_token_ids))
