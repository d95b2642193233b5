"""`stagewise bench stages`: every registry stage, naive PyTorch vs its optimized path, at two shapes.

The seeds' chapter 8 asymmetry, stage by stage: a *prefill* shape (many
tokens at once: GEMMs, compute-bound on a GPU) and a *decode* shape (one token:
GEMVs, memory-bound). Each stage runs on its registry `example_inputs(config,
num_tokens, device, dtype)` — the same kwargs for both paths — and the two
paths are timed alternately (naive, optimized, naive, ...) after a warm-up,
synchronized, medians with p10/p90.

On a CUDA GPU the default is the real model's config in bfloat16. Without one,
the Triton kernels run in Triton's CPU *interpreter*, which executes every
program instance in Python (~1 ms each): orders of magnitude slower than any
compiled code. There the benchmark is a correctness-mode run only — it checks
that every stage runs end to end — and says so in the table and the JSON; it
defaults to the `tiny` config and few repeats. The tokenize stage takes text
(its optimized path is the Rust `tokenizers` library, a real speed measurement
on any machine).
"""

import importlib.util
from dataclasses import asdict, dataclass

import torch

from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.plots import plot_stage_times, save_figure
from stagewise.bench.harness.timing import compare
from stagewise.config import PRESETS, get_preset
from stagewise.errors import StagewiseError
from stagewise.stages import STAGES

INTERPRETER_NOTE = "interpreter: correctness only, not a speed measurement"


@dataclass(frozen=True)
class StagesSettings:
    model: str | None = None  # a preset's config; None = smollm2-135m on CUDA, tiny on the CPU
    device: str | None = None  # cpu / cuda; None = cuda when available
    dtype: str | None = None  # None = bfloat16 on CUDA, float32 on the CPU
    prefill_tokens: int = 128  # num_tokens of the prefill shape
    decode_tokens: int = 1  # num_tokens of the decode shape
    repeats: int | None = None  # timed calls per path; None = 20 on CUDA, 3 on the CPU
    warmup: int | None = None  # untimed calls per path first; None = 3 on CUDA, 1 on the CPU
    stages: tuple[str, ...] = ()  # stage names; empty = all, in pipeline order


def resolve(settings: StagesSettings) -> StagesSettings:
    """Fill the device-dependent defaults in."""
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise StagewiseError("--device cuda, but torch sees no CUDA device")
    if device.startswith("meta"):
        raise StagewiseError("--device meta holds no data: nothing to time; use cpu or cuda")
    gpu = device.startswith("cuda")
    model = settings.model or ("smollm2-135m" if gpu else "tiny")
    if model not in PRESETS:
        raise StagewiseError(f"bench stages takes a preset's shapes: one of {', '.join(PRESETS)}, not '{model}'")
    for name in settings.stages:
        if name not in STAGES:
            raise StagewiseError(f"unknown stage '{name}'; stages are {', '.join(STAGES)}")
    return StagesSettings(
        model=model,
        device=device,
        dtype=settings.dtype or ("bfloat16" if gpu else "float32"),
        prefill_tokens=settings.prefill_tokens,
        decode_tokens=settings.decode_tokens,
        repeats=settings.repeats or (20 if gpu else 3),
        warmup=settings.warmup if settings.warmup is not None else (3 if gpu else 1),
        stages=settings.stages or tuple(STAGES),
    )


