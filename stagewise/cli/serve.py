"""`stagewise serve`: an OpenAI-compatible HTTP server over the engine (stagewise/serve/).

    stagewise serve --model smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

`--mode paged` (the default) is continuous batching: a request that arrives
while others decode joins the running batch at the next engine step. `--mode
kv` is the static-batching baseline: a batch is formed from the requests
waiting when it starts (up to --max-num-seqs), runs to completion, and only
then does the next batch start.
"""

import sys

import typer

from stagewise.cli import options

SERVE_MODES = ("paged", "kv")


def serve(
    model: str = options.MODEL,
    host: str = typer.Option("127.0.0.1", help="address to listen on; 0.0.0.0 = every network interface"),
    port: int = typer.Option(8000, help="TCP port (0: any free port, printed on start)"),
    api_key: str | None = typer.Option(
        None, "--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests (default: no authentication)"
    ),
    mode: str = typer.Option(
        "paged",
        help="paged: continuous batching (requests join the running batch each step); kv: static batching, "
        "the baseline (a batch is formed from the requests waiting when it starts and runs to completion "
        "before the next one)",
    ),
    max_queue: int = typer.Option(1024, "--max-queue", help="most requests waiting for a seat; more get HTTP 503"),
    drain_timeout: float = typer.Option(
        5.0, "--drain-timeout", help="on Ctrl-C / SIGTERM: seconds to let requests in flight finish, then abort"
    ),
    record: str | None = typer.Option(
        None, "--record", help="record every engine step to this trace JSON (replay: stagewise view FILE)"
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="the model name clients send (default: the model's own)"
    ),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="engine: most requests running at once"),
    token_budget: int = typer.Option(512, "--token-budget", help="engine: most tokens per step"),
    kv_blocks: int | None = typer.Option(
        None, "--kv-blocks", help="engine: KV cache size in blocks (default: a share of free memory)"
    ),
    max_model_len: int | None = typer.Option(
        None, "--max-model-len", help="engine: longest prompt + output (default: the model's limit)"
    ),
    prefix_caching: bool = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="engine: reuse prompt KV"),
    backend: str = options.BACKEND,
    stage_backend: list[str] = options.STAGE_BACKEND,
    special_tokens: bool = options.SPECIAL_TOKENS,
    device: str | None = options.DEVICE,
    dtype: str | None = options.DTYPE,
    tensor_parallel_size: int = options.TENSOR_PARALLEL_SIZE,
    recalibrate: bool = options.RECALIBRATE,
    quantization: str = options.QUANTIZATION,
    speculative_config: str | None = options.SPECULATIVE_CONFIG,
    speculative: str | None = options.SPECULATIVE,
):
    """Serve the model over HTTP with the OpenAI API (completions, chat, streaming), /metrics and a live view."""
    from stagewise.config import EngineConfig
    from stagewise.errors import StagewiseError
    from stagewise.serve import server
    from stagewise.serve.app import create_app

    if mode not in SERVE_MODES:
        raise StagewiseError(f"--mode must be paged or kv, got '{mode}'")
    if max_queue < 1:
        raise StagewiseError(f"--max-queue must be >= 1, got {max_queue}")
    if not drain_timeout >= 0:
        raise StagewiseError(f"--drain-timeout must be >= 0 seconds, got {drain_timeout}")
    spec = options.speculative_arg(speculative_config, speculative)
    sock = server.bind(host, port)  # first: a port in use is known before the model loads
    engine_config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=token_budget,
        num_kv_blocks=kv_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
    )
    llm = options.load_llm(
        model,
        dtype=dtype,
        stage_backend=stage_backend,
        backend=backend,
        mode=mode,
        device=device,
        engine_config=engine_config,
        special_tokens=special_tokens,
        tensor_parallel_size=tensor_parallel_size,
        recalibrate=recalibrate,
        quantization=quantization,
        speculative_config=spec,
    )
    with llm:
        hub, recorder = _view(llm, mode, record)
        app = create_app(llm, mode=mode, max_queue=max_queue, api_key=api_key, hub=hub, model_name=served_model_name)
        name = app.state.server.model_name
        print(f"serving {name} ({mode}) at {server.url_of(sock)}  (OpenAI API under /v1; Ctrl-C stops)", flush=True)
        if host in ("0.0.0.0", "::", "") and api_key is None:
            print("warning: listening on every interface with no authentication (add --api-key KEY)", file=sys.stderr)
        try:
            server.run(app, sock, drain_timeout=drain_timeout)
        except KeyboardInterrupt:  # stopped by Ctrl-C / SIGTERM: every request has ended by now
            _ignore_further_signals()
            raise
        finally:
            if recorder is not None:
                recorder.close()


def _ignore_further_signals() -> None:
    """The server has stopped and the command is exiting (130 / 143): a second signal now (a
    supervisor that sends SIGTERM twice) would only cut the exit short, with a traceback from
    some finalizer or death by the signal. Ignored handlers survive Python's finalization."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _view(llm, mode: str, record: str | None):
    """The live view's hub (paged mode: it shows the paged engine), and a recorder when asked for."""
    from stagewise.errors import StagewiseError

    if mode != "paged":
        if record is not None:
            raise StagewiseError("--record needs --mode paged (the view shows the paged engine's state)")
        return None, None
    try:
        from stagewise.serve.view import RunRecorder, ViewHub
    except ImportError:  # the live view is not part of this build
        if record is not None:
            raise StagewiseError("--record needs the live view (stagewise/serve/view.py)") from None
        return None, None
    hub = ViewHub()
    recorder = None
    if record is not None:
        recorder = RunRecorder(record, llm.describe())
        hub.subscribe(recorder)
    return hub, recorder
