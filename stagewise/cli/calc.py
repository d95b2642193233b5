"""`stagewise calc`: the seeds' back-of-envelope arithmetic, for any model on any hardware.

(The seeds: the project's two source articles, named in the README's section "The seeds".)

    stagewise calc                                      # Llama 3 405B on an H100, N = 100k, batch 1
    stagewise calc --model llama-3-8b --context 8192 --batch 32 --explain
    stagewise calc --hardware h100-seeds --seeds        # the seeds' worked numbers next to ours
    stagewise calc --model smollm2-135m --hardware probe --dtype fp32 --plot plots/
    stagewise calc --tp 8 --hardware h200 --interconnect nvlink4   # 405B split over 8 GPUs: per device
    stagewise calc --model llama-3-8b --context 8192 --weights q4_0  # 4-bit weights, bf16 arithmetic
    stagewise calc --model smollm2-135m --weights gguf --hardware probe --dtype fp32  # the file's own types

The command only formats: every number comes from `stagewise.calc.roofline`.
Run this module directly (`python -m stagewise.cli.calc`) for the same
command on its own.
"""

import json
from pathlib import Path

import typer
from rich.console import Console

from stagewise.calc.roofline import Analysis, Quantity, analyze, load_hardware, load_model_config, seeds_table
from stagewise.calc.seeds import seeds_worked_examples
from stagewise.calc.units import human, seconds, si
from stagewise.calc.weight_formats import weight_bytes_of
from stagewise.errors import StagewiseError
from stagewise.files import check_writable, check_writable_folder, write_text_atomic
from stagewise.trace.fit import Col, FitTable


def _quantity_table(title: str, rows: list[tuple[str, Quantity]], explain: bool) -> FitTable:
    cols = [Col("quantity", wrap=True, min_width=24), Col("value", "right")]
    if explain:
        cols.append(Col("formula", wrap=True, min_width=20))
    return FitTable(title, cols, [[label, human(q), *([q.formula] if explain else [])] for label, q in rows])


def _steps_table(a: Analysis, explain: bool) -> FitTable:
    """Prefill, decode and a naive step side by side; at 80 columns, split in two tables sharing `step`."""
    hw, n, b = a.hardware, a.context, a.batch
    title = f"One step at the speed of light on {hw.name} ({a.dtype}), N={n:,}, B={b}"
    names = ("step", "FLOPs", "bytes moved", "FLOP/B", "ridge", "compute", "memory", "time", "verdict")
    cols = [Col(c, "left" if c in ("step", "verdict") else "right") for c in names]
    if explain:
        cols.append(Col("FLOPs = / bytes =", wrap=True, min_width=30))
    rows = []
    for step in (a.prefill, a.decode, a.naive):
        rows.append(
            [
                step.name,
                si(step.flops.value, "FLOP"),
                si(step.bytes.value, "B"),
                f"{step.intensity.value:,.4g}",
                f"{step.ridge.value:,.4g}",
                seconds(step.compute_time.value),
                seconds(step.memory_time.value),
                seconds(step.time.value),
                step.bound,
                *([f"{step.flops.formula}\n{step.bytes.formula}"] if explain else []),
            ]
        )
    return FitTable(title, cols, rows)


