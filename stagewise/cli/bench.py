"""`stagewise bench modes|batching|stages|...`: run a benchmark, print a table, save `<name>.json` + `<name>.png`.

Register under the main CLI with `app.add_typer(bench_app, name="bench")`.
Results go to `benchmarks/results/<machine-tag>/` unless `--out` says
otherwise; `--quick` shrinks every size so a run finishes in well under a
minute (a smoke test, not a measurement) and writes to
`benchmarks/results/<machine-tag>/quick/`, never over the published results.

Every option is checked before the run starts: sizes >= 1 (0 is an error, not
"the default"), the output folder writable, and an existing result file is
replaced only when it was made with the same settings (or with `--overwrite`);
a quick run with other settings is written beside it, under a name made from
its settings (`modes-1a2b3c4d.json`), instead of being refused.
The JSON and the PNG are written to temporary files and renamed into place together.
"""

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from stagewise.bench.harness.progress import bench_display
from stagewise.cli import options
from stagewise.errors import StagewiseError
from stagewise.files import atomic_paths, check_writable, check_writable_folder

bench_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Measured comparisons with plots: naive vs KV vs paged, static vs continuous batching, per-stage kernels.",
)

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16"}
BACKENDS = ("naive", "torch", "triton")


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


def positive(value: int | None, option: str, default: int) -> int:
    """An option that must be >= 1; None means the default (0 is an error, not the default)."""
    if value is None:
        return default
    if value < 1:
        raise StagewiseError(f"{option} must be >= 1, got {value}")
    return value


