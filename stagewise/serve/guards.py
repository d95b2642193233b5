"""What a request must be for `stagewise serve` to answer it, before any route looks at it.

- `HostCheck`: the Host header names this server (an IP literal, localhost, or a name given with
  --allowed-hosts), else 403 — DNS rebinding sends `Host: evil.example` to 127.0.0.1.
- `read_json`: the body is declared JSON (415), at most 16 MiB (413), never pauses longer than
  --idle-timeout (408), and is JSON an API takes (400, `protocol.loads`).
- `check_key` / `check_view_key`: --api-key as a bearer token (/v1), or, for the live view's data,
  as the cookie its page sets (an EventSource cannot send a header).

`ErrorResponse` is OpenAI's error JSON, ASCII-escaped, so a message quoting a lone surrogate encodes.
"""

import asyncio
import hmac
import json
import urllib.parse

from starlette.requests import Request
from starlette.responses import JSONResponse

from stagewise.serve.limits import host_allowed
from stagewise.serve.protocol import APIError, loads, shown

MAX_BODY_BYTES = 16 * 2**20  # a request body larger than this is refused (413) while it arrives
KEY_COOKIE = "stagewise_api_key"  # the live view's page keeps --api-key here (view routes only)


class HostCheck:
    """Refuse (403) a request whose Host header is a name this server was not told about."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
            if len(hosts) > 1 or not host_allowed(hosts[0] if hosts else None, self.allowed):
                host = shown(hosts[0] if len(hosts) == 1 else hosts)
                message = (
                    f"Host {host} is not allowed: use the server's IP address or localhost, or start it with "
                    "--allowed-hosts NAME (a page on another site could otherwise drive it: DNS rebinding)"
                )
                await ErrorResponse(APIError(403, message, param="Host").body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ErrorResponse(JSONResponse):
    """OpenAI's error JSON, ASCII-escaped: a message quoting bad input (a lone surrogate) still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _key_matches(given: str, api_key: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), api_key.encode())


def _bearer_ok(request: Request, api_key: str | None) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and _key_matches(token.strip(), api_key)


def check_key(request: Request, api_key: str | None) -> None:
    if api_key is None or _bearer_ok(request, api_key):
        return
    raise APIError(
        401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
    )


def check_view_key(request: Request, api_key: str | None) -> None:
    """The view's data routes: the bearer header, or the cookie its page sets once asked for the key."""
    if api_key is None or _bearer_ok(request, api_key):
        return
    cookie = request.cookies.get(KEY_COOKIE)
    if cookie is not None and _key_matches(urllib.parse.unquote(cookie), api_key):  # the page encodes it
        return
    raise APIError(
        401,
        "this server has an API key: the live view's page asks for it (or send 'Authorization: Bearer <key>')",
        code="invalid_api_key",
    )


def is_json(content_type: str) -> bool:
    """application/json (any parameters), or a +json type, as FastAPI accepts since CVE-2021-32677."""
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


async def read_json(request: Request, idle_s: float):
    """The body as JSON. Refused: not declared JSON (415), over MAX_BODY_BYTES (413, before it is
    all read), pausing longer than `idle_s` (408), or not JSON an API takes (400)."""
    content_type = request.headers.get("content-type", "")
    if not is_json(content_type):
        raise APIError(
            415, f"the request body must be JSON sent with 'Content-Type: application/json' (got {content_type!r})"
        )
    parts, size, more = [], 0, True
    while more:
        try:
            message = await asyncio.wait_for(request.receive(), idle_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body paused for over {idle_s:g} s (--idle-timeout)") from None
        if message["type"] == "http.disconnect":
            raise APIError(400, "the client went away before its request body was complete")
        part, more = message.get("body", b""), message.get("more_body", False)
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB")
        parts.append(part)
    return loads(b"".join(parts))
