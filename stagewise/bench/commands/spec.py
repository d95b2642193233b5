"""`stagewise bench spec`: speculative decoding against plain decoding, batch 1, per weight format.

A decode step streams every weight to produce one token; while that is the
bottleneck (memory-bound), a step over k + 1 query tokens costs little more
than a step over one. Speculative decoding cashes that in: a proposer guesses
k tokens, one verify step of k + 1 rows checks them, and the longest correct
prefix plus one token of the target's own is kept. How much it gains is

    tokens per step = (1 - a^(k+1)) / (1 - a)      (a: the chance each guess is kept)

divided by what a verify step costs against a plain one. This benchmark
measures both sides on real chat prompts to SmolLM2:

- copy-heavy prompts (quote a passage, summarise it, edit a code snippet):
  the answer repeats text from the prompt, so the n-gram proposer's lookups
  hit often;
- free prose (a story, an explanation): little to copy, lookups rarely hit,
  and speculation should cost next to nothing.

Each prompt runs without speculation, with the n-gram proposer and with a
draft model (a truncated-layer copy of the target written to a temporary
GGUF: its first and last layers, the same tokenizer; for a preset without a
file the draft is the preset itself), in every weight format asked for
(`quantization` "auto": the GGUF's packed 4-bit weights; "none": float32).
Greedy decoding throughout: speculation must not change the text, and every
run's token ids are compared with plain decoding's (the table says which
differ and where; a speed over a different text is flagged, not compared as
the same work). In float32 they must agree; the packed format's torch tier
computes in bfloat16 with results that depend on how many rows a step has,
so a verify step can round a near-tie differently. Per format it also times one
verify step of k + 1 rows against a plain decode step of one row, at the
same context length (`spec_steps.py`).
"""

import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from stagewise.bench.commands.modes import refuse_weightless, run_notes
from stagewise.bench.commands.spec_steps import step_cost, write_truncated_gguf
from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.progress import row
from stagewise.bench.harness.timing import alternating
from stagewise.config import PRESETS, EngineConfig
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingParams

PASSAGE = (
    "The lighthouse on Gull Rock was built in 1874 from granite quarried on the mainland. "
    "For ninety years a keeper climbed its hundred and twelve steps every evening to light "
    "the lamp, wind the clockwork that turned the lens, and write the weather in a logbook. "
    "In 1964 the light was automated, the keeper's cottage was closed, and the logbooks were "
    "sent to the county archive, where they are still read by historians of the coast."
)
CODE = """def average_price(items):
    total = 0
    count = 0
    for item in items:
        if item.price is not None:
            total += item.price
            count += 1
    if count == 0:
        return 0.0
    return total / count"""
