"""`stagewise bench batching`: static vs continuous batching (and transformers) on a mixed workload.

The seeds' chapter 7: batching shares one read of the weights among many
requests, but *static* batching starts a batch together and ends it together.
With mixed lengths every prompt is padded to the batch's longest, every short
request keeps its row busy until the batch's longest output is done, and the
next batch waits for all of it. *Continuous* batching (the paged engine)
schedules per step: a finished request frees its KV blocks and a waiting one
joins in the next step, and nothing is padded.

Systems, all on the same seeded workload (greedy, `ignore_eos`, a
`max_tokens` per request, so every system makes exactly the same tokens):

- static:       stagewise mode "kv", left-padded batches of `max_num_seqs`
- continuous:   stagewise mode "paged", at most `max_num_seqs` running (or `continuous_max_num_seqs`)
- transformers: (`--compare transformers`) HF `generate`, padded batches of the same size

stagewise's weights are the file's own by default (`quantization="auto"`: a GGUF's packed
4/8-bit blocks); `--quantization none` dequantizes them to float32. transformers always
dequantizes the GGUF to float32.

Static and continuous must produce identical tokens for every request
(checked before anything is reported). Per system: useful output tokens/s,
requests/s, total (prompt + output) tokens/s, TTFT / TBT / latency p50 and
p99, padding tokens, KV memory over time, preemptions, prefix-cache hits.
Every request arrives at t=0 (when the run starts), so TTFT includes queueing.
"""

import statistics
from dataclasses import asdict, dataclass

import torch

from stagewise.bench.commands.modes import check_fits_positions, check_identical, refuse_weightless, run_notes
from stagewise.bench.harness.hf_baseline import HFBaseline, hf_model_location, static_padding
from stagewise.bench.harness.machine import busy_note, machine_info
from stagewise.bench.harness.plots import (
    plot_kv_over_time,
    plot_latency_percentiles,
    plot_tbt_over_time,
    plot_throughput,
    save_figure,
)
from stagewise.bench.harness.progress import row
from stagewise.bench.harness.timing import StreamedRequest, alternating, stream_timed
from stagewise.bench.harness.workloads import BenchRequest, Workload, mixed_workload
from stagewise.config import EngineConfig
from stagewise.engine.llm import LLM
from stagewise.engine.outputs import percentile
from stagewise.errors import StagewiseError
from stagewise.kv.paged import kv_bytes_per_token
from stagewise.models.quantized import check_quantization, weight_formats
from stagewise.models.registry import LoadedModel, load_model
from stagewise.tuning.cpu_load import LoadProbe

SYSTEMS = {"static": "kv", "continuous": "paged"}  # stagewise system -> LLM mode
COMPARE = ("transformers",)


@dataclass(frozen=True)
class BatchingSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory
    backend: str = "torch"  # the tier of every stage: naive, torch or triton
    device: str | None = None  # cpu / cuda; None = cuda when available
    dtype: str | None = None  # float32 / bfloat16; None = the loader's default for the device
    num_requests: int = 32  # requests in the workload
    prompt_tokens: tuple[int, int] = (16, 512)  # prompt length range (uniform)
    output_tokens: tuple[int, int] = (16, 256)  # max_tokens range (uniform)
    max_num_seqs: int = 8  # static batch size = most requests running at once (continuous)
    continuous_max_num_seqs: int | None = None  # seats of the continuous engine; None = max_num_seqs
    max_num_batched_tokens: int = 512  # token budget of one continuous-batching step
    prefill_beside_decodes: int | None = None  # prompt tokens per step while others decode; None: device default
    repeats: int = 1  # timed runs per system, alternating the systems
    seed: int = 0  # workload seed
    compare: tuple[str, ...] = ()  # extra systems: "transformers"
    on_mismatch: str = "raise"  # different tokens between systems: "raise", or "record" them and time on
    quantization: str = "auto"  # stagewise's weights: "auto" keeps a GGUF's packed blocks, "none" floats
    batch_invariant: bool = True  # False: the torch tier's batch-variant paths (--no-batch-invariant)


QUICK = {"num_requests": 8, "prompt_tokens": (16, 64), "output_tokens": (8, 32), "max_num_seqs": 4}


