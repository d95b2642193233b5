"""`stagewise bench modes|batching|stages`: run a benchmark, print a table, save `<name>.json` + `<name>.png`.

Register under the main CLI with `app.add_typer(bench_app, name="bench")`.
Results go to `benchmarks/results/<machine-tag>/` unless `--out` says
otherwise; `--quick` shrinks every size so a run finishes in well under a
minute (a smoke test, not a measurement).
"""

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from stagewise.errors import StagewiseError

bench_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Measured comparisons with plots: naive vs KV vs paged, static vs continuous batching, per-stage kernels.",
)

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}
BACKENDS = ("naive", "triton")


def parse_dtype(name: str | None) -> str | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise StagewiseError(f"unknown dtype '{name}'; use one of float32, bfloat16, float16")
    return DTYPES[name]


def parse_ints(text: str, what: str) -> tuple[int, ...]:
    """'16,64,256' -> (16, 64, 256)."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise StagewiseError(f"{what} must be comma-separated integers, got '{text}'") from None
    if not values or min(values) < 1:
        raise StagewiseError(f"{what} must be positive integers, got '{text}'")
    return values


def parse_range(text: str, what: str) -> tuple[int, int]:
    """'16-512' -> (16, 512); a single number means LOW = HIGH."""
    parts = text.split("-")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (None, None)
    except ValueError:
        low = high = None
    if low is None or high is None or low > high or low < 1:
        raise StagewiseError(f"{what} must look like LOW-HIGH (e.g. 16-512), got '{text}'")
    return low, high


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise StagewiseError(f"unknown backend '{backend}'; use naive or triton")
    return backend


def setup(threads: int | None, out: str | None) -> tuple[Console, Path]:
    """Set torch's thread count first (the machine tag names it), then pick the output folder."""
    import torch

    from stagewise.bench.machine import machine_tag

    if threads is not None:
        if threads < 1:
            raise StagewiseError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return Console(), Path(out) if out else Path("benchmarks") / "results" / machine_tag()


def progress_bar(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )


def finish(console: Console, result: dict, table, plot, out_dir: Path, name: str) -> None:
    from stagewise.bench.machine import write_result_json

    console.print(table)
    for note in result.get("notes") or []:
        console.print(f"[bold red]note:[/] {note}")
    json_path = write_result_json(result, out_dir / f"{name}.json")
    png_path = out_dir / f"{name}.png"
    plot(result, png_path)
    console.print(f"wrote {json_path} and {png_path}")


MODEL = typer.Option("smollm2-135m", help="preset name, .gguf file or Hugging Face Llama directory")
OUT = typer.Option(None, help="output folder (default benchmarks/results/<machine-tag>/)")
QUICK = typer.Option(False, "--quick", help="tiny sizes: a smoke run, not a measurement")
BACKEND = typer.Option("naive", help="stage backend: naive (PyTorch) or triton")
DEVICE = typer.Option(None, help="cpu or cuda (default: cuda when available)")
DTYPE = typer.Option(None, help="float32 / bfloat16 / float16 (default: float32 on CPU, bfloat16 on CUDA)")
THREADS = typer.Option(None, help="torch CPU threads (default: torch's choice)")


@bench_app.command()
def modes(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    backend: str = BACKEND,
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
    prompt_tokens: int | None = typer.Option(None, help="prompt length (default 32; quick 16)"),
    output_lengths: str | None = typer.Option(None, help="comma-separated max_tokens (default 16,64,256,512)"),
    modes: str = typer.Option("naive,kv,paged", help="comma-separated modes to compare"),
    repeats: int | None = typer.Option(None, help="timed runs per mode and length (default 3; quick 1)"),
    compare: list[str] = typer.Option([], help="add a system: transformers (HF generate on the same prompt)"),
):
    """Naive recompute vs KV cache vs paged KV: same prompt, same tokens, growing outputs."""
    from stagewise.bench.modes import ModesSettings, modes_table, plot_modes, run_modes

    console, out_dir = setup(threads, out)
    settings = ModesSettings(
        model=model,
        backend=check_backend(backend),
        device=device,
        dtype=parse_dtype(dtype),
        prompt_tokens=prompt_tokens or (16 if quick else 32),
        output_lengths=parse_ints(output_lengths, "--output-lengths")
        if output_lengths
        else ((8, 32) if quick else (16, 64, 256, 512)),
        repeats=repeats or (1 if quick else 3),
        modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
        compare=tuple(c.strip() for item in compare for c in item.split(",") if c.strip()),
    )
    with progress_bar(console) as progress:
        result = run_modes(settings, progress=progress)
    finish(console, result, modes_table(result), plot_modes, out_dir, "modes")


