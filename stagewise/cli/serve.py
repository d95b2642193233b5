"""`stagewise serve`: an OpenAI-compatible HTTP server over the engine (stagewise/serve/).

    stagewise serve --model smollm2-135m --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

`--mode paged` (the default) is continuous batching: a request that arrives
while others decode joins the running batch at the next engine step. `--mode
kv` is the static-batching baseline: a batch is formed from the requests
waiting when it starts (up to --max-num-seqs), runs to completion, and only
then does the next batch start.

The limits that keep one request or client from slowing the others (stop
strings, view subscribers, timeouts, ...) are flags too; their defaults and
what each bounds are in `stagewise/serve/limits.py`.
"""

import sys

import typer

from stagewise.cli import options

SERVE_MODES = ("paged", "kv")


def _limit(name: str, flag: str, help: str):
    from stagewise.serve.limits import ServerLimits

    return typer.Option(getattr(ServerLimits, name), flag, help=help)


def serve(
    model: str = options.MODEL,
    host: str = typer.Option("127.0.0.1", help="address to listen on; 0.0.0.0 (or ::) = every network interface"),
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
    allowed_hosts: list[str] = typer.Option(
        [],
        "--allowed-hosts",
        help="host names a browser may reach the server by, besides IP addresses and localhost "
        "(comma-separated or repeated; '*': any). Guards against DNS rebinding",
    ),
    max_stop_strings: int = _limit("max_stop_strings", "--max-stop-strings", "most stop strings per request"),
    max_stop_length: int = _limit("max_stop_length", "--max-stop-length", "most characters per stop string"),
    max_view_subscribers: int = _limit(
        "max_view_subscribers", "--max-view-subscribers", "most live-view streams open at once; more get 503"
    ),
    view_publish_hz: float = _limit(
        "view_publish_hz", "--view-publish-hz", "most live-view snapshots a second (0: every step)"
    ),
    view_history_steps: int = _limit("view_history_steps", "--view-history-steps", "most snapshots /api/history keeps"),
    view_history_mb: float = _limit("view_history_mb", "--view-history-mb", "most MB of snapshots /api/history keeps"),
    header_timeout: float = _limit(
        "header_timeout_s", "--header-timeout", "seconds a connection may take to send a request's headers"
    ),
    idle_timeout: float = _limit("idle_timeout_s", "--idle-timeout", "seconds a request body may pause (then 408)"),
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
    batch_invariant: bool = options.BATCH_INVARIANT,
    prefix_cache: str | None = options.PREFIX_CACHE,
):
    """Serve the model over HTTP with the OpenAI API (completions, chat, streaming), /metrics and a live view."""
    from stagewise.config import EngineConfig
    from stagewise.errors import StagewiseError
    from stagewise.files import check_writable
    from stagewise.serve import server
    from stagewise.serve.app import create_app
    from stagewise.serve.limits import ServerLimits, binds_every_interface, parse_allowed_hosts

    if mode not in SERVE_MODES:
        raise StagewiseError(f"--mode must be paged or kv, got '{mode}'")
    if max_queue < 1:
        raise StagewiseError(f"--max-queue must be >= 1, got {max_queue}")
    server.check_drain_timeout(drain_timeout)
    limits = ServerLimits(
        max_stop_strings=max_stop_strings,
        max_stop_length=max_stop_length,
        max_view_subscribers=max_view_subscribers,
        view_publish_hz=view_publish_hz,
        view_history_steps=view_history_steps,
        view_history_mb=view_history_mb,
        header_timeout_s=header_timeout,
        idle_timeout_s=idle_timeout,
        allowed_hosts=parse_allowed_hosts(allowed_hosts),
    )
    if record is not None:
        if mode != "paged":
            raise StagewiseError("--record needs --mode paged (the view shows the paged engine's state)")
        check_writable(record, "--record")  # now, not when the server stops (the recording lost)
        options.check_not_the_model(record, model, "--record")
    spec = options.speculative_arg(speculative_config, speculative)
    prefix_cache = options.prefix_cache_arg(prefix_cache)
    if prefix_cache not in (None, "none") and not prefix_caching:
        raise StagewiseError(f"--prefix-cache {prefix_cache} needs prefix caching; drop --no-prefix-caching")
    sock = server.bind(host, port)  # first: a port in use is known before the model loads
    engine_config = EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=token_budget,
        num_kv_blocks=kv_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=prefix_caching,
        prefix_cache=prefix_cache or "hash",
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
        batch_invariant=batch_invariant,
    )
    with llm:
        hub, recorder = _view(llm, mode, record, limits)
        app = create_app(
            llm, mode=mode, max_queue=max_queue, api_key=api_key, hub=hub, model_name=served_model_name, limits=limits
        )
        name = app.state.server.model_name
        url = server.url_of(sock)
        print(f"serving {name} ({mode}) at {url}  (OpenAI API under /v1; Ctrl-C stops)", flush=True)
        if hub is not None:
            print(
                f"live view: {url}/  (open it in a browser: the scheduler and the KV blocks, step by step)", flush=True
            )
        if recorder is not None:
            print(f"recording every engine step to {recorder.path} (written when the server stops)", flush=True)
        if binds_every_interface(sock.getsockname()[0]) and api_key is None:  # 0.0.0.0, 0, ::, [::], ::0, ...
            print("warning: listening on every interface with no authentication (add --api-key KEY)", file=sys.stderr)
        try:
            server.run(app, sock, drain_timeout=drain_timeout)
        except KeyboardInterrupt:  # stopped by Ctrl-C / SIGTERM: every request has ended by now
            _ignore_further_signals()
            raise
        finally:
            if recorder is not None:
                path = recorder.close()
                print(f"wrote {path} ({recorder.num_steps} steps; replay: stagewise view {path})", flush=True)


def _ignore_further_signals() -> None:
    """The server has stopped and the command is exiting (130 / 143): a second signal now (a
    supervisor that sends SIGTERM twice) would only cut the exit short, with a traceback from
    some finalizer or death by the signal. Ignored handlers survive Python's finalization."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def _view(llm, mode: str, record: str | None, limits):
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
    hub = ViewHub(limits=limits)
    recorder = None
    if record is not None:
        recorder = RunRecorder(record, llm.describe())
        hub.subscribe(recorder)
    return hub, recorder
