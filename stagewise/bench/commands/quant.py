"""`stagewise bench quant`: single-stream decode of one GGUF in every weight format, and llama.cpp.

    stagewise bench quant [--model smollm2-135m] [--threads 2] [--max-tokens 64] [--repeats 3]

Decode is memory-bound: a step reads every weight once, so its time follows the bytes per weight.
The same prompts, greedy, batch 1, at the process's thread count, through:

- float32: the file dequantized at load (`quantization="none"`), 4 bytes per weight;
- packed: the GGUF's 4- and 8-bit blocks kept (`quantization="auto"`), the torch tier's
  int4 CPU kernels (stages/dequant_gemm_torch.py), ~0.6 bytes per weight;
- transformers: `generate` on the same file (which it dequantizes to float32);
- llama.cpp: the same file, the same thread count (scripts/llamacpp_decode.mjs through Node and
  the `node-llama-cpp` package, when `--llamacpp` points at its node_modules; else skipped).

Runs alternate between the systems (round after round, prompt after prompt) so a change of load
on a shared machine hits all of them alike; the median decode tokens/s (tokens after the first,
over the time after the first) is reported per system. Greedy agreement: for every prompt, how
many tokens each system shares with the float32 run before the first difference. Memory: the
anonymous resident memory (RssAnon) added by loading each format and building its kernels'
forms, beside the bytes of the weight tensors and the file's tensor bytes.
"""

import json
import os
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from stagewise.bench.harness.agreement import agreement
from stagewise.bench.harness.machine import machine_info
from stagewise.engine.llm import LLM
from stagewise.errors import StagewiseError
from stagewise.models.registry import load_model
from stagewise.sampling_params import SamplingParams

PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
)
DRIVER = Path(__file__).resolve().parents[3] / "scripts" / "llamacpp_decode.mjs"


@dataclass(frozen=True)
class QuantSettings:
    model: str = "smollm2-135m"  # preset or .gguf file (a quantized GGUF: packed needs one)
    max_tokens: int = 64  # greedy tokens per prompt
    repeats: int = 3  # rounds over every prompt and system
    prompts: int = 3  # the first N of PROMPTS
    systems: tuple[str, ...] = ("float32", "packed", "transformers", "llama.cpp")  # SYSTEMS
    llamacpp: str | None = None  # node_modules holding node-llama-cpp (None: llama.cpp skipped)


def rss_anon() -> int:
    """Anonymous resident bytes of this process (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def gguf_path(model: str) -> Path:
    if model == "smollm2-135m":
        from stagewise.models.files import smollm2_gguf_path

        return smollm2_gguf_path()
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise StagewiseError(f"bench quant needs a .gguf file (or smollm2-135m), not '{model}'")
    return path


def file_tensor_bytes(path: Path) -> int:
    from stagewise.models.gguf_loader import open_gguf

    return int(sum(t.n_bytes for t in open_gguf(path).tensors))


class Stagewise:
    """One weight format of the file in stagewise (mode kv, torch tier)."""

    def __init__(self, model: str, quantization: str):
        before = rss_anon()
        loaded = load_model(model, device="cpu", quantization=quantization)
        self.llm = LLM(loaded, backend="torch", mode="kv")
        self.llm.generate(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0))  # forms built
        self.added_rss = rss_anon() - before
        self.weight_bytes = loaded.weights.num_bytes()
        self.prepared_bytes = loaded.weights.prepared_bytes()
        self.held_bytes = loaded.weights.held_bytes()  # each code once: released where a form holds it
        self.formats = self.llm.describe().get("weights")

    def decode(self, prompt: str, tokens: int) -> tuple[float, list[int]]:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        out = self.llm.generate(prompt, params)[0]
        m = out.metrics
        return (len(out.token_ids) - 1) / (m.finish_time - m.first_token_time), out.token_ids


class Transformers:
    def __init__(self, model: str, tokenizer):
        from stagewise.bench.harness.hf_baseline import HFBaseline

        before = rss_anon()
        self.hf = HFBaseline(model, torch.device("cpu"), torch.float32)
        self.added_rss = rss_anon() - before
        self.tokenizer = tokenizer

    def decode(self, prompt: str, tokens: int) -> tuple[float, list[int]]:
        run = self.hf.run([self.tokenizer.encode(prompt)], [tokens], 1, pad_id=0)
        req = run.requests[0]
        times = req.token_times
        return (len(times) - 1) / (times[-1] - times[0]), req.token_ids


class LlamaCpp:
    """llama.cpp through the Node driver: one process per call (its load is not timed)."""

    def __init__(self, path: Path, node_modules: str, threads: int):
        if shutil.which("node") is None or not (Path(node_modules) / "node-llama-cpp").is_dir():
            raise StagewiseError(f"llama.cpp: needs node and {node_modules}/node-llama-cpp")
        self.path, self.node_modules, self.threads = path, node_modules, threads

    def run_json(self, prompt: str, tokens: int, repeats: int = 1, context: int = 1024) -> dict:
        """The driver's JSON line: decode_tok_s and ttft_ms per run, token_ids, prompt_tokens."""
        cmd = ["node", str(DRIVER), str(self.path), str(self.threads), str(tokens), prompt, str(repeats)]
        env = dict(os.environ, NODE_PATH=self.node_modules)
        done = subprocess.run([*cmd, str(context)], capture_output=True, text=True, env=env, timeout=1800)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            raise StagewiseError(f"llama.cpp driver failed: {done.stderr.strip()[-300:]}")
        return json.loads(lines[-1])

    def decode(self, prompt: str, tokens: int) -> tuple[float, list[int]]:
        r = self.run_json(prompt, tokens)
        return r["decode_tok_s"][0], r["token_ids"]