def summarize_run(requests: list[StreamedRequest], workload: Workload) -> dict:
    """Throughput and latency percentiles of one run (useful tokens only; all requests arrive at once)."""
    metrics = [r.metrics() for r in requests]
    arrival = min(m.arrival_time for m in metrics)
    wall_s = max(m.finish_time for m in metrics) - arrival
    out_tokens = sum(len(r.token_ids) for r in requests)
    prompt_tokens = sum(r.prompt_tokens for r in workload.requests)
    tbt_ms = [1000 * g for m in metrics for g in m.tbt]
    ttft_ms = [1000 * m.ttft for m in metrics]
    latency_ms = [1000 * m.latency for m in metrics]
    return {
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / wall_s,
        "requests_per_s": len(requests) / wall_s,
        "total_tok_per_s": (prompt_tokens + out_tokens) / wall_s,
        "ttft_ms_p50": percentile(ttft_ms, 50),
        "ttft_ms_p99": percentile(ttft_ms, 99),
        "tbt_ms_p50": percentile(tbt_ms, 50),
        "tbt_ms_p99": percentile(tbt_ms, 99),
        "tbt_p99_over_p50": percentile(tbt_ms, 99) / percentile(tbt_ms, 50) if tbt_ms else None,
        "latency_ms_p50": percentile(latency_ms, 50),
        "latency_ms_p99": percentile(latency_ms, 99),
    }


def request_rows(requests: list[StreamedRequest], workload: Workload) -> list[dict]:
    """Raw per-request metrics (the JSON's `runs[*].requests`); token times in s since the requests arrived."""
    rows = []
    start = min(r.arrival_time for r in requests)
    for i, (r, w) in enumerate(zip(requests, workload.requests)):
        m = r.metrics()
        rows.append(
            {
                "index": i,
                "prompt_tokens": w.prompt_tokens,
                "max_tokens": w.max_tokens,
                "output_tokens": len(r.token_ids),
                "ttft_ms": 1000 * m.ttft,
                "latency_ms": 1000 * m.latency,
                "tokens_per_s": m.tokens_per_s,
                "tbt_ms": [round(1000 * g, 3) for g in m.tbt],
                "token_times_s": [round(t - start, 6) for t in r.token_times],
            }
        )
    return rows


def static_reserved_timeline(workload: Workload, requests, batch_size: int, bytes_per_token: int):
    """Static batching reserves P_max + max(max_tokens) slots per row for each batch, for its whole life."""
    arrival = requests[0].arrival_time
    times, sizes, start = [], [], 0.0
    for first in range(0, len(workload.requests), batch_size):
        batch = workload.requests[first : first + batch_size]
        capacity = max(r.prompt_tokens for r in batch) + max(r.max_tokens for r in batch)
        times.append(start)
        sizes.append(len(batch) * capacity * bytes_per_token)
        start = max(r.token_times[-1] for r in requests[first : first + batch_size]) - arrival
    return times + [start], sizes + [0]


def _run_stagewise(system, loaded, settings, ecfg, workload, on_done) -> dict:
    if SYSTEMS[system] == "kv":  # static batches are always `max_num_seqs` wide
        ecfg = ecfg.with_updates(max_num_seqs=settings.max_num_seqs)
    llm = LLM(  # a cold prefix cache
        loaded,
        backend=settings.backend,
        mode=SYSTEMS[system],
        engine_config=ecfg,
        batch_invariant=settings.batch_invariant,
    )
    samples: list[tuple[float, int]] = []  # (time, blocks in use) per paged step

    def on_event(event, now):
        if llm.engine is not None:
            blocks = llm.engine.stats.blocks_in_use
            samples.extend((now, b) for b in blocks[len(samples) :])  # steps done since the last token
        if event.finished:
            on_done()

    requests = stream_timed(llm, workload.prompts(), workload.params(), on_event)
    stats = llm.last_stats
    per_token = kv_bytes_per_token(loaded.config, loaded.dtype)
    arrival = requests[0].arrival_time
    if llm.engine is not None:
        block_bytes = ecfg.block_size * per_token
        times = [0.0] + [t - arrival for t, _ in samples]
        used = [0] + [b * block_bytes for _, b in samples]
        kv_peak = max(used)
    else:
        times, used = static_reserved_timeline(workload, requests, settings.max_num_seqs, per_token)
        kv_peak = stats.kv_cache_bytes
    extra = {
        "padding_tokens": stats.padding_tokens,
        "tokens_computed": stats.tokens_computed,
        "steps": stats.steps,
        "preemptions": stats.preemptions,
        "prefix_hit_rate": stats.prefix_hit_rate,
        "kv_allocated_bytes": stats.kv_cache_bytes,
        "kv_peak_bytes": kv_peak,
    }
    return {"requests": requests, "extra": extra, "kv": {"time_s": times, "bytes": used}}


