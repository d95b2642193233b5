"""`stagewise bench invariance`: what batch invariance costs, with and without it, side by side.

Two rows per weight format — `batch_invariant=True` (the default) and `False` (the torch tier's
batch-variant paths, `--no-batch-invariant`) — over the same loaded weights, in one process:

    decode tok/s        one stream, greedy, `decode_tokens` tokens after a 32-token prompt (1 / median TBT)
    TTFT ms @ N         one request of N prompt tokens (`ttft_prompts`, 128 and 512), its first token,
                        prefix cache off (every run prefills the whole prompt)
    continuous tok/s    `bench batching`'s workload run by continuous batching (output tokens/s), and
                        the requests whose tokens part between static and continuous batching
    n-gram speed-up     `bench spec`'s copy-heavy prompts, n-gram k = 4 over plain decoding (tokens/s),
                        and whether its greedy text is plain decoding's

Decode and TTFT runs alternate the two rows repeat by repeat (invariant, variant, variant,
invariant, ...), so a drift of the machine hits both alike; medians with their min-max spread.
The batching and speculative workloads run whole, one row after the other (their own repeats
alternate their own systems). Timing claims come from a quiet machine; `--quick` only proves the
benchmark runs.
"""

import statistics
from dataclasses import asdict, dataclass, replace

from stagewise.bench.commands.batching import QUICK as BATCHING_QUICK
from stagewise.bench.commands.batching import BatchingSettings, run_batching
from stagewise.bench.commands.modes import refuse_weightless
from stagewise.bench.commands.spec import SpecSettings, run_spec
from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.progress import row
from stagewise.bench.harness.timing import alternating
from stagewise.bench.harness.workloads import single_prompt
from stagewise.config import EngineConfig
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingParams

ROWS = {"invariant": True, "variant": False}  # row name -> LLM(batch_invariant=...)


@dataclass(frozen=True)
class InvarianceSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory
    formats: tuple[str, ...] = ("auto", "none")  # weights: packed GGUF blocks, float32
    repeats: int = 5  # alternated runs per row for decode and TTFT
    decode_tokens: int = 64  # greedy tokens of the single-stream decode run
    ttft_prompts: tuple[int, ...] = (128, 512)  # prompt lengths whose first token is timed
    batching: bool = True  # also run bench batching's workload per row
    num_requests: int = 32  # its requests (quick: 8)
    spec: bool = True  # also run bench spec's copy-heavy n-gram workload per row
    prompts_per_kind: int = 3  # its prompts (quick: 1)
    quick: bool = False  # smaller batching and spec workloads: a smoke run


