"""`trace`: run prompts through the engine under a Tracer and print the shape flow.

trace "The capital of France is"
trace "Hi" "A longer prompt here" --max-tokens 4 --layers all
trace "Hello" --model llama-3-405b          (shape only, meta device: instant, no memory)
trace "Hello" --format json --out trace.json
"""

import sys

import typer
from rich.console import Console

from stagewise.errors import StagewiseError


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
    fmt: str = typer.Option("tree", "--format", help="tree or json"),
    out: str | None = typer.Option(None, help="write to this file instead of the terminal"),
    chat: bool = typer.Option(False, "--chat", help="wrap prompts in the model's chat template"),
    width: int | None = typer.Option(None, help="terminal width (default: auto)"),
    timing: bool = typer.Option(True, "--timing/--no-timing", help="show wall time per stage"),
):
    """Print every tensor shape through a run, step by step."""
    import json

    from stagewise import LLM, SamplingParams
    from stagewise.stages import STAGES
    from stagewise.trace.render_tree import render_tree
    from stagewise.trace.tracer import Tracer

    if fmt not in ("tree", "json"):
        raise StagewiseError(f"unknown format '{fmt}'; use tree or json")
    for name in stage:
        if name not in STAGES:
            raise StagewiseError(f"unknown stage '{name}'; stages are {', '.join(STAGES)}")
    layer_sel = layers if layers in ("first", "all") else parse_index_list(layers, "layers")
    step_sel = parse_index_list(steps, "steps")
    llm = LLM(model, backend=backend, mode=mode)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Tracer(timing=timing) as tracer:
        llm.generate(prompts, params, chat=chat)
    if fmt == "json":
        text = json.dumps(tracer.to_dict(), indent=1)
        if out:
            with open(out, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text + "\n")
        return
    view = render_tree(
        tracer, layers=layer_sel, steps=step_sel, stages=set(stage), with_time=timing, decode=llm.tokenizer.decode
    )
    if out:
        with open(out, "w") as f:
            Console(file=f, width=width or 160, no_color=True).print(view)
    else:
        Console(width=width).print(view)