def _print_analysis(console: Console, a: Analysis, explain: bool, tp: int = 1) -> None:
    cfg, hw, cap = a.model, a.hardware, a.capacity
    shape = (
        f"L={cfg.num_layers} hidden={cfg.hidden_size} inter={cfg.intermediate_size} H={cfg.num_heads} "
        f"Hkv={cfg.num_kv_heads} d={cfg.head_dim} V={cfg.vocab_size}"
    )
    console.print(f"[bold]{cfg.name}[/bold]  {shape}")
    ridge = hw.ridge_point(a.dtype)
    console.print(
        f"[bold]{hw.name}[/bold]  {si(hw.peak_flops(a.dtype), 'FLOP/s')} {a.dtype}, "
        f"{si(hw.memory_bandwidth, 'B/s')}, {si(hw.memory_bytes, 'B')}, ridge {ridge:,.4g} FLOP/B"
        + (f"  ({hw.notes})" if explain and hw.notes else "")
    )
    if a.context > cfg.max_position_embeddings:
        console.print(f"note: N={a.context:,} exceeds the model's {cfg.max_position_embeddings:,} positions (what-if)")
    rows = [
        ("parameters (exact)", a.parameters),
        (f"weights in memory ({a.weights})", a.weight_bytes),
        ("bytes per weight, on average (scales included)", a.bytes_per_weight),
        ("matmul weights per block / hidden^2 (seeds: 11)", a.linear_coefficient),
        ("linear FLOPs per token (2 x matmul params)", a.linear_flops_per_token),
        ("  seeds' 2P", a.seeds_linear_flops_per_token),
        (f"attention FLOPs of one token at N={a.context:,}", a.attention_flops_at_n),
        ("  seeds' 4*L*N*hidden", a.seeds_attention_flops_at_n),
        (f"KV per token ({cfg.num_kv_heads} KV heads)", a.kv_per_token),
        (f"KV per token as MHA ({cfg.num_heads} KV heads)", a.kv_per_token_mha),
        (f"KV of one sequence, N={a.context:,}", a.kv_at_n),
        ("  as MHA", a.kv_at_n_mha),
    ]
    console.print(_quantity_table("The model, per token", rows, explain))
    console.print(_steps_table(a, explain))
    fits = ""
    if cap.free_for_kv.value <= 0:  # with --tp the per-device table below answers it
        fits = " (the weights alone do not fit on one device: " + (
            f"see the --tp {tp} table below)" if tp > 1 else "try --tp, --devices or fp8)"
        )
    rows = [
        (f"TTFT, {a.batch} prompt(s) of {a.context:,} tokens", a.prefill.time),
        ("time per output token (decode)", a.decode.time),
        ("decode throughput", a.decode_tokens_per_s),
        ("naive step of one sequence, seeds' formula (FLOPs)", a.naive_step_seeds),
        ("naive step / KV-cached step (FLOPs)", a.naive_over_cached),
        ("memory left for the KV cache" + fits, cap.free_for_kv),
        (f"largest batch at N={a.context:,} ({cfg.num_kv_heads} KV heads)", cap.max_batch),
        ("  as MHA", cap.max_batch_mha),
    ]
    console.print(_quantity_table("Speed of light and capacity", rows, explain))


def _print_tp(console: Console, t, hw, context: int, explain: bool) -> None:
    """The per-device view of `calc --tp N` (`calc/tensor_parallel.py`)."""
    cap = t.capacity
    fits = "" if cap.free_for_kv.value > 0 else " (the shards alone do not fit: more devices or fp8)"
    loc = t.local
    verdict = "latency-bound" if t.decode_latency_share.value > 0.5 else "bandwidth-bound"
    rows = [
        (
            f"weights per device ({loc.num_heads} heads, inter {loc.intermediate_size}, vocab {loc.vocab_size})",
            t.weights_per_device,
        ),
        (f"KV per token per device ({loc.num_kv_heads} KV heads)", t.kv_per_token_per_device),
        ("memory left for the KV cache per device" + fits, cap.free_for_kv),
        (f"largest batch at N={context:,} (each device holds its KV heads)", cap.max_batch),
        ("all-reduces per forward step", t.all_reduces_per_step),
        ("all-reduce bytes per token per layer", t.all_reduce_bytes_per_token_per_layer),
        ("one decode all-reduce: message", t.decode_message),
        (f"one decode all-reduce: ring time ({verdict})", t.decode_all_reduce),
        ("all-reduces of one decode step", t.decode_comm),
        ("decode step of one shard (speed of light)", t.decode_shard.time),
        ("time per output token, shard + all-reduces", t.decode_time),
        ("all-reduces of one prefill", t.prefill_comm),
        ("TTFT, shard + all-reduces", t.prefill_time),
    ]
    title = f"Tensor parallelism: {t.tp} x {hw.name} over {t.link.name}, per device"
    console.print(_quantity_table(title, rows, explain))


def _print_seeds(console: Console, explain: bool) -> None:
    title = "The seeds' worked numbers (Llama 3 405B, fp16, 1 PFLOP/s, 3.3 TB/s)"
    cols = [Col("ch"), Col("quantity", wrap=True, min_width=16), Col("unit")]
    cols += [Col(c, "right") for c in ("seed", "ours", "diff")]
    cols += [Col("exact (real 405B)", "right"), Col("where the seeds simplify", wrap=True, min_width=30)]
    if explain:
        cols.append(Col("our formula", wrap=True, min_width=30))
    rows = []
    for r in seeds_worked_examples():
        ok = "" if abs(r.rel_diff) <= r.tolerance else " !"
        exact = "same" if r.exact is None else f"{r.exact:,.5g}"
        cells = [r.chapter, r.quantity, r.unit, f"{r.seed:,.5g}", f"{r.ours:,.5g}", f"{r.rel_diff:+.2%}{ok}", exact]
        rows.append([*cells, r.note, *([r.formula] if explain else [])])
    console.print(FitTable(title, cols, rows, keys=2))