def _run_transformers(hf: HFBaseline, loaded, settings, workload, on_done) -> dict:
    tok = loaded.tokenizer
    pad = tok.pad_id if tok.pad_id is not None else 0
    ids = [tok.encode(r.prompt, backend="fast") for r in workload.requests]  # the ids stagewise computes
    run = hf.run(ids, [r.max_tokens for r in workload.requests], settings.max_num_seqs, pad, on_done)
    extra = {
        "padding_tokens": run.prompt_padding_tokens + run.output_padding_tokens,
        "prompt_padding_tokens": run.prompt_padding_tokens,
        "output_padding_tokens": run.output_padding_tokens,
        "tokens_computed": run.tokens_computed,
        "kv_peak_bytes": run.kv_peak_bytes,
    }
    return {"requests": run.requests, "extra": extra, "kv": {"time_s": run.kv_times_s, "bytes": run.kv_bytes}}


def check_settings(settings: BatchingSettings) -> None:
    """Every setting in range, before anything is loaded."""
    refuse_weightless(settings.model, settings.device)
    check_quantization(settings.quantization)
    if settings.on_mismatch not in ("raise", "record"):
        raise StagewiseError(f"--on-mismatch must be raise or record, got '{settings.on_mismatch}'")
    for name in settings.compare:
        if name not in COMPARE:
            raise StagewiseError(f"unknown --compare '{name}'; use {', '.join(COMPARE)}")
    counts = {
        "num_requests": settings.num_requests,
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "repeats": settings.repeats,
    }
    if settings.continuous_max_num_seqs is not None:
        counts["continuous_max_num_seqs"] = settings.continuous_max_num_seqs
    if settings.prefill_beside_decodes is not None:
        counts["prefill_beside_decodes"] = settings.prefill_beside_decodes
    for name, value in counts.items():
        if value < 1:
            raise StagewiseError(f"{name} must be >= 1, got {value}")
    if "transformers" in settings.compare:
        hf_model_location(settings.model)  # fail before loading anything