def triton_mode() -> str | None:
    """'cuda', 'interpreter', or None when Triton is missing (configured before any kernel import)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from stagewise.runtime import configure_triton

    return configure_triton()


def run_stages(settings: StagesSettings, progress=None) -> dict:
    """Time naive vs optimized for every stage at the prefill and the decode shape."""
    s = resolve(settings)
    config = get_preset(s.model)
    device, dtype = torch.device(s.device), getattr(torch, s.dtype)
    mode = triton_mode()
    shapes = (("prefill", s.prefill_tokens), ("decode", s.decode_tokens))
    total = len(s.stages) * len(shapes) * 2 * s.repeats
    task = progress.add_task("stages", total=total) if progress is not None else None
    rows = []
    for name in s.stages:
        stage = STAGES[name]
        kind = stage.triton_kind
        uses_triton = kind.startswith("triton")
        note = ""
        if kind.startswith("fallback"):
            note = "optimized path is a fallback to naive"
        elif uses_triton and mode is None:
            note = "Triton is not installed: optimized path skipped"
        elif uses_triton and mode == "interpreter":
            note = INTERPRETER_NOTE
        for phase, num_tokens in shapes:
            if progress is not None:
                progress.update(task, description=f"{name:>15} {phase} T={num_tokens}")
            inputs = {p: stage.example_inputs(config, num_tokens, device, dtype) for p in ("naive", "optimized")}
            variants = {"naive": lambda f=stage.naive, i=inputs["naive"]: f(**i)}
            if not (uses_triton and mode is None):
                variants["optimized"] = lambda f=stage.triton, i=inputs["optimized"]: f(**i)
            on_sample = (lambda n, ms: progress.advance(task)) if progress is not None else None
            timings = compare(variants, repeats=s.repeats, warmup=s.warmup, device=device, on_sample=on_sample)
            naive, opt = timings["naive"], timings.get("optimized")
            rows.append(
                {
                    "stage": name,
                    "phase": phase,
                    "num_tokens": num_tokens,
                    "shape": f"{phase} T={num_tokens}",
                    "naive_ms": naive.median_ms,
                    "naive_p10_ms": naive.p10_ms,
                    "naive_p90_ms": naive.p90_ms,
                    "optimized_ms": opt.median_ms if opt else None,
                    "optimized_p10_ms": opt.p10_ms if opt else None,
                    "optimized_p90_ms": opt.p90_ms if opt else None,
                    "speedup": naive.median_ms / opt.median_ms if opt else None,
                    "optimized_kind": kind,
                    "note": note,
                    "samples_ms": {k: list(t.samples_ms) for k, t in timings.items()},
                }
            )
    return {
        "benchmark": "stages",
        "machine": machine_info(),
        "settings": asdict(s),
        "config": asdict(config),
        "triton_mode": mode,
        "note": INTERPRETER_NOTE if mode == "interpreter" else None,
        "rows": rows,
        "summary": {f"{r['stage']}/{r['phase']}": r["speedup"] for r in rows},
    }


def stages_table(result: dict):
    """Naive vs optimized per stage (FitTable: cells are Text, so a note like [interpreter] is not markup)."""
    from stagewise.trace.fit import Col, FitTable

    s = result["settings"]
    title = f"naive vs optimized per stage — {s['model']} config, {s['device']}, {s['dtype']} (median ms)"
    if result["note"]:
        title += f"\nTriton {result['note']}"
    cols = [Col("stage"), Col("shape"), Col("naive ms (p10-p90)", "right"), Col("optimized ms (p10-p90)", "right")]
    cols += [Col("speed-up", "right"), Col("optimized path", wrap=True, min_width=12)]
    rows = []
    for r in result["rows"]:
        opt = "-"
        if r["optimized_ms"] is not None:
            opt = f"{r['optimized_ms']:.3f} ({r['optimized_p10_ms']:.3f}-{r['optimized_p90_ms']:.3f})"
        rows.append(
            [
                r["stage"],
                r["shape"],
                f"{r['naive_ms']:.3f} ({r['naive_p10_ms']:.3f}-{r['naive_p90_ms']:.3f})",
                opt,
                f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                r["optimized_kind"].split(":")[0] + ("" if r["note"] in ("", INTERPRETER_NOTE) else f" [{r['note']}]"),
            ]
        )
    return FitTable(title, cols, rows)


def plot_stages(result: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(result["rows"])), 6))
    s = result["settings"]
    note = f"{s['model']} config, {s['device']}, {s['dtype']}"
    if result["note"]:
        note += f" — Triton {result['note']}"
    plot_stage_times(result["rows"], ax=ax, note=note)
    save_figure(fig, path)
