"""The `stagewise` command line: generate, trace, stages (and `trace` as its own script).

Bad input never ends in a traceback: a `StagewiseError` (or a bad option)
prints one line on stderr and exits with status 2; Ctrl-C exits with 130; an
unexpected exception prints one line and exits with 1 (`--debug` shows its
traceback). `stagewise.cli.command.run_command` does this for every entry point.
"""

import inspect

import typer
from rich.console import Console

from stagewise.cli import options
from stagewise.cli.command import run_command

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="LLM inference, stage by stage.",
)


def _print_version(asked: bool) -> None:
    if not asked:
        return
    import platform
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    torch, triton = version("torch"), version("triton")
    print(f"stagewise {version('stagewise')} (torch {torch}, triton {triton}, Python {platform.python_version()})")
    raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="print the version and exit"
    ),
):
    """LLM inference, stage by stage."""


@app.command()
def generate(
    prompts: list[str] = typer.Argument(..., help="one or more prompts"),
    model: str = options.MODEL,
    backend: str = options.BACKEND,
    stage_backend: list[str] = options.STAGE_BACKEND,
    mode: str = typer.Option("paged", help="paged (continuous batching), kv (static batching) or naive (recompute)"),
    max_tokens: int = typer.Option(64, help="most tokens to generate per prompt"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(-1, help="keep the k most likely tokens (0 or -1 = off)"),
    top_p: float = typer.Option(1.0, help="keep the top tokens with this much mass (1 = off)"),
    min_p: float = typer.Option(0.0, help="drop tokens below min_p x the top probability"),
    repetition_penalty: float = typer.Option(1.0, help="> 1 discourages repeating tokens"),
    seed: int | None = typer.Option(None, help="random seed (sampling)"),
    stop: list[str] = typer.Option([], help="stop string (repeatable)"),
    ignore_eos: bool = typer.Option(
        False, "--ignore-eos", help="keep generating past the end-of-sequence token, to max-tokens"
    ),
    chat: bool = typer.Option(False, "--chat", help="wrap each prompt in the model's chat template"),
    special_tokens: bool = options.SPECIAL_TOKENS,
    device: str | None = options.DEVICE,
    dtype: str | None = options.DTYPE,
    stats: bool = typer.Option(False, "--stats", help="per request: TTFT, TBT, TPS (1/TBT), latency, tokens/s"),
    tensor_parallel_size: int = options.TENSOR_PARALLEL_SIZE,
    recalibrate: bool = options.RECALIBRATE,
    quantization: str = options.QUANTIZATION,
    speculative_config: str | None = options.SPECULATIVE_CONFIG,
    speculative: str | None = options.SPECULATIVE,
    batch_invariant: bool = options.BATCH_INVARIANT,
    prefix_cache: str | None = options.PREFIX_CACHE,
):
    """Generate text, streaming it as it is produced."""
    from stagewise.cli.interpreted import interpreter_progress
    from stagewise.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=tuple(stop),
        ignore_eos=ignore_eos,
    )
    spec = options.speculative_arg(speculative_config, speculative)
    prefix_cache = options.prefix_cache_arg(prefix_cache)
    llm = options.load_llm(
        model,
        dtype=dtype,
        stage_backend=stage_backend,
        backend=backend,
        mode=mode,
        device=device,
        special_tokens=special_tokens,
        tensor_parallel_size=tensor_parallel_size,
        recalibrate=recalibrate,
        quantization=quantization,
        speculative_config=spec,
        batch_invariant=batch_invariant,
        prefix_cache=prefix_cache,
    )
    with llm:  # under tensor parallelism: the workers end with the command, however it ends
        with interpreter_progress(llm, prompts, max_tokens, row=False):  # triton on a CPU: an estimate
            _stream_to_stdout(llm, prompts, params, chat, stats)


def _stream_to_stdout(llm, prompts: list[str], params, chat: bool, stats: bool) -> None:
    """The text as it is produced (several prompts: one after another), then `--stats` on stderr."""
    from stagewise.cli.streaming import print_stats, stream_texts

    clocks = stream_texts(llm.stream(prompts, params, chat=chat), prompts)
    if stats:
        print_stats(clocks, speculative=llm.last_stats if llm.speculative_config else None)


@app.command()
def stages():
    """List the pipeline stages with their shapes and what their triton tier is."""
    Console().print(stages_table())


def stages_table():
    """The registry as a table. Every cell is a `Text`, not markup (Rich would read `[num_tokens]` as a style
    tag and drop it); at a narrow terminal the text wraps, never cut (`stagewise.trace.fit`)."""
    from stagewise.stages import STAGES
    from stagewise.trace.fit import Col, FitTable

    cols = [Col("stage"), Col("shapes", wrap=True, min_width=16), Col("what it computes", wrap=True, min_width=16)]
    cols.append(Col("triton tier", wrap=True, min_width=14))
    rows = [[s.name, s.shapes, s.summary, s.triton_kind] for s in STAGES.values()]
    return FitTable("stagewise stages, in pipeline order", cols, rows)


def _register_commands() -> None:
    """The commands of the modules beside this one (trace, calc, bench), imported only when the CLI runs."""
    if any(c.name == "trace" for c in app.registered_commands):
        return  # registered already (main() called twice in one process, as the tests do)
    from stagewise.cli.bench import bench_app
    from stagewise.cli.calc import calc
    from stagewise.cli.serve import serve
    from stagewise.cli.trace import trace
    from stagewise.cli.view import view

    app.command(name="trace")(trace)
    app.command(name="calc")(calc)
    app.command(name="serve")(serve)
    app.command(name="view")(view)
    app.add_typer(bench_app, name="bench", short_help=_first_paragraph(bench_app.info.help))
    _whole_short_helps(app)


def _first_paragraph(text: str | None) -> str | None:
    return " ".join(inspect.cleandoc(text).split("\n\n")[0].split()) if text else None


def _whole_short_helps(typer_app: typer.Typer) -> None:
    """A command's line in its group's list is the first paragraph of its help, whole. Without it, click's
    plain help layout (below 100 columns, see stagewise/cli/__init__.py) cuts that line at ~60 characters
    ("what their..."); with it the line wraps. Rich's panels show the same paragraph."""
    for info in typer_app.registered_commands:
        if info.short_help is None and info.callback is not None:
            info.short_help = _first_paragraph(info.callback.__doc__)
    for group in typer_app.registered_groups:
        _whole_short_helps(group.typer_instance)


def main() -> None:
    """Entry point of the `stagewise` script."""
    run_command(app, prepare=_register_commands)


def trace_main() -> None:
    """Entry point of the `trace` script: `stagewise trace` under its own name."""
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    def register() -> None:
        from stagewise.cli.trace import trace

        single.command()(trace)

    run_command(single, prepare=register)
