"""A `stagewise serve` app run by a test: uvicorn in a thread, on a free loopback port.

    with running_server(LLM(tiny)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

The server is the real one (the same app, engine loop and uvicorn as `stagewise serve`), minus the
command line and the signal handling, which tests/serve/test_server_cli.py checks on a subprocess.
"""

import contextlib
import threading
import time

import uvicorn

from stagewise.serve import server as serve_server
from stagewise.serve.app import create_app


class RunningServer:
    def __init__(self, app, sock):
        self.app = app
        self.url = serve_server.url_of(sock)
        self.state = app.state.server  # llm, loop (the engine loop), metrics
        config = serve_server.uvicorn_config(app, timeout_graceful_shutdown=2)  # the server's protocol and timeouts
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._sock = sock

    def start(self) -> "RunningServer":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(15)
        self._sock.close()

    def engine_idle(self, timeout: float = 10.0) -> bool:
        """Wait until the engine holds no request and every KV block is free; True if it got there."""
        runner = self.state.llm.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.loop.num_in_flight() == 0 and blocks_all_free(runner):
                return True
            time.sleep(0.02)
        return False

    def engine_idle_of_requests(self, timeout: float = 10.0) -> bool:
        """Wait until the engine holds no request and no request holds a KV block (a radix prefix
        cache may keep blocks for later requests); True if it got there."""
        runner = self.state.llm.engine
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            bm = runner.block_manager
            idle = self.state.loop.num_in_flight() == 0 and not runner.scheduler.has_unfinished()
            if idle and not bm.req_blocks and not runner.cache.row_of:
                return True
            time.sleep(0.02)
        return False


def blocks_all_free(runner) -> bool:
    """No request in the scheduler, every KV block in the free pool, no block-table row held."""
    if runner is None:  # static batching: nothing outlives a batch
        return True
    bm = runner.block_manager
    idle = not runner.scheduler.has_unfinished()
    return idle and bm.num_free_blocks == bm.num_blocks and not bm.req_blocks and not runner.cache.row_of


@contextlib.contextmanager
def running_server(llm, **app_options):
    sock = serve_server.bind("127.0.0.1", 0)
    server = RunningServer(create_app(llm, **app_options), sock).start()
    try:
        yield server
    finally:
        server.stop()
