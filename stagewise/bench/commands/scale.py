"""`stagewise bench scale`: decode speed and time to first token from a 135M model to an 8B-class one.

    stagewise bench scale [--models smollm2-135m,llama-3.2-1b,llama-3-8b] [--prompt-tokens 16,128,512,2048]
        [--threads 1,2] [--systems packed,packed-int8,float32,transformers,llama.cpp] [--llamacpp DIR] [--quick]

A small model's lead can vanish where a user outgrows it: this runs the same measurement at every
scale, side by side, in one process (llama.cpp in a child process), on one machine:

- models: SmolLM2-135M (the shipped Q4_1/Q8_0 GGUF), and random Q4_0 files with Llama-3.2-1B's and
  Llama-3-8B's shapes and SmolLM2's tokenizer (`bench/harness/random_gguf.py`, written once into the
  cache folder; any .gguf path works too);
- systems: stagewise with the file's blocks kept packed, two ways: `packed` (the torch tier with
  PyTorch's int4 kernel, bfloat16 activations: the default) and `packed-int8` (the integer-dot
  kernel, `cpu/int8_dot.py`: activations rounded to int8 per block of 32, llama.cpp's arithmetic;
  what STAGEWISE_CPU_KERNELS=1 turns on, where a C++ compiler is at hand), stagewise dequantized
  to float32, transformers on the same file (float32), llama.cpp on the same
  file (`scripts/llamacpp_decode.mjs` through node-llama-cpp, with `--llamacpp`); a system that is
  not installed, or whose float32 weights do not fit in the memory available, gets its row with
  the reason instead of numbers;
- for each thread count and prompt length (text cut to that many tokens): time to first token
  (TTFT: the prompt's prefill and the first sample) and decode tokens/s (tokens after the first
  over the time after the first), `--repeats` rounds alternating the systems, medians. stagewise
  runs without its prefix cache, so every round prefills the whole prompt, as llama.cpp's fresh
  sequence and transformers do.

The load average before and after, and the share of the CPU other processes used during the run
(`tuning/cpu_load.py`), are recorded; a run where others used more than a quarter of the machine is
flagged as busy: its numbers measured the contention.
"""

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stagewise.bench.commands.quant import LlamaCpp, gguf_path
from stagewise.bench.harness.english_text import TEXT
from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.random_gguf import SHAPES, random_gguf
from stagewise.config import EngineConfig
from stagewise.cpu import build
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingParams
from stagewise.tuning.cpu_load import LoadProbe

SYSTEMS = ("packed", "packed-int8", "float32", "transformers", "llama.cpp")
PACKED = ("packed", "packed-int8")  # the rows the ratios are taken for


@dataclass(frozen=True)
class ScaleSettings:
    models: tuple[str, ...] = ("smollm2-135m", "llama-3.2-1b", "llama-3-8b")  # presets or .gguf files
    prompt_tokens: tuple[int, ...] = (16, 128, 512, 2048)  # prompt lengths
    threads: tuple[int, ...] = (1, 2)  # torch threads (llama.cpp: the same count)
    systems: tuple[str, ...] = SYSTEMS
    decode_tokens: int = 32  # greedy tokens generated per run
    repeats: int = 3  # rounds over the systems, alternated
    layers: int | None = None  # random files: this many layers instead of the shape's (quick runs)
    llamacpp: str | None = None  # node_modules holding node-llama-cpp (None: llama.cpp skipped)


def check_models(models: tuple[str, ...]) -> None:
    """Every name a preset or an existing .gguf file, before any file is written."""
    for model in models:
        path = Path(model).expanduser()
        if model not in SHAPES and model != "smollm2-135m" and not (path.suffix == ".gguf" and path.is_file()):
            known = ", ".join(["smollm2-135m", *SHAPES])
            raise StagewiseError(f"bench scale: unknown model '{model}'; use {known} or a .gguf file")


