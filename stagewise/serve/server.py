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
"""

import socket
import sys
import threading

import uvicorn

from stagewise.errors import StagewiseError


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (IPv4 or IPv6, as the host resolves)."""
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise StagewiseError(f"--port must be in 0..65535, got {port!r}")
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
    config = uvicorn.Config(
        app,
        log_level=log_level,
        # a backstop: the engine loop has aborted every request by drain_timeout, so the handlers end
        # by themselves; only one stuck elsewhere is cancelled (their requests abort then too)
        timeout_graceful_shutdown=drain_timeout + 10,
        lifespan="on",
        access_log=False,
    )
    server = _Server(config, app.state.server, drain_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        app.state.server.loop.stop()  # a second Ctrl-C skips the lifespan's own stop
        sock.close()
        sys.stdout.flush()
