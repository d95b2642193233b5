"""`stagewise bench modes`: naive recompute vs KV cache vs paged KV, one prompt, growing outputs.

What the seeds predict (chapters 5 and 6), for a context of N tokens, L layers,
hidden size d:

    naive step  (recompute all N tokens):  O(L * (N * d^2 + N^2 * d))
    cached step (one new token, K/V kept): O(L * (d^2 + N * d))

So the time to produce one more token grows with the context in naive mode
(linearly at first, the N^2 attention term taking over for long contexts) and
stays nearly flat with a KV cache (the d^2 GEMV term dominates; attention
adds a little per token of context). We measure it: every mode generates the
same greedy tokens for the same prompt, for growing output lengths; the gaps
between consecutive tokens give the time per token at each context length,
and non-negative least-squares fits of those curves

    naive:  t(N) = a + b*N + c*N^2        kv, paged:  t(N) = a + b*N

are drawn over the measurements. Before any number is reported, the token ids
of every run are compared with the first run of that output length: a mode
that produced different tokens did different work, and its timing means
nothing (StagewiseError).

`--tp 1,2` runs every mode at each tensor-parallel size too ("paged tp2":
the same engine over 2 ranks, gloo on a CPU). On a CPU with few cores this
measures what TP costs rather than what it saves: the ranks share the same
cores and memory bandwidth (no extra hardware is added, unlike N GPUs), and
every step adds 2 all-reduces per block and a broadcast of the batch through
the loopback network stack, each tens of microseconds.

`--formats none,auto` runs every mode once per weight format (`quantization=`
of the load: "none" float, "auto" a GGUF's own packed blocks, "int8" / "int4"
a float checkpoint quantized at load): "kv [auto]" beside "kv [none]". Decode
streams every weight once per token, so the time per token should follow the
bytes per weight: SmolLM2-135M's projections are ~0.6 bytes a weight packed
(Q4_1) against 4 in float32, and each format's own weight-streaming floor
(its `decode_bytes` at the same measured read bandwidth) is printed beside it.
"""

import statistics
from dataclasses import asdict, dataclass

import numpy as np
import torch

from stagewise.bench.harness.decode_overhead import stage_breakdown, weight_streaming
from stagewise.bench.harness.machine import busy_note, machine_info
from stagewise.bench.harness.plots import plot_throughput, plot_time_per_token, save_figure
from stagewise.bench.harness.progress import row
from stagewise.bench.harness.timing import alternating, stream_timed
from stagewise.bench.harness.workloads import BenchRequest, single_prompt
from stagewise.config import PRESETS, EngineConfig
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.models.quantized import check_quantization, weight_formats
from stagewise.models.registry import LoadedModel, load_model
from stagewise.tuning.cpu_load import LoadProbe

DEFAULT_OUTPUT_LENGTHS = (16, 64, 256, 512)
MODES = ("naive", "kv", "paged")
FIT_POWERS = {"naive": (0, 1, 2), "kv": (0, 1), "paged": (0, 1), "transformers": (0, 1)}  # per-step cost in N
COMPARE = ("transformers",)  # other systems that can run the same prompt


@dataclass(frozen=True)
class ModesSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory
    backend: str = "torch"  # the tier of every stage: naive, torch or triton
    device: str | None = None  # cpu / cuda; None = cuda when available
    dtype: str | None = None  # float32 / bfloat16; None = the loader's default for the device
    prompt_tokens: int = 32  # length of the one prompt
    output_lengths: tuple[int, ...] = DEFAULT_OUTPUT_LENGTHS  # max_tokens of each measured run
    repeats: int = 3  # timed runs per (mode, output length), alternating the modes
    warmup_tokens: int = 4  # one untimed run of this many tokens per mode first
    modes: tuple[str, ...] = MODES  # which modes to compare
    compare: tuple[str, ...] = ()  # other systems on the same prompt: "transformers" (HF generate, KV-cached)
    seed: int = 0  # prompt seed
    tp: tuple[int, ...] = (1,)  # tensor-parallel sizes to run each mode at ("paged tp2", ...)
    on_mismatch: str = "raise"  # different tokens between modes: "raise", or "record" them and time on
    formats: tuple[str, ...] = ()  # weight formats (quantization=) to run each mode with; () = as loaded
    batch_invariant: bool = True  # False: the torch tier's batch-variant paths (--no-batch-invariant)