def run_batching(settings: BatchingSettings, loaded: LoadedModel | None = None, progress=None) -> dict:
    """Run every system `repeats` times (alternating); returns the result dict."""
    check_settings(settings)
    dtype = getattr(torch, settings.dtype) if settings.dtype else None
    loaded = loaded or load_model(settings.model, settings.device, dtype, quantization=settings.quantization)
    refuse_weightless(settings.model, settings.device, loaded)
    hf = HFBaseline(settings.model, loaded.device, loaded.dtype) if "transformers" in settings.compare else None
    workload = mixed_workload(
        loaded.tokenizer, settings.num_requests, settings.prompt_tokens, settings.output_tokens, settings.seed
    )
    longest = max(workload.requests, key=lambda r: r.prompt_tokens + r.max_tokens)
    what = f"the longest request ({longest.prompt_tokens} prompt + {longest.max_tokens} output tokens)"
    check_fits_positions(loaded, workload.max_seq_len(), what)
    ecfg = EngineConfig(
        max_num_seqs=settings.continuous_max_num_seqs or settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefill_beside_decodes=settings.prefill_beside_decodes,
        max_model_len=workload.max_seq_len(),
    )
    systems = list(SYSTEMS) + list(settings.compare)
    warm = Workload("warmup", 0, tuple(BenchRequest(r.prompt, r.prompt_tokens, 2) for r in workload.requests[:2]))
    with row(progress, "warm-up (untimed)", total=len(systems)) as bar:
        for name in systems:  # untimed: allocator, threads, caches; a throwaway engine, no prefix cached
            if name == "transformers":
                _run_transformers(hf, loaded, settings, warm, lambda n=1: None)
            else:
                _run_stagewise(name, loaded, settings, ecfg, warm, lambda n=1: None)
            bar.advance()

    total = len(workload.requests) * len(systems) * settings.repeats
    task = progress.add_task("batching", total=total) if progress is not None else None
    runs, reference, mismatches = [], None, ([] if settings.on_mismatch == "record" else None)
    with LoadProbe() as probe:  # how much of the CPU other processes take while we time
        for rep, name in alternating(systems, settings.repeats):
            if progress is not None:
                progress.update(task, description=f"{name:>12}, run {rep + 1}/{settings.repeats}")
            on_done = (lambda n=1: progress.advance(task, n)) if progress is not None else (lambda n=1: None)
            if name == "transformers":
                out = _run_transformers(hf, loaded, settings, workload, on_done)
            else:
                out = _run_stagewise(name, loaded, settings, ecfg, workload, on_done)
                tokens = [r.token_ids for r in out["requests"]]
                reference = reference or (name, tokens)
                for i, (a, b) in enumerate(zip(reference[1], tokens)):
                    check_identical({reference[0]: a, f"{name} (run {rep + 1})": b}, f"request {i}", mismatches)
            summary = summarize_run(out["requests"], workload) | out["extra"]
            runs.append(
                {
                    "system": name,
                    "repeat": rep,
                    "summary": summary,
                    "kv": out["kv"],
                    "requests": request_rows(out["requests"], workload),
                    "token_ids": [r.token_ids for r in out["requests"]],
                }
            )
    result = _result(settings, loaded, ecfg, workload, runs, reference, hf)
    result["cpu_others_share"] = probe.others  # the CPU share other processes used during the timed runs
    busy = busy_note(probe.others, "the batching runs")
    if busy:
        result["notes"].append(busy)
    if mismatches:
        result.update(outputs_identical=False, mismatches=mismatches)
        parted = len({m.split(":")[0] for m in mismatches})
        result["notes"].append(
            f"{parted} of {len(workload.requests)} requests' greedy tokens part between the stagewise systems "
            "(first differences in the JSON's mismatches); every run still makes each request's max_tokens tokens"
        )
    return result


def _result(settings, loaded, ecfg, workload, runs, reference, hf) -> dict:
    summary = {}
    for name in dict.fromkeys(r["system"] for r in runs):
        mine = [r["summary"] for r in runs if r["system"] == name]
        summary[name] = {k: statistics.median(s[k] for s in mine) for k in mine[0]}
    expected = static_padding(
        [r.prompt_tokens for r in workload.requests], [r.max_tokens for r in workload.requests], settings.max_num_seqs
    )
    result = {
        "benchmark": "batching",
        "machine": machine_info(),
        "settings": asdict(settings),
        "model": LLM(loaded, backend=settings.backend, mode="kv", batch_invariant=settings.batch_invariant).describe()
        | {"mode": None},
        "engine_config": {k: v for k, v in asdict(ecfg).items() if k != "extra"},
        "workload": workload.describe(),
        "outputs_identical": True,
        "notes": run_notes(settings.backend, loaded, batch_invariant=settings.batch_invariant),
        "weight_formats": weight_formats(loaded.weights),  # e.g. "q4_1 x 120, q8_0 x 1, float32 x 61"
        "static_padding_expected": expected,
        "summary": summary,
        "runs": runs,
    }
    if hf is not None:
        hf_runs = [r for r in runs if r["system"] == "transformers"]
        same = [a == b for a, b in zip(hf_runs[0]["token_ids"], reference[1])]
        result["transformers"] = hf.describe() | {"requests_identical_to_stagewise": f"{sum(same)}/{len(same)}"}
    for run in runs:
        del run["token_ids"]  # identical across systems (checked); the reference is kept once
    result["token_ids"] = reference[1]
    return result


