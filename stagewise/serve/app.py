"""The Starlette application of `stagewise serve`: routes, streaming, errors.

    GET  /health                 200 {"status": "ok"} while the engine can serve, else 503 and why
    GET  /v1/models              the one model served (/v1/models/{id}: its card)
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
reads its events from an asyncio queue. With `n` > 1 it hands over n requests,
the prompt's samples (the engine shares the prompt's KV blocks among them), and
reads their queues together: choice i is sample i, streamed chunks of the
samples interleave as their tokens come, each chunk naming its choice index. A client that goes away (the stream's
connection closes, or a non-streaming client hangs up) aborts its request: its
KV blocks are free at the next step. Every refusal is OpenAI's error JSON, and
the server serves on after each one.

`--api-key`: requests under /v1 must send `Authorization: Bearer <key>` (401
otherwise), and so must the live view's data routes (/api/...), which show
the tail of every request's output — or send the key as the cookie the page
sets when it asks for it (an EventSource cannot send headers). /health,
/metrics and the page itself stay open, as in vLLM.

What a web page may do: a request body must be declared JSON
(`Content-Type: application/json`, 415 otherwise), which a cross-site form or
`fetch` cannot send without the server's consent (a CORS preflight this server
never grants). And the Host header must be an IP literal, `localhost` or a
name given with `--allowed-hosts` (403 otherwise): a page on evil.example that
re-points its name at 127.0.0.1 (DNS rebinding) still sends `Host:
evil.example`. The limits that keep one client from slowing the others are in
`serve/limits.py`.
"""

import asyncio
import contextlib
import dataclasses
import json
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from stagewise.errors import StagewiseError
from stagewise.serve import logprobs as serve_logprobs
from stagewise.serve import protocol
from stagewise.serve.engine_loop import EngineLoop
from stagewise.serve.guards import ErrorResponse, HostCheck, check_key, check_view_key, read_json
from stagewise.serve.handle import Handle, events_of
from stagewise.serve.limits import ServerLimits
from stagewise.serve.metrics import CONTENT_TYPE, ServerMetrics
from stagewise.serve.protocol import APIError, ParsedRequest


@dataclasses.dataclass
class ServerState:
    llm: object  # the stagewise LLM being served
    loop: EngineLoop  # the one thread that steps its engine
    metrics: ServerMetrics
    model_name: str  # the name clients pass as "model"
    api_key: str | None  # required as a bearer token under /v1 (and by the view's data) when set
    hub: object | None = None  # the live view's ViewHub, or None
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)

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
    limits: ServerLimits | None = None,
) -> Starlette:
    """An app serving `llm`; its engine loop starts and stops with the app (its lifespan)."""
    name = model_name or llm.describe()["name"]
    metrics = ServerMetrics(name)
    limits = limits or ServerLimits()
    loop = EngineLoop(llm, mode, max_queue, metrics, hub)
    state = ServerState(llm, loop, metrics, name, api_key, hub, limits)

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
        Route("/v1/models/{model_id:path}", model_card, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    if hub is not None:
        from stagewise.serve.view import view_routes

        routes += view_routes(hub, guard=lambda request: check_view_key(request, state.api_key))
    handlers = {APIError: api_error, HTTPException: http_error, Exception: unexpected_error}
    middleware = [Middleware(HostCheck, allowed=limits.allowed_hosts)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers, middleware=middleware)
    app.state.server = state
    return app


# ---- errors ----


async def api_error(request: Request, exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    if exc.status == 408:  # the body never came whole: this connection cannot carry another request
        headers = {"Connection": "close"}
    return ErrorResponse(exc.body(), status_code=exc.status, headers=headers)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown path 404, wrong method 405) in OpenAI's error shape."""
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return ErrorResponse(APIError(exc.status_code, message).body(), status_code=exc.status_code)


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    err = APIError(500, f"internal error: {type(exc).__name__}: {exc}")
    return ErrorResponse(err.body(), status_code=500)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _cannot_serve(state: ServerState) -> str | None:
    """Why the engine cannot serve (its thread ended, a tensor-parallel rank died), or None."""
    loop = state.loop
    if not loop.alive():
        return loop.failure or "the engine loop is not running"
    model_failure = getattr(state.llm.model, "failure", None)  # a tensor-parallel model's ranks
    return model_failure() if callable(model_failure) else None


# ---- small routes ----


async def health(request: Request) -> JSONResponse:
    failure = _cannot_serve(_state(request))
    if failure is not None:
        return ErrorResponse({"status": "error", "error": failure}, 503)
    return JSONResponse({"status": "ok"})


def _card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "stagewise",
        "max_model_len": state.llm.max_model_len,
    }


async def models(request: Request) -> JSONResponse:
    state = _state(request)
    check_key(request, state.api_key)
    return JSONResponse({"object": "list", "data": [_card(state)]})


async def model_card(request: Request) -> JSONResponse:
    """GET /v1/models/{id}: the served model's card (the openai client's models.retrieve), else 404."""
    state = _state(request)
    check_key(request, state.api_key)
    model_id = request.path_params["model_id"]
    if model_id != state.model_name:
        message = f"the model {protocol.shown(model_id)} does not exist; this server serves '{state.model_name}'"
        raise APIError(404, message, "model", "model_not_found")
    return JSONResponse(_card(state))