def check_settings(s: InvarianceSettings) -> None:
    refuse_weightless(s.model, "cpu")
    for name, value in (("--repeats", s.repeats), ("--decode-tokens", s.decode_tokens)):
        if value < 1:
            raise StagewiseError(f"{name} must be >= 1, got {value}")
    for n in s.ttft_prompts:
        if n < 1:
            raise StagewiseError(f"--ttft-prompts must be >= 1 tokens each, got {n}")
    for f in s.formats:
        if f not in ("auto", "none"):
            raise StagewiseError(f"unknown weight format '{f}'; use auto or none")


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _single_stream(s: InvarianceSettings, loaded, progress) -> dict:
    """Decode tok/s and TTFT per row, alternating the rows repeat by repeat."""
    ecfg = EngineConfig(max_num_seqs=1, enable_prefix_caching=False)
    llms = {name: LLM(loaded, engine_config=ecfg, batch_invariant=bi) for name, bi in ROWS.items()}
    prompts = {n: single_prompt(loaded.tokenizer, n, seed=n) for n in (32, *s.ttft_prompts)}
    decode = SamplingParams(max_tokens=s.decode_tokens, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    for llm in llms.values():  # warm-up: every shape once
        llm.generate(prompts[32], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    samples = {name: {"decode": [], **{f"ttft_{n}": [] for n in s.ttft_prompts}} for name in ROWS}
    with row(progress, "decode and TTFT, rows alternating", total=s.repeats * len(ROWS)) as bar:
        for _, name in alternating(list(ROWS), s.repeats):
            out = llms[name].generate(prompts[32], decode)[0]
            samples[name]["decode"].append(out.metrics.tps)  # 1 / mean TBT
            for n in s.ttft_prompts:
                samples[name][f"ttft_{n}"].append(1000 * llms[name].generate(prompts[n], first)[0].metrics.ttft)
            bar.advance()
    return {name: {key: _spread(values) for key, values in metrics.items()} for name, metrics in samples.items()}


def _batching(s: InvarianceSettings, fmt: str, loaded, progress) -> dict:
    out = {}
    for name, bi in ROWS.items():
        settings = BatchingSettings(model=s.model, quantization=fmt, on_mismatch="record", batch_invariant=bi)
        if s.quick:
            settings = replace(settings, **BATCHING_QUICK)
        else:
            settings = replace(settings, num_requests=s.num_requests)
        result = run_batching(settings, loaded=loaded, progress=progress)
        out[name] = {
            "continuous_tok_per_s": result["summary"]["continuous"]["output_tok_per_s"],
            "static_tok_per_s": result["summary"]["static"]["output_tok_per_s"],
            "mismatched_requests": len({m.split(":")[0] for m in result.get("mismatches", [])}),
            "requests": result["workload"]["num_requests"],
        }
    return out


def _spec(s: InvarianceSettings, fmt: str, progress) -> dict:
    out = {}
    for name, bi in ROWS.items():
        changes = dict(formats=(fmt,), methods=("ngram",), kinds=("copy",), batch_invariant=bi)
        if s.quick:
            changes.update(max_tokens=8, repeats=1, step_repeats=2, step_context=32, prompts_per_kind=1)
        else:
            changes.update(prompts_per_kind=s.prompts_per_kind)
        result = run_spec(SpecSettings(model=s.model, **changes), progress=progress)
        cell = result["summary"][fmt]["copy"]
        out[name] = {"ngram_speedup": cell["ngram"]["speedup"], "ngram_identical": cell["ngram"]["identical"]}
    return out


def run_invariance(s: InvarianceSettings, progress=None) -> dict:
    check_settings(s)
    per_format = {}
    for fmt in s.formats:
        loaded = load_model(s.model, "cpu", None, quantization=fmt)
        cell = {"single_stream": _single_stream(s, loaded, progress)}
        if s.batching:
            cell["batching"] = _batching(s, fmt, loaded, progress)
        if s.spec:
            cell["spec"] = _spec(s, fmt, progress)
        per_format[fmt] = cell
    notes = ["invariant: batch_invariant=True (the default); variant: --no-batch-invariant's paths"]
    if s.quick:
        notes.append("--quick: a smoke run of the benchmark, not a measurement")
    return {
        "benchmark": "invariance",
        "machine": machine_info(),
        "settings": asdict(s),
        "results": per_format,
        "notes": notes,
    }


def table_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """Columns and one row per (format, invariant / variant), then the cost (invariant over variant)."""
    s = result["settings"]
    heads = ["weights", "row", "decode tok/s", *(f"TTFT ms @{n}" for n in s["ttft_prompts"])]
    heads += ["continuous tok/s", "static/continuous mismatches"] * bool(s["batching"])
    heads += ["n-gram speed-up", "n-gram = plain"] * bool(s["spec"])
    rows = []
    for fmt, cell in result["results"].items():
        for name in ROWS:
            single = cell["single_stream"][name]
            line = [fmt, name, _fmt(single["decode"], "{:.1f}")]
            line += [_fmt(single[f"ttft_{n}"], "{:.1f}") for n in s["ttft_prompts"]]
            if "batching" in cell:
                b = cell["batching"][name]
                line += [f"{b['continuous_tok_per_s']:.1f}", f"{b['mismatched_requests']} of {b['requests']}"]
            if "spec" in cell:
                sp = cell["spec"][name]
                line += [f"{sp['ngram_speedup']:.2f}x", "yes" if sp["ngram_identical"] else "no"]
            rows.append(line)
        inv, var = cell["single_stream"]["invariant"], cell["single_stream"]["variant"]
        cost = [fmt, "invariant / variant", f"{inv['decode']['median'] / var['decode']['median']:.2f}x"]
        cost += [f"{inv[f'ttft_{n}']['median'] / var[f'ttft_{n}']['median']:.2f}x" for n in s["ttft_prompts"]]
        if "batching" in cell:
            b = cell["batching"]
            cost += [f"{b['invariant']['continuous_tok_per_s'] / b['variant']['continuous_tok_per_s']:.2f}x", ""]
        if "spec" in cell:
            cost += ["", ""]
        rows.append(cost)
    return heads, rows


def _fmt(spread: dict, pattern: str) -> str:
    lo, hi = pattern.format(spread["min"]), pattern.format(spread["max"])
    return f"{pattern.format(spread['median'])} ({lo}-{hi})"


def invariance_table(result: dict):
    from stagewise.trace.fit import Col, FitTable

    heads, rows = table_rows(result)
    cols = [Col(h, "right" if i > 1 else "left") for i, h in enumerate(heads)]
    return FitTable("batch invariance: on and off (medians, min-max over the repeats)", cols, rows, keys=2)


def plot_invariance(result: dict, path) -> None:
    """Bars: each metric of the invariant row relative to the variant row (1 = the same speed)."""
    import matplotlib.pyplot as plt

    from stagewise.bench.harness.plots import save_figure

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (fmt, cell) in enumerate(result["results"].items()):
        inv, var = cell["single_stream"]["invariant"], cell["single_stream"]["variant"]
        labels = ["decode tok/s"] + [f"1 / TTFT @{k.split('_')[1]}" for k in inv if k.startswith("ttft_")]
        ratios = [inv["decode"]["median"] / var["decode"]["median"]]
        ratios += [var[k]["median"] / inv[k]["median"] for k in inv if k.startswith("ttft_")]
        if "batching" in cell:
            b = cell["batching"]
            labels.append("continuous tok/s")
            ratios.append(b["invariant"]["continuous_tok_per_s"] / b["variant"]["continuous_tok_per_s"])
        xs = [j + 0.4 * i for j in range(len(labels))]
        ax.bar(xs, ratios, width=0.38, label=f"weights {fmt}")
        ax.set_xticks([j + 0.2 for j in range(len(labels))], labels)
    ax.axhline(1.0, color="grey", lw=1)
    ax.set_ylabel("invariant ÷ variant speed (1 = free)")
    ax.set_title("what batch invariance costs")
    ax.legend()
    save_figure(fig, path)