def settings_dict(settings: ModesSettings) -> dict:
    """The settings as a result file records them (without `tp` at its default: older results still match)."""
    out = asdict(settings)
    if settings.tp == (1,):
        del out["tp"]
    if settings.on_mismatch == "raise":
        del out["on_mismatch"]
    if not settings.formats:
        del out["formats"]
    return out


def system_name(mode: str, tp: int, fmt: str | None = None) -> str:
    """The system's name: the mode, its TP size, its weights ("paged tp2", "kv [auto]", ...)."""
    name = mode if tp == 1 else f"{mode} tp{tp}"
    return name if fmt is None else f"{name} [{fmt}]"


def engine_systems(settings: ModesSettings) -> dict[str, tuple[str, int, str | None]]:
    """Every (mode, tensor-parallel size, weight format) measured, by its name in tables and plots."""
    formats = settings.formats or (None,)
    return {system_name(m, n, f): (m, n, f) for f in formats for n in settings.tp for m in settings.modes}


def check_identical(tokens: dict[str, list[int]], what: str, mismatches: list[str] | None = None) -> None:
    """Raise StagewiseError naming the first position where two runs' token ids differ.

    With a `mismatches` list the difference is appended there instead and the caller times on: a
    greedy near-tie on random weights can flip one token between two correct kernels."""
    (ref_name, ref), *others = tokens.items()
    for name, ids in others:
        if ids != ref:
            pos = next((i for i, (a, b) in enumerate(zip(ref, ids)) if a != b), min(len(ref), len(ids)))
            message = (
                f"{what}: '{name}' produced different tokens than '{ref_name}' (first difference at output "
                f"token {pos}: {ref[pos : pos + 3]} vs {ids[pos : pos + 3]})"
            )
            if mismatches is None:
                raise StagewiseError(message + "; timings of different outputs are not compared")
            mismatches.append(message)


def run_notes(backend: str, loaded: LoadedModel, llm: LLM | None = None, batch_invariant: bool = True) -> list[str]:
    """Caveats a reader of the numbers must see (stored in the JSON, printed under the table)."""
    notes = [
        "batch-invariant: on (a request's logits the same bits in any batch)"
        if batch_invariant
        else "batch-invariant: off (--no-batch-invariant: the torch tier's batch-variant paths)"
    ]
    if backend == "triton" and loaded.device.type == "cpu":
        notes.append("Triton kernels ran in the CPU interpreter: correctness only, not a speed measurement")
    if loaded.device.type == "cpu" and backend == "torch":
        from stagewise.tuning.gemm_forms import CPU_FORMS

        notes.append(CPU_FORMS.describe())
    return notes