def split_names(text: str, option: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise StagewiseError(f"{option} needs at least one name, got '{text}'")
    return names


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise StagewiseError(f"unknown backend '{backend}'; use naive, torch or triton")
    return backend


def setup(threads: int | None, out: str | None, quick: bool) -> tuple[Console, Path]:
    """Set torch's thread count first (the machine tag names it), then pick and check the output folder."""
    import torch

    from stagewise.bench.harness.machine import machine_tag

    if threads is not None:
        if threads < 1:
            raise StagewiseError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = Path("benchmarks") / "results" / machine_tag()
    if quick:
        folder = folder / "quick"  # smoke runs never touch the published results
    return Console(), check_writable_folder(Path(out) if out else folder)


def check_result_files(out_dir: Path, name: str, settings: dict, overwrite: bool, quick: bool = False) -> str:
    """Before running: both files writable, and an existing result replaced only if made with these settings.

    Returns the name to write under. A quick run into the default quick/ folder (a smoke test) whose
    `<name>.json` holds other settings is not refused: it goes to a file named after its settings,
    `<name>-<8 hex digits>.json` (the same settings always give the same name, so a rerun replaces it).
    A folder given with --out is the user's: there, other settings are refused as for a full run.
    """
    if not out_dir.exists():
        return name  # check_writable_folder found that it can be created; finish() creates it
    json_path = check_writable(out_dir / f"{name}.json")
    check_writable(out_dir / f"{name}.png")
    new = json.loads(json.dumps(settings, default=str))  # as it would be written (tuples -> lists)
    why = None if overwrite or not json_path.exists() else settings_conflict(json_path, new)
    if why is None:
        return name
    if quick:
        digest = hashlib.sha256(json.dumps(new, sort_keys=True).encode()).hexdigest()[:8]
        return check_result_files(out_dir, f"{name}-{digest}", settings, overwrite)
    raise StagewiseError(f"{json_path} holds a result with {why}; pass --overwrite to replace it, or --out elsewhere")


def settings_conflict(json_path: Path, new: dict) -> str | None:
    """None when the result file was made with the settings `new`; else what differs, in words."""
    try:
        old = json.loads(json_path.read_text()).get("settings")
    except (OSError, ValueError, AttributeError):
        old = None
    if old == new:
        return None
    if isinstance(old, dict):
        keys = sorted(set(old) | set(new))
        changed = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
        return "different settings (" + ", ".join(changed) + ")"
    return "unknown settings"


def finish(console: Console, result: dict, table, plot, out_dir: Path, name: str) -> None:
    """Print the table and notes, then write the JSON and the PNG: both land together, or neither does.

    Both go to temporary files first and are renamed into place only when both are complete, so a
    failed plot, a full disk or Ctrl-C while the PNG saves leaves the old pair, never a new JSON beside
    an old PNG.
    """
    from stagewise.bench.harness.machine import write_result_json

    console.print(table)
    for note in result.get("notes") or []:
        console.print(f"[bold red]note:[/] {escape(str(note))}")  # data, not markup
    json_path, png_path = out_dir / f"{name}.json", out_dir / f"{name}.png"
    out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_paths(json_path, png_path) as (json_tmp, png_tmp):
        write_result_json(result, json_tmp)
        plot(result, png_tmp)
    console.print(f"wrote {escape(str(json_path))} and {escape(str(png_path))}")


MODEL = typer.Option("smollm2-135m", help="preset name, .gguf file or Hugging Face Llama directory")
OUT = typer.Option(None, help="output folder (default benchmarks/results/<machine-tag>/)")
QUICK = typer.Option(False, "--quick", help="tiny sizes: a smoke run, not a measurement")
BACKEND = typer.Option("torch", help="stage tier: naive (textbook), torch (fast PyTorch where it exists) or triton")
DEVICE = typer.Option(None, help="cpu or cuda (default: cuda when available)")
DTYPE = typer.Option(None, help="float32 / bfloat16 / float16 (default: float32 on CPU, bfloat16 on CUDA)")
THREADS = typer.Option(None, help="torch CPU threads (default: torch's choice)")
OVERWRITE = typer.Option(False, "--overwrite", help="replace a result file made with different settings")


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
    tp: str = typer.Option("1", "--tp", "--tensor-parallel-size", help="comma-separated TP sizes, e.g. 1,2"),
    formats: str | None = typer.Option(
        None,
        help="comma-separated weight formats, each mode run with each (quantization=: none, auto, int8, int4), "
        "e.g. none,auto (default: the model as loaded, float)",
    ),
    batch_invariant: bool = options.BATCH_INVARIANT,
    overwrite: bool = OVERWRITE,
):
    """Naive recompute vs KV cache vs paged KV: same prompt, same tokens, growing outputs."""
    from stagewise.bench.commands.modes import (
        ModesSettings,
        check_settings,
        modes_table,
        plot_modes,
        run_modes,
        settings_dict,
    )

    console, out_dir = setup(threads, out, quick)
    settings = ModesSettings(
        model=model,
        backend=check_backend(backend),
        device=device,
        dtype=parse_dtype(dtype),
        prompt_tokens=positive(prompt_tokens, "--prompt-tokens", 16 if quick else 32),
        output_lengths=parse_ints(output_lengths, "--output-lengths")
        if output_lengths is not None
        else ((8, 32) if quick else (16, 64, 256, 512)),
        repeats=positive(repeats, "--repeats", 1 if quick else 3),
        modes=split_names(modes, "--modes"),
        compare=tuple(c.strip() for item in compare for c in item.split(",") if c.strip()),
        tp=parse_ints(tp, "--tp"),
        formats=split_names(formats, "--formats") if formats is not None else (),
        batch_invariant=batch_invariant,
    )
    check_settings(settings)
    name = check_result_files(out_dir, "modes", settings_dict(settings), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_modes(settings, progress=progress)
    finish(console, result, modes_table(result), plot_modes, out_dir, name)


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
    prefill_beside_decodes: int | None = typer.Option(
        None,
        help="prompt tokens per step while requests decode (default: 64 on a CPU, 32 with its compiled kernels, "
        "no cap on a GPU)",
    ),
    continuous_seats: int | None = typer.Option(None, help="most running requests, continuous (default: same)"),
    repeats: int = typer.Option(1, help="timed runs per system, alternating the systems"),
    seed: int = typer.Option(0, help="workload seed"),
    quantization: str = typer.Option(
        "auto", help="stagewise's weights: auto (a GGUF's packed blocks, the default) or none (float32)"
    ),
    on_mismatch: str = typer.Option(
        "raise",
        help="static and continuous tokens differ: raise (default), or record where they part and time on "
        "(packed weights compute in bfloat16, whose rounding can flip a greedy near-tie between batch shapes)",
    ),
    batch_invariant: bool = options.BATCH_INVARIANT,
    overwrite: bool = OVERWRITE,
):
    """Static vs continuous batching (and transformers) on a seeded mixed-length workload."""
    from stagewise.bench.commands.batching import QUICK as Q
    from stagewise.bench.commands.batching import (
        BatchingSettings,
        batching_table,
        check_settings,
        plot_batching,
        run_batching,
    )

    console, out_dir = setup(threads, out, quick)
    names = tuple(c.strip() for item in compare for c in item.split(",") if c.strip())
    settings = BatchingSettings(
        model=model,
        backend=check_backend(backend),
        device=device,
        dtype=parse_dtype(dtype),
        num_requests=positive(num_requests, "--num-requests", Q["num_requests"] if quick else 32),
        prompt_tokens=parse_range(prompt_tokens, "--prompt-tokens")
        if prompt_tokens is not None
        else (Q["prompt_tokens"] if quick else (16, 512)),
        output_tokens=parse_range(output_tokens, "--output-tokens")
        if output_tokens is not None
        else (Q["output_tokens"] if quick else (16, 256)),
        max_num_seqs=positive(max_num_seqs, "--max-num-seqs", Q["max_num_seqs"] if quick else 8),
        max_num_batched_tokens=positive(max_num_batched_tokens, "--max-num-batched-tokens", 512),
        prefill_beside_decodes=None
        if prefill_beside_decodes is None
        else positive(prefill_beside_decodes, "--prefill-beside-decodes", 1),
        continuous_max_num_seqs=None
        if continuous_seats is None
        else positive(continuous_seats, "--continuous-seats", 1),
        repeats=positive(repeats, "--repeats", 1),
        seed=seed,
        compare=names,
        quantization=quantization,
        on_mismatch=on_mismatch,
        batch_invariant=batch_invariant,
    )
    check_settings(settings)
    name = check_result_files(out_dir, "batching", asdict(settings), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_batching(settings, progress=progress)
    finish(console, result, batching_table(result), plot_batching, out_dir, name)


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
    overwrite: bool = OVERWRITE,
):
    """Every registry stage: naive PyTorch vs optimized, prefill and decode shapes (CPU: interpreter, correctness)."""
    from stagewise.bench.commands.stages import StagesSettings, plot_stages, resolve, run_stages, stages_table

    console, out_dir = setup(threads, out, quick)
    if warmup is not None and warmup < 0:
        raise StagewiseError(f"--warmup must be >= 0, got {warmup}")
    settings = StagesSettings(
        model=model,
        device=device,
        dtype=parse_dtype(dtype),
        prefill_tokens=positive(prefill_tokens, "--prefill-tokens", 32 if quick else 128),
        decode_tokens=positive(decode_tokens, "--decode-tokens", 1),
        repeats=positive(repeats, "--repeats", 2) if repeats is not None or quick else None,
        warmup=warmup,
        stages=split_names(only, "--stages") if only is not None else (),
    )
    name = check_result_files(out_dir, "stages", asdict(resolve(settings)), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_stages(settings, progress=progress)
    finish(console, result, stages_table(result), plot_stages, out_dir, name)


@bench_app.command()
def soak(
    model: str = typer.Option("tiny", help="preset name, .gguf file or Hugging Face Llama directory"),
    out: str | None = OUT,
    quick: bool = QUICK,
    threads: int | None = typer.Option(None, help="torch CPU threads (default 1)"),
    num_requests: int | None = typer.Option(None, help="requests added by hand (default 2000; quick 150)"),
    kv_blocks: int = typer.Option(24, help="KV pool in blocks (small: preemption is the normal case)"),
    max_num_seqs: int = typer.Option(8, help="most requests running at once"),
    seed: int = typer.Option(0, help="workload seed"),
    overwrite: bool = OVERWRITE,
    speculative_config: str | None = options.SPECULATIVE_CONFIG,
    speculative: str | None = options.SPECULATIVE,
    prefix_cache: str | None = options.PREFIX_CACHE,
):
    """Thousands of mixed requests through one engine: nothing lost, outputs as if alone, memory flat, blocks free."""
    from stagewise.bench.commands.soak import SoakSettings, plot_soak, run_soak, soak_table

    # one thread by default: the tiny model's small ops lose more to thread hand-offs than they gain
    console, out_dir = setup(1 if threads is None else threads, out, quick)
    settings = SoakSettings(
        model=model,
        num_requests=positive(num_requests, "--num-requests", 150 if quick else 2000),
        num_kv_blocks=positive(kv_blocks, "--kv-blocks", 24),
        max_num_seqs=positive(max_num_seqs, "--max-num-seqs", 8),
        seed=seed,
        speculative=options.speculative_arg(speculative_config, speculative),
        prefix_cache=options.prefix_cache_arg(prefix_cache) or "hash",
    )
    from stagewise.bench.commands.modes import refuse_weightless

    refuse_weightless(model, None)
    name = check_result_files(out_dir, "soak", asdict(settings), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_soak(settings, progress=progress)
    finish(console, result, soak_table(result), plot_soak, out_dir, name)
    if not result["ok"]:
        raise StagewiseError("the soak found lost, changed or leaked requests (see soak.json)")


@bench_app.command()
def serve(
    model: str = MODEL,
    url: str | None = typer.Option(None, help="a running server to target (default: start one per mode)"),
    modes: str = typer.Option("paged,kv", help="serve --mode values: paged (continuous), kv (static batches)"),
    request_rates: str | None = typer.Option(
        None, help="Poisson rates in req/s (default 0.1,1,inf; inf = all at once)"
    ),
    num_prompts: int | None = typer.Option(None, help="requests per rate (default 24; quick 6)"),
    prompt_tokens: str | None = typer.Option(None, help="prompt length range LOW-HIGH (default 16-32; quick 16-32)"),
    output_tokens: str | None = typer.Option(None, help="output length range LOW-HIGH (default 16-40; quick 4-8)"),
    max_num_seqs: int = typer.Option(8, help="the server's seats: most running requests = static batch size"),
    backend: str = BACKEND,
    threads: int | None = typer.Option(None, help="the server's torch threads (default: its own choice)"),
    server_arg: list[str] = typer.Option([], help="one more `serve` option for the started servers (repeatable)"),
    api_key: str | None = typer.Option(None, help="with --url: the server's API key"),
    seed: int = typer.Option(0, help="workload and arrival seed"),
    out: str | None = OUT,
    quick: bool = QUICK,
    overwrite: bool = OVERWRITE,
):
    """Poisson arrivals through real HTTP streams: TTFT / TBT / latency and throughput, continuous vs static."""
    from stagewise.bench.commands.serve import QUICK as Q
    from stagewise.bench.commands.serve import ServeSettings, check_settings, failures, header, run_serve
    from stagewise.bench.commands.serve_client import parse_rates
    from stagewise.bench.commands.serve_report import plot_serve, serve_table

    console, out_dir = setup(threads, out, quick)  # the machine tag names the server's threads
    settings = ServeSettings(
        model=model,
        url=url,
        modes=split_names(modes, "--modes"),
        request_rates=parse_rates(request_rates)
        if request_rates
        else (Q["request_rates"] if quick else ServeSettings.request_rates),
        num_prompts=positive(num_prompts, "--num-prompts", Q["num_prompts"] if quick else ServeSettings.num_prompts),
        prompt_tokens=parse_range(prompt_tokens, "--prompt-tokens")
        if prompt_tokens
        else (Q["prompt_tokens"] if quick else ServeSettings.prompt_tokens),
        output_tokens=parse_range(output_tokens, "--output-tokens")
        if output_tokens
        else (Q["output_tokens"] if quick else ServeSettings.output_tokens),
        max_num_seqs=positive(max_num_seqs, "--max-num-seqs", 8),
        backend=check_backend(backend),
        threads=threads,
        server_args=tuple(server_arg),
        api_key=api_key,
        seed=seed,
    )
    check_settings(settings)
    name = check_result_files(out_dir, "serve", asdict(settings) | {"api_key": None}, overwrite, quick and out is None)
    console.print(escape(header(settings)))
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_serve(settings, progress=progress)
    finish(console, result, serve_table(result), plot_serve, out_dir, name)
    if failures(result):
        raise StagewiseError("some requests failed or were lost (see the notes and serve.json)")


@bench_app.command("serve-limits")
def serve_limits(
    model: str = MODEL,
    streams: int | None = typer.Option(None, help="streams decoding beside the largest stop list (default 200)"),
    view_streams: int | None = typer.Option(None, help="streams decoding while the view is watched (default 16)"),
    subscribers: int | None = typer.Option(None, help="/api/events connections tried at once (default 2000)"),
    prompt_tokens: int = typer.Option(32, help="every stream's prompt length"),
    output_tokens: int | None = typer.Option(None, help="every stream's max_tokens (default 64; quick 8)"),
    repeats: int | None = typer.Option(None, help="runs of each case, alternated (default 2; quick 1)"),
    backend: str = BACKEND,
    threads: int | None = typer.Option(None, help="the server's torch threads (default: its own choice)"),
    server_arg: list[str] = typer.Option([], help="one more `serve` option for the server (repeatable)"),
    out: str | None = OUT,
    quick: bool = QUICK,
    overwrite: bool = OVERWRITE,
):
    """What one request or watcher costs the others at the server's limits: stop strings, view subscribers."""
    from stagewise.bench.commands.serve_limits import QUICK as Q
    from stagewise.bench.commands.serve_limits import LimitsSettings, header, run_limits
    from stagewise.bench.commands.serve_limits_report import limits_table, plot_limits

    console, out_dir = setup(threads, out, quick)
    d = LimitsSettings()

    def pick(value, flag, name):
        return positive(value, flag, Q.get(name, getattr(d, name)) if quick else getattr(d, name))

    settings = LimitsSettings(
        model=model,
        streams=pick(streams, "--streams", "streams"),
        view_streams=pick(view_streams, "--view-streams", "view_streams"),
        subscribers=pick(subscribers, "--subscribers", "subscribers"),
        prompt_tokens=positive(prompt_tokens, "--prompt-tokens", 32),
        output_tokens=pick(output_tokens, "--output-tokens", "output_tokens"),
        repeats=pick(repeats, "--repeats", "repeats"),
        backend=check_backend(backend),
        threads=threads,
        server_args=tuple(server_arg),
    )
    name = check_result_files(out_dir, "serve_limits", asdict(settings), overwrite, quick and out is None)
    console.print(escape(header(settings)))
    with bench_display() as progress:
        result = run_limits(settings, progress=progress)
    finish(console, result, limits_table(result), plot_limits, out_dir, name)


@bench_app.command()
def spec(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    backend: str = BACKEND,
    threads: int | None = THREADS,
    quantization: str | None = typer.Option(
        None, help="weight formats: auto (packed GGUF), none (float32) (default auto,none; quick: one)"
    ),
    methods: str = typer.Option("ngram,draft", help="proposers compared with plain decoding"),
    num_speculative_tokens: int = typer.Option(4, "--num-speculative-tokens", "-k", help="k: guesses per step"),
    max_tokens: int | None = typer.Option(None, help="greedy tokens per prompt (default 128; quick 8)"),
    draft_layers: str = typer.Option("0-7,22-29", help="layers of the target the truncated draft keeps"),
    repeats: int | None = typer.Option(None, help="timed runs per prompt and system (default 2; quick 1)"),
    prompts_per_kind: int | None = typer.Option(None, help="first N prompts of each workload (default 3; quick 1)"),
    step_repeats: int | None = typer.Option(None, help="timed passes per step shape (default 20; quick 2)"),
    batch_invariant: bool = options.BATCH_INVARIANT,
    overwrite: bool = OVERWRITE,
):
    """Speculative decoding (n-gram, draft model) vs plain decoding: copy-heavy and free prose, batch 1."""
    from stagewise.bench.commands.spec import SpecSettings, check_settings, quick_settings, run_spec
    from stagewise.bench.commands.spec_report import plot_spec, spec_table

    console, out_dir = setup(threads, out, quick)
    base = quick_settings(model) if quick else SpecSettings(model=model)
    settings = SpecSettings(
        **asdict(base)
        | dict(
            backend=check_backend(backend),
            formats=split_names(quantization, "--quantization") if quantization else base.formats,
            methods=split_names(methods, "--methods"),
            num_speculative_tokens=positive(num_speculative_tokens, "--num-speculative-tokens", 4),
            max_tokens=positive(max_tokens, "--max-tokens", base.max_tokens),
            draft_layers=draft_layers,
            repeats=positive(repeats, "--repeats", base.repeats),
            prompts_per_kind=positive(prompts_per_kind, "--prompts-per-kind", base.prompts_per_kind),
            step_repeats=positive(step_repeats, "--step-repeats", base.step_repeats),
            batch_invariant=batch_invariant,
        )
    )
    check_settings(settings)
    name = check_result_files(out_dir, "spec", asdict(settings), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_spec(settings, progress=progress)
    finish(console, result, spec_table(result), plot_spec, out_dir, name)


@bench_app.command()
def prefix(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    backend: str = BACKEND,
    threads: int | None = THREADS,
    caches: str = typer.Option("none,hash,radix", help="prefix caches compared (the first is the reference)"),
    workloads: str = typer.Option("chat,few-shot,samples", help="workloads: chat, few-shot, samples"),
    block_size: int = typer.Option(16, help="tokens per KV block"),
    max_tokens: int | None = typer.Option(None, help="greedy tokens per answer, tokens per sample (default 24)"),
    turns: int | None = typer.Option(None, help="chat: turns per conversation (default 6)"),
    conversations: int | None = typer.Option(None, help="chat: conversations at once (default 4)"),
    samples: int | None = typer.Option(None, help="samples: n per prompt (default 4)"),
    prompt_tokens: int | None = typer.Option(None, help="samples: tokens per prompt (default 500)"),
    repeats: int | None = typer.Option(None, help="timed runs per workload and cache, alternating (default 3)"),
    batch_invariant: bool = options.BATCH_INVARIANT,
    overwrite: bool = OVERWRITE,
):
    """Prefix caches side by side (none, hash as vLLM, radix as SGLang): chat, few-shot, n samples."""
    from stagewise.bench.commands.prefix import PrefixSettings, check_settings, quick_settings, run_prefix
    from stagewise.bench.commands.prefix_report import plot_prefix, prefix_table

    console, out_dir = setup(threads, out, quick)
    base = quick_settings(model) if quick else PrefixSettings(model=model)
    settings = PrefixSettings(
        **asdict(base)
        | dict(
            model=model,
            backend=check_backend(backend),
            caches=split_names(caches, "--caches"),
            workloads=split_names(workloads, "--workloads"),
            block_size=positive(block_size, "--block-size", 16),
            max_tokens=positive(max_tokens, "--max-tokens", base.max_tokens),
            turns=positive(turns, "--turns", base.turns),
            conversations=positive(conversations, "--conversations", base.conversations),
            samples=positive(samples, "--samples", base.samples),
            prompt_tokens=positive(prompt_tokens, "--prompt-tokens", base.prompt_tokens),
            repeats=positive(repeats, "--repeats", base.repeats),
            batch_invariant=batch_invariant,
        )
    )
    check_settings(settings)
    name = check_result_files(out_dir, "prefix", asdict(settings), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_prefix(settings, progress=progress)
    finish(console, result, prefix_table(result), plot_prefix, out_dir, name)


@bench_app.command()
def invariance(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    threads: int | None = THREADS,
    quantization: str | None = typer.Option(
        None, help="weight formats: auto (packed GGUF), none (float32) (default auto,none; quick: auto)"
    ),
    repeats: int | None = typer.Option(None, help="alternated runs per row for decode and TTFT (default 5; quick 1)"),
    decode_tokens: int | None = typer.Option(None, help="greedy tokens of the decode run (default 64; quick 8)"),
    ttft_prompts: str | None = typer.Option(None, help="prompt lengths whose TTFT is timed (default 128,512)"),
    batching: bool = typer.Option(True, "--batching/--no-batching", help="also run bench batching's workload"),
    spec: bool = typer.Option(True, "--spec/--no-spec", help="also run bench spec's copy-heavy n-gram prompts"),
    overwrite: bool = OVERWRITE,
):
    """Batch invariance on vs off: decode, TTFT, continuous batching, n-gram speed-up (same weights, one run)."""
    from stagewise.bench.commands.invariance import (
        InvarianceSettings,
        check_settings,
        invariance_table,
        plot_invariance,
        run_invariance,
    )

    console, out_dir = setup(threads, out, quick)
    formats = (
        split_names(quantization, "--quantization") if quantization else (("auto",) if quick else ("auto", "none"))
    )
    settings = InvarianceSettings(
        model=model,
        formats=formats,
        repeats=positive(repeats, "--repeats", 1 if quick else 5),
        decode_tokens=positive(decode_tokens, "--decode-tokens", 8 if quick else 64),
        ttft_prompts=parse_ints(ttft_prompts, "--ttft-prompts")
        if ttft_prompts
        else ((32, 64) if quick else (128, 512)),
        batching=batching,
        spec=spec,
        quick=quick,
    )
    check_settings(settings)
    name = check_result_files(out_dir, "invariance", asdict(settings), overwrite, quick and out is None)
    with bench_display() as progress:  # stderr, transient; None when not a terminal
        result = run_invariance(settings, progress=progress)
    finish(console, result, invariance_table(result), plot_invariance, out_dir, name)


@bench_app.command()
def quant(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    threads: int | None = THREADS,
    systems: str = typer.Option("float32,packed,transformers,llama.cpp", help="systems compared"),
    llamacpp: str | None = typer.Option(
        None, help="node_modules holding node-llama-cpp (runs scripts/llamacpp_decode.mjs; else skipped)"
    ),
    max_tokens: int | None = typer.Option(None, help="greedy tokens per prompt (default 64; quick 4)"),
    repeats: int | None = typer.Option(None, help="rounds over prompts and systems (default 3; quick 1)"),
    prompts: int | None = typer.Option(None, help="the first N built-in prompts (default 3; quick 1)"),
    overwrite: bool = OVERWRITE,
):
    """A GGUF's weights kept quantized vs float32, transformers and llama.cpp: batch-1 decode, memory."""
    import sys

    from stagewise.bench.commands.quant import QuantSettings, plot_quant, quant_table, run_quant

    console, out_dir = setup(threads, out, quick)
    base = QuantSettings(max_tokens=4, repeats=1, prompts=1) if quick else QuantSettings()
    settings = QuantSettings(
        model=model,
        max_tokens=positive(max_tokens, "--max-tokens", base.max_tokens),
        repeats=positive(repeats, "--repeats", base.repeats),
        prompts=positive(prompts, "--prompts", base.prompts),
        systems=split_names(systems, "--systems"),
        llamacpp=llamacpp,
    )
    name = check_result_files(out_dir, "quant", asdict(settings), overwrite, quick and out is None)
    result = run_quant(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result["settings"] = json.loads(json.dumps(asdict(settings)))
    finish(console, result, quant_table(result), plot_quant, out_dir, name)


@bench_app.command()
def scale(
    out: str | None = OUT,
    quick: bool = QUICK,
    models: str | None = typer.Option(
        None,
        help="smollm2-135m, llama-3.2-1b / llama-3-8b (random Q4_0 files at those shapes) or .gguf files "
        "(default all three; quick: the first two)",
    ),
    prompt_tokens: str | None = typer.Option(
        None, help="prompt lengths in tokens (default 16,128,512,2048; quick 16,64)"
    ),
    threads: str | None = typer.Option(None, help="thread counts, every system at each (default 1,2; quick 2)"),
    systems: str = typer.Option(
        "packed,packed-int8,float32,transformers,llama.cpp",
        help="systems compared (packed-int8: the integer-dot kernel, where a C++ compiler is at hand)",
    ),
    llamacpp: str | None = typer.Option(
        None, help="node_modules holding node-llama-cpp (runs scripts/llamacpp_decode.mjs; else its row says why)"
    ),
    decode_tokens: int | None = typer.Option(None, help="greedy tokens per run (default 32; quick 4)"),
    repeats: int | None = typer.Option(None, help="rounds over the systems, alternated (default 3; quick 1)"),
    layers: int | None = typer.Option(None, help="random files: this many layers (default the shape's; quick 2)"),
    overwrite: bool = OVERWRITE,
):
    """Decode tok/s and time to first token from SmolLM2 to 8B-class files: stagewise, transformers, llama.cpp."""
    import sys

    from stagewise.bench.commands.scale import ScaleSettings, plot_scale, run_scale, scale_table

    console, out_dir = setup(None, out, quick)
    base = ScaleSettings()
    if quick:
        base = ScaleSettings(
            models=base.models[:2], prompt_tokens=(16, 64), threads=(2,), decode_tokens=4, repeats=1, layers=2
        )
    settings = ScaleSettings(
        models=split_names(models, "--models") if models is not None else base.models,
        prompt_tokens=parse_ints(prompt_tokens, "--prompt-tokens") if prompt_tokens is not None else base.prompt_tokens,
        threads=parse_ints(threads, "--threads") if threads is not None else base.threads,
        systems=split_names(systems, "--systems"),
        decode_tokens=positive(decode_tokens, "--decode-tokens", base.decode_tokens),
        repeats=positive(repeats, "--repeats", base.repeats),
        layers=positive(layers, "--layers", base.layers) if layers is not None else base.layers,
        llamacpp=llamacpp,
    )
    name = check_result_files(out_dir, "scale", asdict(settings), overwrite, quick and out is None)
    result = run_scale(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result["settings"] = json.loads(json.dumps(asdict(settings)))
    finish(console, result, scale_table(result), plot_scale, out_dir, name)


@bench_app.command()
def perplexity(
    model: str = MODEL,
    out: str | None = OUT,
    quick: bool = QUICK,
    threads: int | None = THREADS,
    backends: str = typer.Option(
        "naive,torch",
        help="tiers, each run with float32 and with packed weights; torch-stock: the torch tier with "
        "PyTorch's own packed kernels (as without a C++ compiler)",
    ),
    max_tokens: int | None = typer.Option(None, help="greedy tokens per prompt (default 32; quick 4)"),
    prompts: int | None = typer.Option(None, help="the first N built-in greedy prompts (default 8; quick 2)"),
    text_tokens: int | None = typer.Option(None, help="the first N tokens of the text (default all; quick 64)"),
    overwrite: bool = OVERWRITE,
):
    """Weights kept quantized vs dequantized to float32: perplexity of a fixed text, greedy agreement."""
    import sys

    from stagewise.bench.commands.perplexity import (
        PerplexitySettings,
        perplexity_table,
        plot_perplexity,
        run_perplexity,
    )

    console, out_dir = setup(threads, out, quick)
    base = PerplexitySettings(max_tokens=4, prompts=2, text_tokens=64) if quick else PerplexitySettings()
    settings = PerplexitySettings(
        model=model,
        backends=tuple(b if b == "torch-stock" else check_backend(b) for b in split_names(backends, "--backends")),
        text_tokens=positive(text_tokens, "--text-tokens", base.text_tokens),  # None: the whole text
        prompts=positive(prompts, "--prompts", base.prompts),
        max_tokens=positive(max_tokens, "--max-tokens", base.max_tokens),
    )
    name = check_result_files(out_dir, "perplexity", asdict(settings), overwrite, quick and out is None)
    result = run_perplexity(settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result["settings"] = json.loads(json.dumps(asdict(settings)))
    finish(console, result, perplexity_table(result), plot_perplexity, out_dir, name)


def main() -> None:
    """Run `bench` on its own (python -m stagewise.cli.bench ...), with the CLI's one-line errors."""
    from stagewise.cli.command import run_command

    run_command(bench_app)


if __name__ == "__main__":
    main()