TABLE_ROWS = (
    ("output tokens/s (useful)", "output_tok_per_s", "{:.1f}"),
    ("requests/s", "requests_per_s", "{:.3f}"),
    ("total tokens/s (prompt + output)", "total_tok_per_s", "{:.1f}"),
    ("TTFT p50 / p99 (ms)", ("ttft_ms_p50", "ttft_ms_p99"), "{:.0f}"),
    ("TBT p50 / p99 (ms)", ("tbt_ms_p50", "tbt_ms_p99"), "{:.1f}"),
    ("TBT p99 ÷ p50", "tbt_p99_over_p50", "{:.2f}x"),
    ("latency p50 / p99 (ms)", ("latency_ms_p50", "latency_ms_p99"), "{:.0f}"),
    ("padding tokens computed", "padding_tokens", "{:.0f}"),
    ("rows computed (tokens)", "tokens_computed", "{:.0f}"),
    ("KV peak (MiB)", "kv_peak_bytes", "MiB"),
    ("KV allocated (MiB)", "kv_allocated_bytes", "MiB"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("prefix-cache hit rate", "prefix_hit_rate", "{:.1%}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
)


def _cell(summary: dict, key, fmt: str) -> str:
    keys = key if isinstance(key, tuple) else (key,)
    if any(summary.get(k) is None for k in keys):
        return "-"
    if fmt == "MiB":
        return " / ".join(f"{summary[k] / 2**20:.1f}" for k in keys)
    return " / ".join(fmt.format(summary[k]) for k in keys)


def batching_table(result: dict):
    """One column per system, medians over repeats, and continuous's speed-up (FitTable: split, never cut)."""
    from stagewise.trace.fit import Col, FitTable

    w = result["workload"]
    title = (
        f"static vs continuous batching — {w['num_requests']} requests, static batch "
        f"{result['settings']['max_num_seqs']}, continuous seats "
        f"{result['settings'].get('continuous_max_num_seqs') or result['settings']['max_num_seqs']}, "
        f"{w['total_output_tokens']} output tokens, stagewise weights "
        f"{result['settings'].get('quantization', 'none')}"
    )
    summary = result["summary"]
    cols = [Col("metric", wrap=True, min_width=18), *(Col(name, "right") for name in summary)]
    rows = [[label, *[_cell(s, key, fmt) for s in summary.values()]] for label, key, fmt in TABLE_ROWS]
    cont = summary["continuous"]["output_tok_per_s"]
    rows.append(
        ["continuous ÷ this (output tok/s)", *[f"{cont / s['output_tok_per_s']:.2f}x" for s in summary.values()]]
    )
    return FitTable(title, cols, rows)


def tbt_timeline(run: dict) -> tuple[list[float], list[float]]:
    """(arrival time of a token, gap to the request's previous token) for every gap of one run."""
    times, gaps = [], []
    for req in run["requests"]:
        times += req["token_times_s"][1:]
        gaps += req["tbt_ms"]
    return times, gaps


def plot_batching(result: dict, path) -> None:
    """Four panels: throughput per system, TTFT/TBT/latency percentiles, KV memory and TBT over time."""
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, ((a, b), (c, d)) = plt.subplots(2, 2, figsize=(15, 10))
    plot_throughput(
        {
            "output tok/s (useful)": {n: s["output_tok_per_s"] for n, s in summary.items()},
            "total tok/s (prompt + output)": {n: s["total_tok_per_s"] for n, s in summary.items()},
        },
        "tokens/s",
        "throughput (useful tokens only)",
        ax=a,
    )
    pct = {
        n: {m.upper(): {"p50": s[f"{m}_ms_p50"], "p99": s[f"{m}_ms_p99"]} for m in ("ttft", "tbt", "latency")}
        for n, s in summary.items()
    }
    plot_latency_percentiles(pct, ax=b)
    first = {}
    for run in result["runs"]:
        first.setdefault(run["system"], run["kv"])
    alloc = {"continuous": summary["continuous"]["kv_allocated_bytes"]}
    plot_kv_over_time({n: (kv["time_s"], kv["bytes"]) for n, kv in first.items()}, alloc, ax=c)
    first_runs = {}
    for run in result["runs"]:
        first_runs.setdefault(run["system"], run)
    plot_tbt_over_time({n: tbt_timeline(run) for n, run in first_runs.items()}, ax=d)
    fig.suptitle(f"{result['model']['name']} — {result['model']['backend']} stages, {result['model']['device']}")
    save_figure(fig, path)
