"""`trace`: run prompts through the engine under a Tracer and print the shape flow.

trace "The capital of France is"
trace "Hi" "A longer prompt here" --max-tokens 4 --layers all
trace "Hello" --model llama-3-405b          (shape only, meta device: instant, no memory)
trace "Hello" --format json --out trace.json
trace "Hello" --no-timing --format json     (no measured time anywhere: two runs give the same bytes)

The tree keeps one line per stage at projector width: below COMPACT_BELOW columns it prints compact stage
lines (bare sizes, the step's metadata tensors only under `batch`); `--full` or `--compact` choose.
"""

import io
import sys

import typer
from rich.console import Console

from stagewise.cli import options
from stagewise.errors import StagewiseError
from stagewise.files import check_writable, write_text_atomic

FORMATS = ("tree", "table", "json", "chrome", "markdown")
MIN_WIDTH = 40  # narrower than this, the tree's lines are unreadable
DEFAULT_FILE_WIDTH = 160  # width of a tree or table written with --out
COMPACT_BELOW = 140  # a terminal narrower than this gets the compact tree (axis names do not fit one line)


def trace(
    prompts: list[str] = typer.Argument(..., help="one or more prompts"),
    model: str = typer.Option("smollm2-135m", help="preset (smollm2-135m, tiny, llama-3-405b, ...), .gguf or HF dir"),
    max_tokens: int = typer.Option(3, help="tokens to generate per prompt"),
    backend: str = typer.Option("torch", help="the tier of every stage: naive, torch or triton"),
    mode: str = typer.Option("paged", help="paged (continuous batching), kv (static batching) or naive"),
    layers: str | None = typer.Option(
        None, help="'first', 'all', or indices like 0,5-7 (default: first; json and chrome: all)"
    ),
    steps: str | None = typer.Option(None, help="engine steps to show, e.g. 0,1 (default: all)"),
    stage: list[str] = typer.Option([], help="show only these stages (repeatable)"),
    fmt: str = typer.Option("tree", "--format", help="tree, table, json, chrome or markdown"),
    out: str | None = typer.Option(None, help="write to this file instead of the terminal"),
    chat: bool = typer.Option(False, "--chat", help="wrap prompts in the model's chat template"),
    special_tokens: bool = typer.Option(
        False, "--special-tokens", help="let prompts hold control tokens like <|im_start|> (trusted input only)"
    ),
    max_num_seqs: int = typer.Option(16, help="engine: most requests running at once"),
    token_budget: int = typer.Option(512, help="engine: most tokens per step (max_num_batched_tokens)"),
    block_size: int = typer.Option(16, help="engine: tokens per KV block"),
    kv_blocks: int = typer.Option(256, help="engine: KV cache size in blocks (small, so the trace stays readable)"),
    prefix_caching: bool = typer.Option(
        True, "--prefix-caching/--no-prefix-caching", help="engine: share prompt blocks"
    ),
    device: str | None = typer.Option(None, help="cpu, cuda or meta (shape only: no memory, no values)"),
    width: int | None = typer.Option(None, help=f"terminal width, >= {MIN_WIDTH} (default: auto)"),
    timing: bool = typer.Option(
        True, "--timing/--no-timing", help="measure wall times (--no-timing: none in any format, reproducible)"
    ),
    compact: bool | None = typer.Option(
        None,
        "--compact/--full",
        help=f"tree and table: short shape labels, one line per stage (default below {COMPACT_BELOW} columns)",
    ),
    tensor_parallel_size: int = typer.Option(
        1, "--tensor-parallel-size", "--tp", help="split the model over N ranks; the trace shows every rank"
    ),
    recalibrate: bool = typer.Option(
        False, "--recalibrate", help="measure the CPU GEMM forms again instead of reading their cache"
    ),
    quantization: str = typer.Option(
        "auto",
        "--quantization",
        help="auto (default): a GGUF's Q4_0/Q4_1/Q8_0 weights stay packed (4/8 bits; the fast CPU tier "
        "computes them in bfloat16); none: dequantize to floats",
    ),
    speculative_config: str | None = options.SPECULATIVE_CONFIG,
    speculative: str | None = options.SPECULATIVE,
    batch_invariant: bool = options.BATCH_INVARIANT,
    prefix_cache: str | None = options.PREFIX_CACHE,
):
    """Print every tensor shape through a run, step by step."""
    from stagewise.bench.harness.progress import load_status
    from stagewise.cli.interpreted import traced
    from stagewise.engine.llm import LLM
    from stagewise.sampling_params import SamplingParams
    from stagewise.stages import STAGES
    from stagewise.trace.export import drop_times, mark_shape_only
    from stagewise.trace.render_tree import token_decoder
    from stagewise.trace.select import check_ranges, parse_ranges
    from stagewise.trace.tracer import COLLECTIVES

    # Every option is checked before the model loads; the ranges once the sizes are known.
    if fmt not in FORMATS:
        raise StagewiseError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    if max_tokens <= 0:
        raise StagewiseError(f"max_tokens must be an int >= 1, got {max_tokens}")
    if width is not None and width < MIN_WIDTH:
        raise StagewiseError(f"--width must be >= {MIN_WIDTH}, got {width}")
    for name in stage:
        if name not in STAGES and name not in COLLECTIVES:
            raise StagewiseError(f"unknown stage '{name}'; stages are {', '.join([*STAGES, *COLLECTIVES])}")
    layer_ranges = None if layers in (None, "first", "all") else parse_ranges(layers, "layers")
    step_ranges = None if steps is None else parse_ranges(steps, "steps")
    if out is not None:
        check_writable(out)
        options.check_not_the_model(out, model)
    ecfg = engine_config(max_num_seqs, token_budget, block_size, kv_blocks, prefix_caching)
    spec = options.speculative_arg(speculative_config, speculative)
    prefix_cache = options.prefix_cache_arg(prefix_cache)
    with load_status():  # a line per load phase on stderr (a terminal only)
        llm = LLM(
            model,
            backend=backend,
            mode=mode,
            device=device,
            engine_config=ecfg,
            special_tokens=special_tokens,
            tensor_parallel_size=tensor_parallel_size,
            recalibrate=recalibrate,
            quantization=quantization,
            speculative_config=spec,
            batch_invariant=batch_invariant,
            prefix_cache=prefix_cache,
        )
    if layer_ranges is not None:
        layer_sel = check_ranges(layer_ranges, llm.config.num_layers, "layers", llm.describe()["name"])
    else:
        layer_sel = layers or ("all" if fmt in ("json", "chrome") else "first")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with llm, traced(llm, prompts, max_tokens, timing) as tracer:  # triton on a CPU: progress
        llm.generate(prompts, params, chat=chat)
    decode = token_decoder(llm.tokenizer)  # a byte token that is part of a character: its bytes
    if llm.weightless:  # shape only: placeholder ids (never decoded) and no times, which would measure nothing
        mark_shape_only(tracer)
        decode, timing = None, False
    if not timing:
        drop_times(tracer)
    step_sel = None if step_ranges is None else check_ranges(step_ranges, len(tracer.steps), "steps", "this run")
    ran = {rec.stage for step in tracer.steps for rec in step.stages}
    for name in dict.fromkeys(stage):  # a filter that matches nothing would print an empty trace without a word
        if name not in ran:
            why = " (collectives run only with --tp > 1)" if name in COLLECTIVES and tensor_parallel_size == 1 else ""
            print(f"note: no {name} call in this run (mode {llm.mode}){why}", file=sys.stderr)
    text = render(
        tracer, fmt, layer_sel, step_sel, set(stage), timing, decode, width, to_file=bool(out), compact=compact
    )
    if out:
        write_text_atomic(out, text)
        num_steps = len(tracer.steps) if step_sel is None else len(step_sel)
        print(f"wrote {out} ({_what_was_written(out, fmt, num_steps, llm.mode, width)})")
    else:
        sys.stdout.write(text)