def model_file(model: str, layers: int | None) -> Path:
    """The GGUF of a model name: the shipped SmolLM2, a random file at a Llama shape, or a path."""
    if model in SHAPES:
        return random_gguf(model, layers)
    return gguf_path(model)


def model_label(model: str, layers: int | None) -> str:
    """The name a result row carries: a random file with fewer layers says so."""
    return f"{model} ({layers} layers)" if model in SHAPES and layers is not None else model


def memory_available() -> int:
    """MemAvailable from /proc/meminfo (bytes), or a large number where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def float32_bytes(path: Path) -> int:
    from stagewise.models.gguf_loader import open_gguf

    return 4 * int(sum(int(t.n_elements) for t in open_gguf(path).tensors))


def prompt_text(tokenizer, tokens: int) -> str:
    """The fixed English text, repeated as needed, cut to `tokens` tokens (as text)."""
    ids: list[int] = []
    while len(ids) < tokens:
        ids += tokenizer.encode(TEXT + "\n\n")
    return tokenizer.decode(ids[:tokens])


class Stagewise:
    """stagewise on one file; `int8_dot`: the integer-dot kernel on or off for its load and runs
    (None: as the environment says, for float32 where no packed GEMM runs)."""

    def __init__(self, path: Path, quantization: str, int8_dot: bool | None = None):
        self.int8_dot = int8_dot
        with build.switched(int8_dot):
            loaded = load_model(str(path), device="cpu", quantization=quantization)
            # no prefix cache: every repeat prefills the whole prompt (a hit would time a lookup)
            self.llm = LLM(loaded, backend="torch", engine_config=EngineConfig(enable_prefix_caching=False))
        self.tokenizer = self.llm.tokenizer

    def run(self, prompt: str, tokens: int, threads: int) -> tuple[float, float, int]:
        torch.set_num_threads(threads)
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        with build.switched(self.int8_dot):
            out = self.llm.generate(prompt, params)[0]
        m = out.metrics
        decode = (len(out.token_ids) - 1) / (m.finish_time - m.first_token_time)
        return m.ttft, decode, len(out.prompt_token_ids)


class Transformers:
    def __init__(self, path: Path, tokenizer):
        from stagewise.bench.harness.hf_baseline import HFBaseline

        self.hf, self.tokenizer = HFBaseline(str(path), torch.device("cpu"), torch.float32), tokenizer

    def run(self, prompt: str, tokens: int, threads: int) -> tuple[float, float, int]:
        torch.set_num_threads(threads)
        ids = self.tokenizer.encode(prompt)
        start = time.perf_counter()
        times = self.hf.run([ids], [tokens], 1, pad_id=0).requests[0].token_times
        return times[0] - start, (len(times) - 1) / (times[-1] - times[0]), len(ids)


class LlamaCppSystem:
    def __init__(self, path: Path, node_modules: str, context: int):
        self.driver = LlamaCpp(path, node_modules, threads=1)
        self.context = context

    def run(self, prompt: str, tokens: int, threads: int) -> tuple[float, float, int]:
        self.driver.threads = threads
        r = self.driver.run_json(prompt, tokens, repeats=1, context=self.context)
        return r["ttft_ms"][0] / 1e3, r["decode_tok_s"][0], r["prompt_tokens"]


def int8_dot_builds() -> bool:
    with build.switched(True):
        return build.library() is not None


def build_systems(model: str, path: Path, s: ScaleSettings, skipped: list, say) -> dict:
    """The systems of one model, loaded once; those that cannot run get a row in `skipped`."""
    systems: dict = {}
    need = float32_bytes(path) * 1.15 + 2**30  # the float32 weights, and room to work
    for name in s.systems:
        why = None
        if name in ("float32", "transformers") and need > memory_available():
            why = f"float32 weights need {need / 1e9:.1f} GB, {memory_available() / 1e9:.1f} GB available"
        elif name == "llama.cpp" and not s.llamacpp:
            why = "not installed: pass --llamacpp DIR (node_modules with node-llama-cpp)"
        elif name == "packed-int8" and not int8_dot_builds():
            with build.switched(True):
                why = f"the integer-dot kernel cannot run here ({build.describe()})"
        if why is None:
            say(f"{model}: loading {name}")
            try:
                if name == "float32":
                    systems[name] = Stagewise(path, "none")
                elif name in PACKED:
                    systems[name] = Stagewise(path, "auto", int8_dot=name == "packed-int8")
                elif name == "transformers":
                    systems[name] = Transformers(path, load_model(str(path), device="meta").tokenizer)
                else:
                    systems[name] = LlamaCppSystem(path, s.llamacpp, max(s.prompt_tokens) + s.decode_tokens + 64)
            except (StagewiseError, ImportError, OSError, ValueError) as exc:
                why = f"could not load: {str(exc).splitlines()[0][:200]}"
        if why is not None:
            skipped.append({"model": model, "system": name, "reason": why})
            say(f"{model}: {name} skipped ({why})")
    for name, system in systems.items():  # first calls build what later ones reuse: not measured
        if name != "llama.cpp":  # (the driver warms itself up)
            system.run("Hello", 2, s.threads[0])
    return systems


def measure(model: str, path: Path, systems: dict, prompt: str, threads: int, n: int, s: ScaleSettings, say) -> list:
    """Every system on one prompt at one thread count, `s.repeats` rounds alternated: one row each."""
    got: dict = {name: [] for name in systems}
    for _ in range(s.repeats):
        for name, system in systems.items():
            got[name].append(system.run(prompt, s.decode_tokens, threads))
    rows = []
    for name, runs in got.items():
        ttft, decode = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        say(f"{model} {threads}t {n} tokens {name}: TTFT {1e3 * ttft:.0f} ms, decode {decode:.1f} tok/s")
        rows.append(
            {
                "model": model,
                "file": str(path),
                "threads": threads,
                "prompt_tokens": n,
                "prompt_tokens_seen": runs[-1][2],
                "system": name,
                "ttft_ms": [1e3 * r[0] for r in runs],
                "decode_tok_s": [r[1] for r in runs],
                "ttft_ms_median": 1e3 * ttft,
                "decode_tok_s_median": decode,
            }
        )
    return rows


def run_scale(s: ScaleSettings, progress=None) -> dict:
    unknown = [name for name in s.systems if name not in SYSTEMS]
    if unknown:
        raise StagewiseError(f"unknown system '{unknown[0]}'; use some of {', '.join(SYSTEMS)}")
    check_models(s.models)
    say = progress or (lambda line: None)
    paths = [model_file(m, s.layers) for m in s.models]  # written first: file writing is not measured
    labels = [model_label(m, s.layers) for m in s.models]
    load_start, runs, skipped = os.getloadavg(), [], []
    before = torch.get_num_threads()
    probe = LoadProbe(own=lambda: time.process_time() + sum(os.times()[2:4]))  # llama.cpp is ours too
    try:
        with probe:
            for model, path in zip(labels, paths):
                systems = build_systems(model, path, s, skipped, say)
                tokenizer = next((sy.tokenizer for sy in systems.values() if hasattr(sy, "tokenizer")), None)
                tokenizer = tokenizer or load_model(str(path), device="meta").tokenizer
                for threads in s.threads:
                    for n in s.prompt_tokens:
                        runs += measure(model, path, systems, prompt_text(tokenizer, n), threads, n, s, say)
                del systems  # the next model's weights need the memory
    finally:
        torch.set_num_threads(before)
    with build.switched(True if "packed-int8" in s.systems else None):
        kernel = build.describe()  # where the compiled kernels packed-int8 ran are kept
    notes = []
    if probe.contended:
        notes.append(
            f"busy machine: other processes used {probe.others:.0%} of the CPU during the run; "
            "these numbers measured the contention, not the systems"
        )
    return {
        "benchmark": "scale",
        "machine": machine_info(),
        "kernel": kernel,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "others_cpu_share": probe.others,
        "busy": probe.contended,
        "runs": runs,
        "skipped": skipped,
        "ratios": ratios(runs),
        "notes": notes + [f"{skip['model']}: {skip['system']} not run ({skip['reason']})" for skip in skipped],
    }


def ratios(runs: list[dict]) -> list[dict]:
    """Each packed system over llama.cpp, transformers and float32: decode speed, and TTFT as
    other / packed (> 1: faster)."""
    by = {(r["model"], r["threads"], r["prompt_tokens"], r["system"]): r for r in runs}
    out = []
    for (model, threads, n, system), r in by.items():
        if system not in PACKED:
            continue
        for other in ("llama.cpp", "transformers", "float32"):
            o = by.get((model, threads, n, other))
            if o:
                out.append(
                    {
                        "model": model,
                        "threads": threads,
                        "prompt_tokens": n,
                        "system": system,
                        "over": other,
                        "decode": r["decode_tok_s_median"] / o["decode_tok_s_median"],
                        "ttft": o["ttft_ms_median"] / r["ttft_ms_median"],
                    }
                )
    return out


def scale_table(r: dict):
    from rich.table import Table

    busy = " (BUSY machine: contention measured)" if r["busy"] else ""
    title = (
        f"decode tok/s | TTFT ms, medians; load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}{busy}"
    )
    table = Table(title=title)
    systems = list(dict.fromkeys(run["system"] for run in r["runs"]))
    over = [f"{p} / llama.cpp" for p in PACKED if p in systems and "llama.cpp" in systems]
    for col in ("model", "threads", "prompt", *systems, *over):
        table.add_column(col, justify="left" if col == "model" else "right")
    rows: dict = {}
    for run in r["runs"]:
        key = (run["model"], run["threads"], run["prompt_tokens"])
        rows.setdefault(key, {})[run["system"]] = f"{run['decode_tok_s_median']:.1f} | {run['ttft_ms_median']:.0f}"
    for ratio in r["ratios"]:
        if ratio["over"] == "llama.cpp":
            key = (ratio["model"], ratio["threads"], ratio["prompt_tokens"])
            rows[key][f"{ratio['system']} / llama.cpp"] = f"{ratio['decode']:.2f}x | {ratio['ttft']:.2f}x"
    for (model, threads, n), cells in rows.items():
        table.add_row(model, str(threads), str(n), *(cells.get(c, "-") for c in (*systems, *over)))
    return table


def plot_scale(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stagewise.bench.harness.plots import save_figure

    threads = max(run["threads"] for run in r["runs"]) if r["runs"] else 1
    runs = [run for run in r["runs"] if run["threads"] == threads]
    models = list(dict.fromkeys(run["model"] for run in runs))
    systems = list(dict.fromkeys(run["system"] for run in runs))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(systems))
    for j, system in enumerate(systems):
        speeds = []
        for model in models:
            mine = [run["decode_tok_s_median"] for run in runs if run["model"] == model and run["system"] == system]
            speeds.append(statistics.median(mine) if mine else 0.0)
        left.bar([i + j * width for i in range(len(models))], speeds, width, label=system, color=f"C{j}")
        for i, model in enumerate(models):
            mine = [run for run in runs if run["model"] == model and run["system"] == system]
            right.plot(
                [run["prompt_tokens"] for run in mine],
                [run["ttft_ms_median"] for run in mine],
                marker="o",
                color=f"C{j}",
                linestyle=("-", "--", ":", "-.")[i % 4],
                label=f"{system}, {model}",
            )
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("decode tokens/s (median over prompt lengths)")
    left.legend(fontsize=7)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("prompt tokens")
    right.set_ylabel("time to first token (ms)")
    right.legend(fontsize=6)
    busy = ", BUSY machine" if r["busy"] else ""
    fig.suptitle(f"{threads} thread(s), load average {r['loadavg_start'][0]:.1f}{busy}", fontsize=10)
    save_figure(fig, path)