def calc(
    model: str = typer.Option("llama-3-405b", help="preset, HF config.json (or its folder) or .gguf file"),
    hardware: str = typer.Option("h100", help="h100, h200, a100, h100-seeds, or probe (measure this machine)"),
    context: int = typer.Option(100_000, help="N: tokens in the sequence (prompt length for the prefill)"),
    batch: int = typer.Option(1, help="B: sequences processed together"),
    dtype: str = typer.Option("bf16", help="compute and KV cache dtype (and the weights', without --weights)"),
    weights: str | None = typer.Option(
        None,
        help="the weights' storage: fp32, bf16, fp16, fp8, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, or gguf "
        "(each tensor's own type in the --model .gguf file); default: --dtype",
    ),
    devices: int = typer.Option(1, help="this many identical devices as one (ideal tensor parallelism)"),
    tp: int = typer.Option(
        1, "--tp", "--tensor-parallel-size", help="split the model over N devices: per-device memory, all-reduce cost"
    ),
    interconnect: str | None = typer.Option(
        None, help="link between the --tp devices: nvlink4, nvlink3, pcie5, pcie4 (default: the hardware's own)"
    ),
    explain: bool = typer.Option(False, "--explain", help="show the formula next to each number"),
    seeds: bool = typer.Option(False, "--seeds", help="print the seeds' worked examples next to ours"),
    plot: str | None = typer.Option(None, help="write roofline.png and kv_memory.png into this directory"),
    json_out: str | None = typer.Option(None, help="write every number (and formula) to this JSON file"),
):
    """Back-of-envelope inference numbers: FLOPs, bytes, KV cache, roofline, speed of light, max batch."""
    from dataclasses import asdict

    if plot is not None:  # checked before any work (the probe takes seconds)
        folder = Path(plot)
        if folder.exists() and not folder.is_dir():
            raise StagewiseError(f"--plot {plot} is a file; give a folder (roofline.png and kv_memory.png go there)")
        check_writable_folder(folder, "--plot")
    if json_out is not None:
        check_writable(json_out, "--json-out")
    from stagewise.calc.tensor_parallel import analyze_tp, default_interconnect, get_interconnect

    if tp < 1:
        raise StagewiseError(f"--tp must be >= 1, got {tp}")
    if tp > 1 and weights is not None:
        raise StagewiseError("--weights is not modelled per device under --tp yet; drop one of the two")
    if tp > 1 and devices > 1:
        raise StagewiseError("give --tp (N devices with all-reduces) or --devices (N ideal devices as one), not both")
    link = get_interconnect(interconnect if interconnect is not None else default_interconnect(hardware))
    config = load_model_config(model)
    stored = None if weights is None else weight_bytes_of(config, weights, dtype, model)
    hw = load_hardware(hardware).scaled(devices)
    result = analyze(config, hw, context=context, batch=batch, dtype=dtype, weights=stored)
    tp_result = None
    if tp > 1:
        tp_result = analyze_tp(config, hw, tp, result.dtype, result.dtype_bytes, context, batch, link)
    console = Console()
    _print_analysis(console, result, explain, tp)
    if tp_result is not None:
        _print_tp(console, tp_result, hw, context, explain)
    if seeds:
        _print_seeds(console, explain)
    if plot is not None:
        from stagewise.calc.plots import plot_kv_memory, plot_roofline, points_from_steps

        out = Path(plot)
        suffix = f" N={context:,} B={batch}"
        steps = (result.prefill, result.decode, result.naive)
        plot_roofline(hw, points_from_steps(steps, suffix), out / "roofline.png", dtype=result.dtype)
        top = max(4 * context, config.max_position_embeddings)
        contexts = sorted({int(1000 * (top / 1000) ** (i / 40)) for i in range(41)} | {context})
        plot_kv_memory([config], contexts, out / "kv_memory.png", result.dtype_bytes, hw)
        console.print(f"wrote {out / 'roofline.png'} and {out / 'kv_memory.png'}")
    if json_out is not None:
        data = {"analysis": asdict(result), "ridge_point": hw.ridge_point(result.dtype)}
        if tp_result is not None:
            data["tensor_parallel"] = asdict(tp_result)
        if seeds:
            data["seeds"] = seeds_table()
        try:
            write_text_atomic(json_out, json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise StagewiseError(f"cannot write {json_out}: {exc.strerror}") from None
        console.print(f"wrote {json_out}")


def main() -> None:
    """`python -m stagewise.cli.calc ...`: the calc command alone, with the CLI's exit-2 errors."""
    from stagewise.cli.command import run_command

    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(calc)
    run_command(app)


if __name__ == "__main__":
    main()
