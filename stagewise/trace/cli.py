"""`trace`: run prompts through the engine under a Tracer and print the shape flow.

trace "The capital of France is"
trace "Hi" "A longer prompt here" --max-tokens 4 --layers all
trace "Hello" --model llama-3-405b          (shape only, meta device: instant, no memory)
trace "Hello" --format json --out trace.json
"""

import os
import sys

import typer
from rich.console import Console

from stagewise.errors import StagewiseError

FORMATS = ("tree", "table", "json", "chrome", "markdown")


def parse_index_list(text: str | None, what: str) -> list[int] | None:
    """'0,2-4' -> [0, 2, 3, 4]; None -> None."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                out += list(range(int(lo), int(hi) + 1))
            elif part.strip():
                out.append(int(part))
    except ValueError:
        raise StagewiseError(f"--{what} expects numbers like 0,2-4, got '{text}'") from None
    return out


def trace(
    prompts: list[str] = typer.Argument(..., help="one or more prompts"),
    model: str = typer.Option("smollm2-135m", help="preset (smollm2-135m, tiny, llama-3-405b, ...), .gguf or HF dir"),
    max_tokens: int = typer.Option(3, help="tokens to generate per prompt"),
    backend: str = typer.Option("naive", help="naive or triton"),
    mode: str = typer.Option("paged", help="paged (continuous batching), kv (static batching) or naive"),
    layers: str = typer.Option("first", help="'first', 'all', or indices like 0,5-7"),
    steps: str | None = typer.Option(None, help="engine steps to expand, e.g. 0,1 (default: all)"),
    stage: list[str] = typer.Option([], help="show only these stages (repeatable)"),
    fmt: str = typer.Option("tree", "--format", help="tree, table, json, chrome or markdown"),
    out: str | None = typer.Option(None, help="write to this file instead of the terminal"),
    chat: bool = typer.Option(False, "--chat", help="wrap prompts in the model's chat template"),
    max_num_seqs: int = typer.Option(16, help="engine: most requests running at once"),
    token_budget: int = typer.Option(512, help="engine: most tokens per step (max_num_batched_tokens)"),
    block_size: int = typer.Option(16, help="engine: tokens per KV block"),
    kv_blocks: int = typer.Option(256, help="engine: KV cache size in blocks (small, so the trace stays readable)"),
    prefix_caching: bool = typer.Option(
        True, "--prefix-caching/--no-prefix-caching", help="engine: share prompt blocks"
    ),
    width: int | None = typer.Option(None, help="terminal width (default: auto)"),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="show wall time per stage"),
):
    """Print every tensor shape through a run, step by step."""
    import json

    from stagewise import LLM, SamplingParams
    from stagewise.stages import STAGES
    from stagewise.trace.export import to_chrome, to_json
    from stagewise.trace.render_table import render_markdown, render_table
    from stagewise.trace.render_tree import render_tree
    from stagewise.trace.tracer import Tracer

    if fmt not in FORMATS:
        raise StagewiseError(f"unknown format '{fmt}'; use one of {', '.join(FORMATS)}")
    if max_tokens <= 0:
        raise StagewiseError(f"max_tokens must be an int >= 1, got {max_tokens}")
    for name in stage:
        if name not in STAGES:
            raise StagewiseError(f"unknown stage '{name}'; stages are {', '.join(STAGES)}")
    layer_sel = layers if layers in ("first", "all") else parse_index_list(layers, "layers")
    step_sel = parse_index_list(steps, "steps")
    ecfg = engine_config(max_num_seqs, token_budget, block_size, kv_blocks, prefix_caching)
    llm = LLM(model, backend=backend, mode=mode, engine_config=ecfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Tracer(timing=timing) as tracer:
        llm.generate(prompts, params, chat=chat)
    if fmt in ("json", "chrome"):
        doc = to_json(tracer) if fmt == "json" else to_chrome(tracer)
        write_text(json.dumps(doc, indent=1), out)
        return
    if fmt == "markdown":
        write_text(render_markdown(tracer, layer_sel, step_sel, set(stage)), out)
        return
    if fmt == "table":
        view = render_table(tracer, layer_sel, step_sel, set(stage))
    else:
        view = render_tree(
            tracer, layers=layer_sel, steps=step_sel, stages=set(stage), with_time=timing, decode=llm.tokenizer.decode
        )
    if out:
        with open(out, "w") as f:
            Console(file=f, width=width or 160, no_color=True).print(view)
    else:
        Console(width=width).print(view)


def engine_config(max_num_seqs: int, token_budget: int, block_size: int, kv_blocks: int, prefix_caching: bool):
    from stagewise.config import EngineConfig

    for name, value in (("max-num-seqs", max_num_seqs), ("token-budget", token_budget), ("block-size", block_size)):
        if value <= 0:
            raise StagewiseError(f"--{name} must be >= 1, got {value}")
    if kv_blocks <= 0:
        raise StagewiseError(f"--kv-blocks must be >= 1, got {kv_blocks}")
    return EngineConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=token_budget,
        block_size=block_size,
        num_kv_blocks=kv_blocks,
        enable_prefix_caching=prefix_caching,
    )


def write_text(text: str, out: str | None) -> None:
    """Write to a file atomically (temp file + rename), or to stdout."""
    if not out:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, out)