WORKLOADS = {  # kind -> (name, chat prompt)
    "copy": (
        ("quote", f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"),
        ("summarise", f"Summarise this passage, keeping its own wording:\n\n{PASSAGE}"),
        (
            "edit code",
            "Rename the variable `total` to `running_sum` in this Python function and show "
            f"the whole function:\n\n```python\n{CODE}\n```",
        ),
    ),
    "prose": (
        ("story", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
        ("explain", "Explain to a ten-year-old why the sky is blue."),
    ),
}
METHODS = ("ngram", "draft")  # proposers compared with plain decoding ("none")
FORMATS = ("auto", "none")  # LLM(quantization=...): packed GGUF weights, or float32


@dataclass(frozen=True)
class SpecSettings:
    model: str = "smollm2-135m"  # preset, .gguf or Hugging Face directory
    backend: str = "torch"  # the tier of every stage
    formats: tuple[str, ...] = FORMATS  # weight formats to measure ("auto", "none")
    methods: tuple[str, ...] = METHODS  # proposers ("ngram", "draft")
    num_speculative_tokens: int = 4  # k, the most guesses per step
    max_tokens: int = 128  # greedy tokens per prompt (the answer may end earlier)
    draft_layers: str = "0-7,22-29"  # layers the truncated draft keeps (of the target's)
    repeats: int = 2  # timed runs per (prompt, system), alternating the systems
    step_repeats: int = 20  # timed forward passes per step shape in the verify-cost measurement
    step_context: int = 256  # tokens already in the cache when the step costs are measured
    kinds: tuple[str, ...] = ("copy", "prose")  # workloads
    prompts_per_kind: int = 3  # the first n prompts of each workload
    batch_invariant: bool = True  # False: the torch tier's batch-variant paths (--no-batch-invariant)


def check_settings(s: SpecSettings) -> None:
    for f in s.formats:
        if f not in FORMATS:
            raise StagewiseError(f"unknown weight format '{f}'; use auto or none")
    for m in s.methods:
        if m not in METHODS:
            raise StagewiseError(f"unknown speculation method '{m}'; use ngram or draft")
    for k in s.kinds:
        if k not in WORKLOADS:
            raise StagewiseError(f"unknown workload '{k}'; use copy or prose")
    numbers = ("num_speculative_tokens", "max_tokens", "repeats", "step_repeats", "step_context")
    for name in (*numbers, "prompts_per_kind"):
        if getattr(s, name) < 1:
            raise StagewiseError(f"{name} must be >= 1, got {getattr(s, name)}")
    parse_layers(s.draft_layers)


def parse_layers(text: str) -> list[int]:
    """'0-2,27-29' -> [0, 1, 2, 27, 28, 29]."""
    out: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            out += range(int(low), int(high or low) + 1)
    except ValueError:
        raise StagewiseError(f"--draft-layers must look like 0-7,22-29, got '{text}'") from None
    if not out or sorted(set(out)) != out or out[0] < 0:
        raise StagewiseError(f"--draft-layers must be increasing layer numbers, got '{text}'")
    return out


def gguf_source(model: str) -> Path | None:
    """The GGUF file behind a model name, if there is one (the truncated draft is cut from it)."""
    if model == "smollm2-135m":
        from stagewise.models.files import smollm2_gguf_path

        return Path(smollm2_gguf_path())
    path = Path(model)
    return path if path.suffix == ".gguf" and path.is_file() else None


def draft_model(settings: SpecSettings, folder: Path, num_layers: int) -> tuple[str, str]:
    """(model argument of the draft, what it is in words)."""
    source = gguf_source(settings.model)
    if source is None:
        return settings.model, f"the target itself ({settings.model}: no GGUF to cut layers from)"
    keep = parse_layers(settings.draft_layers)
    if keep[-1] >= num_layers:
        raise StagewiseError(f"--draft-layers names layer {keep[-1]}, the model has {num_layers}")
    path = folder / "draft.gguf"
    write_truncated_gguf(source, path, keep)
    return str(path), f"{len(keep)} of the target's {num_layers} layers ({settings.draft_layers})"


def run_spec(settings: SpecSettings, progress=None) -> dict:
    """Every format x prompt x system; returns the result dict (settings, runs, summary, steps)."""
    check_settings(settings)
    refuse_weightless(settings.model, "cpu")
    k = settings.num_speculative_tokens
    prompts = [
        (kind, name, text) for kind in settings.kinds for name, text in WORKLOADS[kind][: settings.prompts_per_kind]
    ]
    systems = ["none", *settings.methods]
    runs, steps, notes, drafts = [], {}, [], {}
    with tempfile.TemporaryDirectory(prefix="stagewise-spec-") as tmp:
        for fmt in settings.formats:
            with row(progress, f"loading {settings.model} (quantization={fmt})", total=1) as bar:
                loaded = load_model(settings.model, "cpu", None, quantization=fmt)
                bar.advance()
            num_layers = loaded.config.num_layers
            if "draft" in settings.methods and "model" not in drafts:
                with row(progress, "writing the truncated draft", total=1) as bar:
                    drafts["model"], drafts["what"] = draft_model(settings, Path(tmp), num_layers)
                    bar.advance()
            ecfg = EngineConfig(max_num_seqs=1, max_model_len=1024)
            bi = settings.batch_invariant
            llms = {"none": LLM(loaded, backend=settings.backend, engine_config=ecfg, batch_invariant=bi)}
            for method in settings.methods:
                spec = {"method": "ngram" if method == "ngram" else "draft_model"}
                spec["num_speculative_tokens"] = k
                if method == "draft":
                    spec.update(model=drafts["model"], draft_quantization=fmt)
                llms[method] = LLM(
                    loaded, backend=settings.backend, engine_config=ecfg, speculative_config=spec, batch_invariant=bi
                )
            notes += [f"quantization={fmt}: " + n for n in run_notes(settings.backend, loaded, batch_invariant=bi)]
            runs += _measure(settings, fmt, prompts, llms, systems, progress)
            with row(progress, f"verify step vs decode step ({fmt})", total=1) as bar:
                steps[fmt] = step_cost(loaded, settings.backend, settings.step_context, k, settings.step_repeats)
                bar.advance()
            describe = llms["none"].describe()
            for llm in llms.values():
                llm.shutdown()
    result = {
        "benchmark": "spec",
        "machine": machine_info(),
        "settings": asdict(settings),
        "model": {key: describe[key] for key in ("name", "num_layers", "hidden_size", "vocab_size")},
        "draft": drafts.get("what"),
        "prompts": {name: text for _, name, text in prompts},
        "outputs_identical": all(r["identical"] for r in runs),
        "notes": sorted(set(notes)) + identity_notes(runs),
        "runs": runs,
        "verify_step": steps,
    }
    result["summary"] = summarize(runs, settings)
    return result


def _measure(settings, fmt, prompts, llms, systems, progress) -> list[dict]:
    params = SamplingParams(max_tokens=settings.max_tokens, temperature=0)
    with row(progress, f"warm-up ({fmt})", total=len(llms)) as bar:
        for llm in llms.values():
            llm.generate(prompts[0][2], SamplingParams(max_tokens=8, temperature=0), chat=True)
            bar.advance()
    runs = []
    total = len(prompts) * len(systems) * settings.repeats
    with row(progress, f"prompts ({fmt})", total=total) as bar:
        for kind, name, text in prompts:
            reference = None
            for rep, system in alternating(systems, settings.repeats):
                bar.update(f"{fmt}: {name}, {system}, run {rep + 1}")
                out = llms[system].generate(text, params, chat=True)[0]
                if reference is None:
                    reference = out.token_ids  # "none" runs first: plain greedy decoding
                differs_at = first_difference(reference, out.token_ids)
                m = out.metrics
                n = len(out.token_ids)
                decode_s = m.finish_time - m.first_token_time
                runs.append(
                    {
                        "format": fmt,
                        "kind": kind,
                        "prompt": name,
                        "system": system,
                        "repeat": rep,
                        "output_tokens": n,
                        "latency_s": m.latency,
                        "tokens_per_s": n / m.latency,  # TTFT (the prefill) included
                        "decode_s": decode_s,  # first token -> last token
                        "draft_tokens": m.num_draft_tokens,
                        "accepted_tokens": m.num_accepted_tokens,
                        "spec_steps": m.num_spec_steps,
                        "text": out.text if rep == 0 else None,
                        "identical": differs_at is None,  # the same token ids as plain decoding
                        "first_difference": differs_at,  # output token where they part, or None
                    }
                )
                bar.advance()
    return runs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where two token lists differ (None: identical)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def identity_notes(runs: list[dict]) -> list[str]:
    """One line per (format, prompt, system) whose greedy text differs from plain decoding."""
    notes = []
    for r in runs:
        if not r["identical"] and r["repeat"] == 0:
            notes.append(
                f"{r['format']} {r['prompt']}: '{r['system']}' parts from plain greedy decoding at "
                f"output token {r['first_difference']}"
                + (
                    " (the packed weights' torch tier computes in bfloat16 and its results depend "
                    "on the number of rows: a verify step of k + 1 rows rounds differently from a "
                    "decode step of one)"
                    if r["format"] == "auto"
                    else ""
                )
            )
    return notes


def summarize(runs: list[dict], settings: SpecSettings) -> dict:
    """Per format, kind and system: median tokens/s, acceptance, tokens per verify step, speed-up."""
    out: dict = {}
    for fmt in settings.formats:
        for kind in settings.kinds:
            cell = out.setdefault(fmt, {}).setdefault(kind, {})
            for system in ["none", *settings.methods]:
                rs = [r for r in runs if (r["format"], r["kind"], r["system"]) == (fmt, kind, system)]
                first = [r for r in rs if r["repeat"] == 0]
                drafted = sum(r["draft_tokens"] for r in first)
                kept = sum(r["accepted_tokens"] for r in first)
                spec_steps = sum(r["spec_steps"] for r in first)
                # the kind's throughput: all its tokens over all its time (per repeat, then median)
                per_rep = [
                    sum(r["output_tokens"] for r in rs if r["repeat"] == i)
                    / sum(r["latency_s"] for r in rs if r["repeat"] == i)
                    for i in range(settings.repeats)
                ]
                decode_rep = [  # after the first token: the decode steps only (the prefill is shared)
                    sum(r["output_tokens"] - 1 for r in rs if r["repeat"] == i)
                    / sum(r["decode_s"] for r in rs if r["repeat"] == i)
                    for i in range(settings.repeats)
                ]
                cell[system] = {
                    "identical": all(r["identical"] for r in rs),  # every prompt's text as plain
                    "tokens_per_s": statistics.median(per_rep),
                    "decode_tokens_per_s": statistics.median(decode_rep),
                    "acceptance_rate": kept / drafted if drafted else None,
                    "mean_accepted_per_step": kept / spec_steps if spec_steps else None,
                    "draft_tokens": drafted,
                }
            base, base_decode = (cell["none"][key] for key in ("tokens_per_s", "decode_tokens_per_s"))
            for stats in cell.values():
                stats["speedup"] = stats["tokens_per_s"] / base
                stats["decode_speedup"] = stats["decode_tokens_per_s"] / base_decode
    return out


def quick_settings(model: str, **changes) -> SpecSettings:
    """A smoke run: one format, one prompt per workload, short answers, one repeat."""
    formats = ("none",) if model in PRESETS and model != "smollm2-135m" else ("auto",)
    quick = dict(formats=formats, max_tokens=8, repeats=1, step_repeats=2, step_context=32)
    return SpecSettings(model=model, **(quick | {"prompts_per_kind": 1} | changes))
