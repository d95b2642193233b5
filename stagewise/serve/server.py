"""Run the app under uvicorn: bind the socket, print the URL, drain on Ctrl-C / SIGTERM.

The socket is bound here, before uvicorn starts, so a port in use or a host
that does not resolve is one clear line (a `StagewiseError`) instead of a log
record and exit 1; port 0 asks the system for a free port, and the URL line
says which one it gave.

Stopping (Ctrl-C, or SIGTERM from `kill` or a job scheduler): the server stops
accepting connections and new requests (503), lets the requests in flight
finish for up to `drain_timeout` seconds, then aborts what is left (their
streams end, their KV blocks are freed) and returns. uvicorn then raises the
signal again, so the command ends as every stagewise command does on a
signal: one line, exit 130 (Ctrl-C) or 143 (SIGTERM). A second Ctrl-C skips
the wait.

Slow clients: uvicorn closes a connection idle between two requests after a
few seconds (its keep-alive), but not one that never finishes its request's
headers. `HeaderTimeoutProtocol` does: from the moment a connection opens (or
its next request begins), the request line and headers must be complete
within `header_timeout` seconds, or the connection is closed — a few hundred
idle or trickling sockets cannot pin the server's file descriptors and memory.
A request body that pauses is the app's to refuse (408, `--idle-timeout`).
"""

import asyncio
import math
import socket
import sys
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from stagewise.errors import StagewiseError


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, with a deadline for each request's headers."""

    header_timeout: float = 60.0  # seconds; set on the subclass `protocol_class` makes

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._start_header_timer()

    def _start_header_timer(self) -> None:
        self._cycle_at_start = self.cycle  # a new cycle object means the headers arrived
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        between = self.cycle is None or self.cycle.response_complete
        if self._header_timer is None and between:  # the first bytes of the next request
            self._start_header_timer()
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._cycle_at_start:
            self._stop_header_timer()

    def connection_lost(self, exc) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is self._cycle_at_start and not self.transport.is_closing():
            self.transport.close()  # no request to answer yet: the connection just ends


def protocol_class(header_timeout: float) -> type[HeaderTimeoutProtocol]:
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": header_timeout})


def uvicorn_config(app, *, log_level: str = "warning", **options) -> uvicorn.Config:
    """The uvicorn settings `stagewise serve` runs `app` with (its limits: app.state.server.limits)."""
    limits = app.state.server.limits
    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="on",
        access_log=False,
        http=protocol_class(limits.header_timeout_s),
        **options,
    )


def check_drain_timeout(seconds: float) -> float:
    if not (isinstance(seconds, int | float) and 0 <= seconds < math.inf):
        raise StagewiseError(f"--drain-timeout must be a finite number of seconds >= 0, got {seconds}")
    return seconds


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (IPv4 or IPv6, as the host resolves; "[::1]" as "::1")."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise StagewiseError(f"--port must be in 0..65535, got {port!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # a URL's spelling of an IPv6 address
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise StagewiseError(f"cannot use host '{host}': {exc}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise StagewiseError(f"cannot listen on {host}:{port}: {reason}") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server; on the first signal the engine loop refuses new requests and, after the
    drain time, aborts the ones left, so every handler ends by itself (uvicorn waits for them)."""

    def __init__(self, config: uvicorn.Config, state, drain_timeout: float):
        super().__init__(config)
        self._state = state  # the app's ServerState
        self._engine_loop = state.loop
        self._drain_timeout = drain_timeout
        self._timer = None

    def handle_exit(self, sig, frame) -> None:
        self._state.begin_shutdown()
        if self._timer is None:
            self._timer = threading.Timer(self._drain_timeout, self._engine_loop.abort_all)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def run(app, sock: socket.socket, drain_timeout: float = 5.0, log_level: str = "warning") -> None:
    """Serve `app` on `sock` until a signal; see the module docstring for how it stops."""
    check_drain_timeout(drain_timeout)
    # a backstop: the engine loop has aborted every request by drain_timeout, so the handlers end
    # by themselves; only one stuck elsewhere is cancelled (their requests abort then too)
    config = uvicorn_config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout + 10)
    server = _Server(config, app.state.server, drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        app.state.server.loop.stop()  # a second Ctrl-C skips the lifespan's own stop
        sock.close()
        sys.stdout.flush()
