"""`stagewise serve` as a child process for a benchmark: a free loopback port, ready when /health is.

    with ServerProcess(["--model", "tiny", "--mode", "paged"], log_path) as server:
        ...  # server.url is "http://127.0.0.1:<port>"
    server.exit_code  # after SIGTERM: the server drains, then exits (0 or 143)

The benchmark's clients and the server are separate processes that talk only HTTP, exactly as a
user's client and a deployed server do. The server's own output goes to a log file (never a pipe,
which would block the server once it filled); when the server dies before it is ready, the error
names its exit status and the last line it printed.
"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from stagewise.errors import StagewiseError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it; another program could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


class ServerProcess:
    """`python -m stagewise.cli serve ARGS --host 127.0.0.1 --port P`, started on enter, stopped on exit."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, ready_timeout_s: float = 600.0):
        self.args = list(args)  # serve's options, without --host / --port
        self.log_path = Path(log_path)  # the server's stdout and stderr
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "STAGEWISE_QUIET": "1", **(env or {})}
        self.ready_timeout_s = ready_timeout_s  # loading a model may take a while on a busy CPU
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.command: list[str] = []
        self.exit_code: int | None = None
        self.ready_s: float | None = None  # seconds from the start to the first healthy answer
        self._started = 0.0  # perf_counter time of the last start
        self._terminated = False  # SIGTERM sent to the current process

    def start(self) -> "ServerProcess":
        """Launch the server (returns at once; `wait_ready` waits for it)."""
        port = free_port()
        self.command = [sys.executable, "-m", "stagewise.cli", "serve", *self.args]
        self.command += ["--host", "127.0.0.1", "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        self._started = time.perf_counter()
        self._terminated = False
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self) -> "ServerProcess":
        """Block until GET /health answers 200 (restarting on another port if this one was taken)."""
        try:
            for _attempt in range(3):  # another program may take the free port before the server binds it
                if self._wait_ready():
                    return self
                self.start()
        except BaseException:
            self.stop()
            raise
        raise StagewiseError(
            f"the server could not bind a free port three times; last line: {last_line(self.log_path)}"
        )

    def __enter__(self) -> "ServerProcess":
        return self.start().wait_ready()

    def _wait_ready(self) -> bool:
        """True once GET /health answers 200; False when the port was taken; raises when the server died."""
        import httpx

        while time.perf_counter() - self._started < self.ready_timeout_s:
            code = self.proc.poll()
            if code is not None:
                self.exit_code = code
                line = last_line(self.log_path)
                if "in use" in line.lower():
                    return False
                raise StagewiseError(f"the server exited with status {code} before it was ready: {line}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.ready_s = time.perf_counter() - self._started
                    return True
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)
        raise StagewiseError(
            f"the server did not answer /health within {self.ready_timeout_s:.0f} s (log: {self.log_path})"
        )

    def terminate(self) -> None:
        """Send SIGTERM once (the server drains, then exits; a second signal would cut the drain short);
        `stop` waits for it."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, wait for the drain, SIGKILL only if it does not end; returns the exit status."""
        if self.proc is None:
            return self.exit_code
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode
        self.proc = None
        return self.exit_code

    def __exit__(self, *exc) -> None:
        self.stop()