@bench_app.command()
def batching(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    backend: str = BACKEND,
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
    compare: list[str] = typer.Option([], help="add a system: transformers (padded static batching generate)"),
    num_requests: int | None = typer.Option(None, help="requests in the workload (default 32; quick 8)"),
    prompt_tokens: str | None = typer.Option(None, help="prompt length range LOW-HIGH (default 16-512; quick 16-64)"),
    output_tokens: str | None = typer.Option(None, help="output length range LOW-HIGH (default 16-256; quick 8-32)"),
    max_num_seqs: int | None = typer.Option(None, help="static batch size = most running requests (default 8)"),
    max_num_batched_tokens: int = typer.Option(512, help="token budget of one continuous-batching step"),
    continuous_seats: int | None = typer.Option(None, help="most running requests, continuous (default: same)"),
    repeats: int = typer.Option(1, help="timed runs per system, alternating the systems"),
    seed: int = typer.Option(0, help="workload seed"),
):
    """Static vs continuous batching (and transformers) on a seeded mixed-length workload."""
    from stagewise.bench.batching import QUICK as Q
    from stagewise.bench.batching import BatchingSettings, batching_table, plot_batching, run_batching

    console, out_dir = setup(threads, out)
    names = tuple(c.strip() for item in compare for c in item.split(",") if c.strip())
    settings = BatchingSettings(
        model=model,
        backend=check_backend(backend),
        device=device,
        dtype=parse_dtype(dtype),
        num_requests=num_requests or (Q["num_requests"] if quick else 32),
        prompt_tokens=parse_range(prompt_tokens, "--prompt-tokens")
        if prompt_tokens
        else (Q["prompt_tokens"] if quick else (16, 512)),
        output_tokens=parse_range(output_tokens, "--output-tokens")
        if output_tokens
        else (Q["output_tokens"] if quick else (16, 256)),
        max_num_seqs=max_num_seqs or (Q["max_num_seqs"] if quick else 8),
        max_num_batched_tokens=max_num_batched_tokens,
        continuous_max_num_seqs=continuous_seats,
        repeats=repeats,
        seed=seed,
        compare=names,
    )
    with progress_bar(console) as progress:
        result = run_batching(settings, progress=progress)
    finish(console, result, batching_table(result), plot_batching, out_dir, "batching")


@bench_app.command()
def stages(
    model: str | None = typer.Option(
        None, help="preset whose shapes to use (default: smollm2-135m on CUDA, tiny on CPU)"
    ),
    out: str | None = OUT,
    quick: bool = QUICK,
    device: str | None = DEVICE,
    dtype: str | None = DTYPE,
    threads: int | None = THREADS,
    prefill_tokens: int | None = typer.Option(None, help="tokens of the prefill shape (default 128; quick 32)"),
    decode_tokens: int = typer.Option(1, help="tokens of the decode shape"),
    only: str | None = typer.Option(None, "--stages", help="comma-separated stage names (default: all)"),
    repeats: int | None = typer.Option(None, help="timed calls per path (default 20 on CUDA, 3 on CPU; quick 2)"),
    warmup: int | None = typer.Option(None, help="untimed calls per path first (default 3 on CUDA, 1 on CPU)"),
):
    """Every registry stage: naive PyTorch vs optimized, prefill and decode shapes (CPU: interpreter, correctness)."""
    from stagewise.bench.stage_bench import StagesSettings, plot_stages, run_stages, stages_table

    console, out_dir = setup(threads, out)
    if decode_tokens < 1 or (prefill_tokens is not None and prefill_tokens < 1):
        raise StagewiseError("--prefill-tokens and --decode-tokens must be >= 1")
    settings = StagesSettings(
        model=model,
        device=device,
        dtype=parse_dtype(dtype),
        prefill_tokens=prefill_tokens or (32 if quick else 128),
        decode_tokens=decode_tokens,
        repeats=repeats or (2 if quick else None),
        warmup=warmup,
        stages=tuple(s.strip() for s in only.split(",") if s.strip()) if only else (),
    )
    with progress_bar(console) as progress:
        result = run_stages(settings, progress=progress)
    finish(console, result, stages_table(result), plot_stages, out_dir, "stages")


def main() -> None:
    """Run `bench` on its own (python -m stagewise.bench.bench_cli ...), with the CLI's one-line errors."""
    from stagewise.command import run_command

    run_command(bench_app)


if __name__ == "__main__":
    main()