SYSTEMS = ("float32", "packed", "transformers", "llama.cpp")


def check_settings(settings: QuantSettings) -> None:
    unknown = [s for s in settings.systems if s not in SYSTEMS]
    if unknown:
        raise StagewiseError(f"unknown system '{unknown[0]}'; use some of {', '.join(SYSTEMS)}")
    if not {"float32", "packed"} & set(settings.systems):
        raise StagewiseError("bench quant compares stagewise's formats: name float32 or packed")


def run_quant(settings: QuantSettings, progress=print) -> dict:
    check_settings(settings)
    path = gguf_path(settings.model)
    threads = torch.get_num_threads()
    load_start = os.getloadavg()
    systems: dict = {}
    memory: dict = {"file_tensor_bytes": file_tensor_bytes(path)}
    for name, quantization in (("packed", "auto"), ("float32", "none")):
        if name in settings.systems:
            s = systems[name] = Stagewise(settings.model, quantization)
            memory[name] = {
                "added_rss_anon_bytes": s.added_rss,
                "weight_tensor_bytes": s.weight_bytes,
                "kernel_form_bytes": s.prepared_bytes,
                "held_bytes": s.held_bytes,
                "weights": s.formats,
            }
    tokenizer = next(iter(systems.values())).llm.tokenizer if systems else None
    notes = []
    if "transformers" in settings.systems:
        systems["transformers"] = Transformers(settings.model, tokenizer)
        memory["transformers"] = {"added_rss_anon_bytes": systems["transformers"].added_rss}
    if "llama.cpp" in settings.systems:
        if settings.llamacpp:
            systems["llama.cpp"] = LlamaCpp(path, settings.llamacpp, threads)
        else:
            notes.append("llama.cpp skipped: pass --llamacpp DIR (node_modules with node-llama-cpp)")
    prompts = list(PROMPTS[: settings.prompts])
    speeds = {name: [] for name in systems}
    tokens: dict = {name: {} for name in systems}
    for round_ in range(settings.repeats):
        for p, prompt in enumerate(prompts):
            for name, system in systems.items():
                tok_s, ids = system.decode(prompt, settings.max_tokens)
                speeds[name].append(tok_s)
                tokens[name][p] = ids
                progress(f"round {round_ + 1} prompt {p + 1} {name}: {tok_s:.1f} tok/s")
    median = {name: statistics.median(v) for name, v in speeds.items()}
    ref = "float32" if "float32" in tokens else next(iter(tokens))
    agree = {
        name: [agreement(tokens[name][p], tokens[ref][p]) for p in range(len(prompts))]
        for name in tokens
        if name != ref
    }
    ratios = {}
    if "packed" in median:
        for other in median:
            if other != "packed":
                ratios[f"packed_over_{other}"] = median["packed"] / median[other]
    return {
        "benchmark": "quant",
        "machine": machine_info(),
        "threads": threads,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "file": str(path),
        "prompts": prompts,
        "decode_tok_s_median": median,
        "decode_tok_s_runs": speeds,
        "ratios": ratios,
        "greedy_agreement_with": ref,
        "greedy_agreement": agree,
        "token_ids": tokens,
        "memory": memory,
        "notes": notes,
    }


def quant_table(r: dict) -> str:
    mb = 1e6
    n = len(next(iter(r["token_ids"].values()))[0]) if r["token_ids"] else 0
    lines = [
        f"decode, batch 1, {r['threads']} thread(s), median of {len(r['prompts'])} prompts x repeats "
        f"(load average {r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f})"
    ]
    for name, v in r["decode_tok_s_median"].items():
        agree = r["greedy_agreement"].get(name)
        same = f"  greedy vs {r['greedy_agreement_with']}: {agree} of {n}" if agree is not None else ""
        lines.append(f"  {name:13s} {v:6.1f} tok/s{same}")
    for key, v in r["ratios"].items():
        lines.append(f"  {key.replace('_', ' ')}: {v:.2f}x")
    mem = r["memory"]
    file_bytes = mem["file_tensor_bytes"]
    lines.append(f"  file tensors {file_bytes / mb:.1f} MB")
    for name in ("packed", "float32", "transformers"):
        if name in mem:
            m = mem[name]
            held = m.get("weight_tensor_bytes")
            extra = (
                f", weights {held / mb:.1f} MB + kernel forms {m['kernel_form_bytes'] / mb:.1f} MB"
                + (f", held {m['held_bytes'] / mb:.1f} MB" if "held_bytes" in m else "")
                if held is not None
                else ""
            )
            lines.append(
                f"  {name:13s} loading added {m['added_rss_anon_bytes'] / mb:.1f} MB anonymous "
                f"({m['added_rss_anon_bytes'] / file_bytes:.2f}x the file){extra}"
            )
    return "\n".join(lines)


def plot_quant(r: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from stagewise.bench.harness.plots import save_figure

    names = list(r["decode_tok_s_median"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, name in enumerate(names):
        ax.bar(i, r["decode_tok_s_median"][name], color=f"C{i}")
        ax.scatter([i] * len(r["decode_tok_s_runs"][name]), r["decode_tok_s_runs"][name], color="k", s=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"{Path(r['file']).name}, {r['threads']} thread(s)", fontsize=9)
    save_figure(fig, path)