def fit_cost(context: list[int], ms: list[float], powers: tuple[int, ...]) -> dict:
    """Non-negative least squares ms ~ sum_k coef_k * N^powers_k; returns coefficients, a label and R^2.

    Costs cannot be negative, so every subset of the terms is fitted and the best fit whose
    coefficients are all >= 0 wins (at most 3 terms: 7 small solves; a constant alone always qualifies
    when the times are positive).
    """
    n = np.asarray(context, dtype=np.float64)
    y = np.asarray(ms, dtype=np.float64)
    best = None
    for mask in range(1, 2 ** len(powers)):
        used = [p for k, p in enumerate(powers) if mask >> k & 1]
        basis = np.stack([n**p for p in used], axis=1)  # [points, terms]
        coef, *_ = np.linalg.lstsq(basis, y, rcond=None)
        if (coef < 0).any():
            continue
        sse = float(((y - basis @ coef) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, dict(zip(used, coef)))
    sse, chosen = best if best is not None else (float(((y - y.mean()) ** 2).sum()), {0: float(y.mean())})
    coef = [float(chosen.get(p, 0.0)) for p in powers]
    ss_tot = float(((y - y.mean()) ** 2).sum())
    names = {0: "", 1: "·N", 2: "·N²"}
    label = " + ".join(f"{c:.3g}{names[p]}" for c, p in zip(coef, powers)) + " ms"
    return {"powers": list(powers), "coef_ms": coef, "label": label, "r2": 1 - sse / ss_tot if ss_tot > 0 else 1.0}


def eval_fit(fit: dict, context: list[int]) -> list[float]:
    return [sum(c * n**p for c, p in zip(fit["coef_ms"], fit["powers"])) for n in context]


def refuse_weightless(model: str, device: str | None, loaded: LoadedModel | None = None) -> None:
    """A benchmark of a model without weights (shape-only preset, meta device) would time nothing."""
    config = loaded.config if loaded is not None else PRESETS.get(model)
    meta = (loaded.device.type if loaded is not None else str(device or "")).startswith("meta")
    if meta or (config is not None and config.shape_only):
        raise StagewiseError(
            f"{model} has no weights here (shape only, meta device): nothing to measure; "
            "it can be traced (stagewise trace) or sized (stagewise calc)"
        )


def check_settings(settings: ModesSettings) -> None:
    """Every setting in range, before anything is loaded."""
    refuse_weightless(settings.model, settings.device)
    for mode in settings.modes:
        if mode not in MODES:
            raise StagewiseError(f"unknown mode '{mode}'; use {', '.join(MODES)}")
    if not settings.modes:
        raise StagewiseError(f"no modes to compare; use some of {', '.join(MODES)}")
    for name in settings.compare:
        if name not in COMPARE:
            raise StagewiseError(f"unknown system '{name}' for --compare; use {', '.join(COMPARE)}")
    if not settings.output_lengths or min(settings.output_lengths) < 2:
        raise StagewiseError("output lengths must be >= 2 tokens (a time between tokens needs two)")
    if settings.repeats < 1:
        raise StagewiseError(f"repeats must be >= 1, got {settings.repeats}")
    if settings.prompt_tokens < 1:
        raise StagewiseError(f"prompt_tokens must be >= 1, got {settings.prompt_tokens}")
    if not settings.tp or min(settings.tp) < 1:
        raise StagewiseError(f"tensor-parallel sizes must be >= 1, got {settings.tp}")
    for fmt in settings.formats:
        check_quantization(fmt)  # one line naming the known ones
    if len(set(settings.formats)) != len(settings.formats):
        raise StagewiseError(f"--formats names a format twice: {','.join(settings.formats)}")


def check_fits_positions(loaded: LoadedModel, needed: int, what: str) -> None:
    """The longest request must fit the model's positions; said in the user's own flags."""
    limit = loaded.config.max_position_embeddings
    if needed > limit:
        raise StagewiseError(f"{what} needs {needed} positions; {loaded.config.name} allows {limit}")


def run_modes(settings: ModesSettings, loaded: LoadedModel | None = None, progress=None) -> dict:
    """Run the comparison; returns the result dict (settings, raw runs, summary, curves, fits)."""
    check_settings(settings)
    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    if settings.formats:  # one load per weight format (`loaded`, if given, is not used)
        models = {f: load_model(settings.model, settings.device, dtype, quantization=f) for f in settings.formats}
    else:
        models = {None: loaded or load_model(settings.model, settings.device, dtype)}
    loaded = next(iter(models.values()))  # the tokenizer and sizes are the same in every format
    refuse_weightless(settings.model, settings.device, loaded)
    prompt = single_prompt(loaded.tokenizer, settings.prompt_tokens, settings.seed)
    lengths = sorted(set(settings.output_lengths))
    what = f"--prompt-tokens {settings.prompt_tokens} with --output-lengths up to {max(lengths)}"
    check_fits_positions(loaded, settings.prompt_tokens + max(lengths) + 1, what)
    # no prefix cache: every repeat prefills its prompt (a cached prompt's TTFT would time a lookup)
    ecfg = EngineConfig(
        max_num_seqs=1,
        max_model_len=settings.prompt_tokens + max(lengths) + 1,
        enable_prefix_caching=False,
    )
    engines = engine_systems(settings)
    llms = {}
    try:
        for name, (mode, tp, fmt) in engines.items():
            llms[name] = LLM(
                models[fmt],
                backend=settings.backend,
                mode=mode,
                engine_config=ecfg,
                tensor_parallel_size=tp,
                batch_invariant=settings.batch_invariant,
            )
        result = _measure(settings, loaded, prompt, lengths, llms, progress)
        if settings.formats:  # what each format kept, e.g. "q4_1 x 120, q8_0 x 1, float32 x 61"
            result["formats"] = {f: weight_formats(m.weights) for f, m in models.items()}
        return result
    finally:
        for llm in llms.values():
            llm.shutdown()  # tensor-parallel workers end with the benchmark


def _measure(settings: ModesSettings, loaded: LoadedModel, prompt: str, lengths: list[int], llms, progress) -> dict:
    # The warm-up never asks for more tokens than the longest measured run: the engine's max_model_len is sized
    # for the measured runs, so `--output-lengths 2` with a 4-token warm-up would not fit it.
    warm_tokens = min(settings.warmup_tokens, max(lengths))
    warm = BenchRequest(prompt, settings.prompt_tokens, warm_tokens).params()
    with row(progress, "warm-up (untimed)", total=len(llms) + len(settings.compare)) as bar:
        for llm in llms.values():
            stream_timed(llm, [prompt], [warm])
            bar.advance()
        hf = None
        if "transformers" in settings.compare:
            from stagewise.bench.harness.hf_baseline import HFBaseline

            bar.update("loading transformers' model")
            hf = HFBaseline(settings.model, loaded.device, loaded.dtype)
            prompt_ids = loaded.tokenizer.encode(prompt)
            pad_id = loaded.tokenizer.pad_id if loaded.tokenizer.pad_id is not None else 0
            hf.run([prompt_ids], [warm_tokens], 1, pad_id)
    systems = [*llms, *settings.compare]

    total = sum(lengths) * len(systems) * settings.repeats
    task = progress.add_task("modes", total=total) if progress is not None else None
    runs, reference, mismatches = [], {}, ([] if settings.on_mismatch == "record" else None)
    formats = {name: fmt for name, (_, _, fmt) in engine_systems(settings).items()}
    with LoadProbe() as probe:  # how much of the CPU other processes take while we time
        for length in lengths:
            params = BenchRequest(prompt, settings.prompt_tokens, length).params()
            for rep, mode in alternating(systems, settings.repeats):
                if progress is not None:
                    progress.update(task, description=f"{mode:>5} {length:>4} tokens, run {rep + 1}/{settings.repeats}")
                if mode == "transformers":  # one prompt, batch of one: HF generate with its own KV cache
                    (req,) = hf.run([prompt_ids], [length], 1, pad_id).requests
                    if progress is not None:
                        progress.advance(task, length)
                else:
                    on_event = (lambda e, now: progress.advance(task)) if progress is not None else None
                    (req,) = stream_timed(llms[mode], [prompt], [params], on_event)
                # runs of one weight format must agree; two formats' weights differ, and so may their tokens
                key = (length, formats.get(mode, "none" if "none" in settings.formats else None))
                reference.setdefault(key, (mode, req.token_ids))
                ref_mode, ref_ids = reference[key]
                run_tokens = {ref_mode: ref_ids, f"{mode} (run {rep + 1})": req.token_ids}
                check_identical(run_tokens, f"{length} tokens", mismatches)
                m = req.metrics()
                runs.append(
                    {
                        "mode": mode,
                        "output_tokens": length,
                        "repeat": rep,
                        "ttft_ms": 1000 * m.ttft,
                        "latency_s": m.latency,
                        "tokens_per_s": length / m.latency,  # throughput of the request, TTFT included
                        "tps": m.tps,  # the seeds' TPS: 1 / mean(TBT)
                        "tbt_ms": [round(1000 * g, 4) for g in m.tbt],
                    }
                )
    # one device only: a tensor-parallel step's trace holds every rank's stages (they would add up twice)
    cached = [name for name, (mode, tp, _) in engine_systems(settings).items() if mode != "naive" and tp == 1]
    streaming = weight_streaming(llms[cached[0]]) if cached else None
    by_format = format_streaming(settings, llms, streaming) if settings.formats and streaming else None
    short = BenchRequest(prompt, settings.prompt_tokens, min(64, max(lengths))).params()
    with row(progress, "per-stage breakdown (a traced run per mode)", total=len(cached)) as bar:
        overhead = {}
        for m in cached:
            overhead[m] = stage_breakdown(llms[m], prompt, short)
            bar.advance()
    result = {
        "benchmark": "modes",
        "machine": machine_info(),
        "settings": settings_dict(settings),
        "model": {
            k: v for k, v in next(iter(llms.values())).describe().items() if k not in ("mode", "tensor_parallel_size")
        },
        "prompt": prompt,
        "prompt_tokens": settings.prompt_tokens,
        "outputs_identical": not mismatches,
        **({"mismatches": mismatches} if mismatches else {}),
        "notes": run_notes(
            settings.backend, loaded, llms[systems[0]] if systems[0] in llms else None, settings.batch_invariant
        )
        + [note for note in [busy_note(probe.others, "the modes")] if note],
        "cpu_others_share": probe.others,  # the CPU share other processes used during the timed runs
        "weight_streaming": streaming,  # the time to read the weights once: the floor of a decode token
        **({"weight_streaming_by_format": by_format} if by_format else {}),
        "overhead": overhead,  # per cached mode, a traced decode step split by stage (bench/harness/decode_overhead.py)
        "token_ids": {
            str(length) if fmt is None else f"{length} [{fmt}]": ids for (length, fmt), (_, ids) in reference.items()
        },
        "runs": runs,
    }
    result.update(summarize_modes(runs, settings))
    add_ratios(result)
    return result


def format_streaming(settings: ModesSettings, llms: dict, first: dict) -> dict:
    """Each format's weight-streaming floor: its own decode bytes at the one measured read speed."""
    out = {}
    for name, (_, tp, fmt) in engine_systems(settings).items():
        if tp == 1 and fmt not in out:
            decode_bytes = llms[name].model.weights.decode_bytes()
            ms = 1e3 * decode_bytes / (first["read_GBps"] * 1e9)
            out[fmt] = {**first, "decode_bytes": decode_bytes, "ms": ms}
    return out


def summarize_modes(runs: list[dict], settings: ModesSettings) -> dict:
    """Medians over repeats per (mode, length); the time-per-token curve and its fit from the longest runs."""
    summary: dict[str, dict] = {}
    curves, fits = {}, {}
    longest = max(r["output_tokens"] for r in runs)
    for mode in [*engine_systems(settings), *settings.compare]:
        summary[mode] = {}
        for length in sorted({r["output_tokens"] for r in runs}):
            rs = [r for r in runs if r["mode"] == mode and r["output_tokens"] == length]
            tbt_ms = statistics.median(statistics.median(r["tbt_ms"]) for r in rs)
            summary[mode][str(length)] = {
                "ttft_ms": statistics.median(r["ttft_ms"] for r in rs),
                "tbt_ms": tbt_ms,
                "latency_s": statistics.median(r["latency_s"] for r in rs),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                "tps": 1000 / tbt_ms,  # 1 / the TBT beside it, the same median (each run's 1/mean: "runs")
            }
        gaps = [r["tbt_ms"] for r in runs if r["mode"] == mode and r["output_tokens"] == longest]
        ms = [statistics.median(col) for col in zip(*gaps)]  # per position, the median over repeats
        context = [settings.prompt_tokens + i + 1 for i in range(len(ms))]  # the step that made token i+1
        curves[mode] = {"context_len": context, "ms_per_token": ms}
        powers = FIT_POWERS[mode.split(" ")[0]]  # "paged tp2" fits like "paged"
        if len(ms) >= len(powers):
            fits[mode] = fit_cost(context, ms, powers)
    return {"summary": summary, "time_per_token": curves, "fits": fits}


def add_ratios(result: dict) -> None:
    """Per mode and length: TBT over the weight-streaming time (of the system's own weight format),
    and tokens/s over transformers' (same run)."""
    stream_ms = (result.get("weight_streaming") or {}).get("ms")
    by_format = result.get("weight_streaming_by_format") or {}
    hf = result["summary"].get("transformers")
    for mode, by_length in result["summary"].items():
        fmt = format_of(mode)
        own_ms = by_format[fmt]["ms"] if fmt in by_format else stream_ms
        for length, s in by_length.items():
            s["tbt_over_streaming"] = s["tbt_ms"] / own_ms if own_ms else None
            s["vs_transformers"] = s["tokens_per_s"] / hf[length]["tokens_per_s"] if hf else None


def format_of(system: str) -> str | None:
    """The weight format in a system's name: "kv [auto]" -> "auto"; "kv", "transformers" -> None."""
    return system[system.index("[") + 1 : -1] if system.endswith("]") else None


def modes_table(result: dict):
    """The summary, with the speed-up of each mode over naive recompute (FitTable: split, never cut, when the
    terminal is narrow; cells are Text, never markup)."""
    from rich.console import Group
    from rich.text import Text

    from stagewise.trace.fit import Col, FitTable

    heads = ["TTFT ms", "ms/token (TBT)", "TPS (1/TBT)", "tokens/s (n/latency)", "total s", "vs naive"]
    stream = result.get("weight_streaming")
    has_hf = "transformers" in result["summary"]
    heads += ["TBT / stream"] * bool(stream) + ["vs transformers"] * has_hf
    cols = [Col("mode"), Col("output tokens", "right"), *(Col(h, "right") for h in heads)]
    summary = result["summary"]
    rows = []
    for mode, by_length in summary.items():
        fmt = format_of(mode)
        naive = "naive" if fmt is None else system_name("naive", 1, fmt)  # the same weights recomputed
        for length, s in by_length.items():
            base = summary.get(naive, {}).get(length, {}).get("tokens_per_s")
            speedup = f"{s['tokens_per_s'] / base:.1f}x" if base else "-"
            extra = [f"{s['tbt_over_streaming']:.2f}x"] if stream else []
            extra += [f"{s['vs_transformers']:.2f}x"] if has_hf else []
            rows.append(
                [
                    mode,
                    str(length),
                    f"{s['ttft_ms']:.1f}",
                    f"{s['tbt_ms']:.2f}",
                    f"{s['tps']:.1f}",
                    f"{s['tokens_per_s']:.1f}",
                    f"{s['latency_s']:.2f}",
                    speedup,
                    *extra,
                ]
            )
    title = f"naive vs kv vs paged — prompt of {result['prompt_tokens']} tokens (medians)"
    parts = [FitTable(title, cols, rows, keys=2)]
    for fmt, kept in (result.get("formats") or {}).items():
        parts.append(Text(f"[{fmt}] weights: {kept}"))
    for fmt, st in (result.get("weight_streaming_by_format") or {}).items():
        parts.append(Text(f"[{fmt}] weight streaming: {st['decode_bytes'] / 1e6:.1f} MB per token = {st['ms']:.2f} ms"))
    if stream and not result.get("weight_streaming_by_format"):
        parts.append(
            Text(
                f"weight streaming: {stream['decode_bytes'] / 1e6:.0f} MB per token at {stream['read_GBps']:.1f} "
                f"GB/s (plain read of {stream['probe_buffer_MiB']:.0f} MiB) = {stream['ms']:.2f} ms per token"
            )
        )
    if any((result.get("overhead") or {}).values()):  # no traced decode step (outputs too short): no table
        parts.append(overhead_table(result["overhead"]))
    return Group(*parts)


def overhead_table(overhead: dict):
    """ms per decode step in each stage (traced), per cached mode."""
    from stagewise.trace.fit import Col, FitTable

    modes = [m for m, o in overhead.items() if o]
    totals: dict[str, float] = {}
    for mode in modes:
        for stage, ms in overhead[mode]["stages_ms"].items():
            totals[stage] = totals.get(stage, 0.0) + ms
    stages = sorted(totals, key=lambda stage: -totals[stage])
    rows = [[stage, *(f"{overhead[m]['stages_ms'].get(stage, 0.0):.2f}" for m in modes)] for stage in stages]
    for key, label in (("projections_ms", "= projections"), ("other_stages_ms", "= other stages")):
        rows.append([label, *(f"{overhead[m][key]:.2f}" for m in modes)])
    rows.append(["outside stages (engine, Python)", *(f"{overhead[m]['outside_stages_ms']:.2f}" for m in modes)])
    rows.append(["step (traced)", *(f"{overhead[m]['step_ms']:.2f}" for m in modes)])
    cols = [Col("stage", wrap=True, min_width=16), *(Col(m, "right") for m in modes)]
    return FitTable("one decode step, traced: ms per stage (projections stream the weights)", cols, rows)


def plot_modes(result: dict, path) -> None:
    """Two panels: time per token vs context (with fits), tokens/s per output length."""
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    curves = result["time_per_token"]
    series = {m: (c["context_len"], c["ms_per_token"]) for m, c in curves.items()}
    fits = {
        m: (curves[m]["context_len"], eval_fit(f, curves[m]["context_len"]), f["label"])
        for m, f in result["fits"].items()
    }
    plot_time_per_token(series, fits, ax=left)
    by_length = {
        length: {mode: result["summary"][mode][length]["tokens_per_s"] for mode in result["summary"]}
        for length in next(iter(result["summary"].values()))
    }
    plot_throughput(by_length, "output tokens/s", "tokens/s per output length (x: output tokens)", ax=right)
    fig.suptitle(f"{result['model']['name']} — {result['model']['backend']} stages, {result['model']['device']}")
    save_figure(fig, path)
