"""`stagewise view run.json`: replay a recorded run in the browser, step by step.

    stagewise trace "Hello" "Tell me a story" --max-tokens 32 --format json --out run.json
    stagewise view run.json            # prints http://127.0.0.1:8001/ ; open it, drag the slider

The run is a trace JSON of format version 2 from a paged run (`trace --format
json`, or `stagewise serve --record`). The page is the one `stagewise serve`
shows live at `/`: queues, requests, the KV block pool and the charts, here
for the step the slider points at. Nothing leaves the machine: the page is one
file with no external scripts or fonts.
"""

import signal
import sys
from pathlib import Path

import typer


def view(
    run: Path = typer.Argument(
        ..., help="a trace JSON (version 2) of a paged run: trace --format json / serve --record"
    ),
    host: str = typer.Option("127.0.0.1", help="address to listen on; 0.0.0.0 = every network interface"),
    port: int = typer.Option(8001, help="TCP port (0: any free port, printed on start)"),
):
    """Replay a recorded run (a trace JSON) in the browser: the scheduler's queues and the KV blocks per step."""
    import uvicorn

    from stagewise.serve import server
    from stagewise.serve.replay import load_run, replay_app

    doc = load_run(run)  # first: a bad file is one line, exit 2, before any socket
    sock = server.bind(host, port)
    app = replay_app(doc, run.name)
    print(f"replaying {run} ({len(doc['steps'])} steps) at {server.url_of(sock)}/  (Ctrl-C stops)", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
    replay = _ReplayServer(config)
    try:
        replay.run(sockets=[sock])
    finally:
        sock.close()
        sys.stdout.flush()
    if replay.stopped_by is not None:  # uvicorn stops on a signal and raises it again; if it did not, do it here
        signal.raise_signal(replay.stopped_by)


class _ReplayServer:
    """uvicorn's server, remembering the signal that stopped it (Ctrl-C -> exit 130, SIGTERM -> 143)."""

    def __init__(self, config):
        import uvicorn

        outer = self
        self.stopped_by = None

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                outer.stopped_by = sig
                super().handle_exit(sig, frame)

        self._server = Server(config)

    def run(self, sockets) -> None:
        self._server.run(sockets=sockets)