async def metrics_page(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


# ---- completions ----


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def _complete(request: Request, chat: bool) -> Response:
    state = _state(request)
    check_key(request, state.api_key)
    body = await read_json(request, state.limits.idle_timeout_s)
    parsed = protocol.parse_request(body, chat=chat, model_name=state.model_name, limits=state.limits)
    failure = _cannot_serve(state)
    if failure is not None:  # e.g. a tensor-parallel rank died: every step would fail
        raise APIError(503, f"the server cannot serve: {failure}")
    reqs = await run_in_threadpool(_make_requests, state, parsed)
    handles = [Handle(req, asyncio.get_running_loop()) for req in reqs]
    try:
        for handle in handles:
            state.loop.submit(handle)  # 503 when the queue is full
    except APIError:
        for handle in handles:  # the samples already queued leave with the refused one
            state.loop.abort(handle)
        raise
    rid = protocol.new_id(chat)
    if parsed.stream:
        return StreamingResponse(
            _stream(state, handles, parsed, rid),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(request, state, handles, parsed, rid)


def _make_requests(state: ServerState, parsed: ParsedRequest) -> list:
    """The request's n samples (n = 1: one request); the first carries the prompt, the others
    share it (LLM._more_samples)."""
    first = _make_request(state, parsed)
    return [first, *state.llm._more_samples(first)]


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
            engine.check_fits(req)  # n samples: n x (prompt + max_tokens) must fit the pool
        except StagewiseError as exc:
            raise APIError(400, str(exc), param="n" if str(exc).startswith("n=") else "max_tokens") from None
    return req


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _failure(event) -> APIError:
    if event.finish_reason == "error":
        return APIError(500, event.error or "the request failed in an engine step")
    return APIError(503, "the server stopped before the request finished", kind="server_error")


async def _stream(state: ServerState, handles: list[Handle], parsed: ParsedRequest, rid: str):
    """Server-sent events: a chunk per text delta of each choice, its finish reason, usage if
    asked, [DONE]. A sample that fails ends the whole stream with the error."""
    model, chat = state.model_name, parsed.chat
    events = events_of(handles)
    tokens, sent, offset = [0] * len(handles), [0] * len(handles), [0] * len(handles)  # per choice: tokens
    # arrived, tokens whose logprobs went out, characters sent
    try:
        if chat:  # OpenAI's first chat chunk of each choice names the role
            for index in range(len(handles)):
                yield _sse(protocol.chunk_object(rid, model, chat, "", None, first=True, index=index))
        failed = False
        async for index, event in events:
            if event.finished and event.finish_reason in ("error", "abort"):
                yield _sse(_failure(event).body())
                failed = True
                break
            tokens[index] += event.token_id is not None
            if event.text or event.finished:
                reason = event.finish_reason if event.finished else None
                lp = None
                if parsed.params.logprobs is not None:  # the choice's tokens since its last chunk
                    lp = serve_logprobs.of_request(
                        state.llm.tokenizer, handles[index].request, chat, sent[index], tokens[index], offset[index]
                    )
                    sent[index], offset[index] = tokens[index], offset[index] + len(event.text)
                yield _sse(protocol.chunk_object(rid, model, chat, event.text, reason, index=index, logprobs=lp))
        if not failed and parsed.include_usage:
            yield _sse(protocol.usage_chunk(rid, model, chat, _usage(handles)))
        yield "data: [DONE]\n\n"
    finally:  # the client left (the task is cancelled here) or the stream ended
        await events.aclose()
        for handle in handles:
            state.loop.abort(handle)  # a no-op for a finished request


async def _whole(request: Request, state: ServerState, handles: list[Handle], parsed: ParsedRequest, rid: str):
    """Collect the whole answer (every sample's); a client that hangs up meanwhile aborts it."""

    async def collect() -> list[tuple[str, object]]:
        parts: list[list[str]] = [[] for _ in handles]
        last: list = [None] * len(handles)
        async for index, event in events_of(handles):
            parts[index].append(event.text)
            if event.finished:
                last[index] = event
                if event.finish_reason in ("error", "abort"):
                    break  # the answer cannot be whole
        return [("".join(p), e) for p, e in zip(parts, last)]

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
        if not collector.done() or collector.cancelled() or any(e is None for _, e in collector.result()):
            for handle in handles:
                state.loop.abort(handle)
    if not collector.done() or collector.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    answers = collector.result()
    for _, last in answers:
        if last is not None and last.finish_reason in ("error", "abort"):
            raise _failure(last)
    counts = _usage(handles)
    lps = None
    if parsed.params.logprobs is not None:
        lps = [
            serve_logprobs.of_request(state.llm.tokenizer, h.request, parsed.chat, 0, len(h.request.output_token_ids))
            for h in handles
        ]
    return JSONResponse(
        protocol.completion_object(
            rid, state.model_name, parsed.chat, [(t, e.finish_reason) for t, e in answers], counts, lps
        )
    )


def _usage(handles: list[Handle]) -> dict:
    """The prompt once (its samples share it), every sample's generated tokens."""
    reqs = [h.request for h in handles]  # finished: the engine thread no longer changes them
    return protocol.usage(reqs[0].num_prompt_tokens, sum(len(r.output_token_ids) for r in reqs))