def _what_was_written(out: str, fmt: str, num_steps: int, mode: str, width) -> str:
    """The words after `wrote FILE`: what the file holds and what opens it."""
    steps = f"{num_steps} step{'' if num_steps == 1 else 's'}"
    if fmt == "json":
        return f"trace JSON, {steps}" + (f"; replay it: stagewise view {out}" if mode == "paged" else "")
    if fmt == "chrome":
        return f"Chrome trace events, {steps}; open it in Perfetto or chrome://tracing"
    if fmt == "markdown":
        return f"markdown tables, {steps}"
    return f"{fmt}, {steps}, {width or DEFAULT_FILE_WIDTH} columns, no colour"


def render(
    tracer, fmt: str, layers, steps, stages: set, timing: bool, decode, width, to_file: bool, compact=None
) -> str:
    """The whole output as text, before anything is written (so an interrupted run writes nothing)."""
    import json

    from stagewise.trace.export import to_chrome, to_json
    from stagewise.trace.render_table import render_markdown, render_table
    from stagewise.trace.render_tree import render_tree
    from stagewise.trace.select import select

    if fmt in ("json", "chrome"):
        picked = select(tracer, [0] if layers == "first" else layers, steps, stages)
        doc = to_json(picked) if fmt == "json" else to_chrome(picked)
        return json.dumps(doc, indent=1) + "\n"
    if fmt == "markdown":
        return render_markdown(tracer, layers, steps, stages)
    buffer = io.StringIO()
    if to_file:
        console = Console(file=buffer, width=width or DEFAULT_FILE_WIDTH, no_color=True)
    else:  # the terminal's own width and colours, as if printed directly
        terminal = Console(width=width)
        console = Console(
            file=buffer, width=terminal.width, force_terminal=terminal.is_terminal, color_system=terminal.color_system
        )
    short = console.width < COMPACT_BELOW if compact is None else compact
    if fmt == "table":
        view = render_table(tracer, layers, steps, stages, compact=short)
    else:
        view = render_tree(
            tracer, layers=layers, steps=steps, stages=stages, with_time=timing, decode=decode, compact=short
        )
    console.print(view)
    return buffer.getvalue()


def engine_config(max_num_seqs: int, token_budget: int, block_size: int, kv_blocks: int, prefix_caching: bool):
    from stagewise.config import EngineConfig

    for name, value in (
        ("max-num-seqs", max_num_seqs),
        ("token-budget", token_budget),
        ("block-size", block_size),
        ("kv-blocks", kv_blocks),
    ):
        if value <= 0:
            raise StagewiseError(f"--{name} must be >= 1, got {value}")
    return EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=token_budget,
        block_size=block_size,
        num_kv_blocks=kv_blocks,
        enable_prefix_caching=prefix_caching,
    )
