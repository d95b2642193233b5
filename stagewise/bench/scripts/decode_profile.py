"""Where a decode step of a large model goes, against what the memory can deliver.

    python -m stagewise.bench.scripts.decode_profile [--shape llama-3-8b | --model FILE.gguf]
        [--layers N] [--threads 2] [--tokens 16] [--json decode_profile.json]

A decode token reads every weight once, so its floor is the weight bytes over the read bandwidth.
This script measures, in one process on one file (by default a random Q4_0 file with
Llama-3-8B's shapes and SmolLM2's tokenizer, `bench/harness/random_gguf.py`, written once into
the cache folder; `--layers` makes a smaller one with the same shapes):

1. the read bandwidth, two ways: a float32 `sum` of a buffer far larger than the last-level cache
   (one PyTorch reduction, what `bench modes` quotes), and the compiled probe (`cpu/int8_dot.py`):
   `--threads` threads each streaming its share with 32-byte loads, the way a decode step's
   projections read the packed weights (llama.cpp's way);
2. the projections alone: every layer's packed GEMMs and the LM head at one row, back to back,
   through the torch tier (the integer-dot kernel where built), and, for the first two layers
   and the head, the same with PyTorch's int4 kernel beside it (alternated, medians);
3. one decode step: tokens/s untraced, then a traced run split by stage (projections, attention,
   norms, RoPE, KV writes, sampling) and the time outside every stage (Python, metadata);
4. the verdict: the floor at each bandwidth, and how the step's time divides between streaming
   the weights, the rest of the stages and the host.

On a shared machine every number is indicative: the load average is recorded before and after.
"""

import argparse
import json
import os
import statistics
import time

import torch

from stagewise.bench.harness.decode_overhead import PROJECTIONS, plain_read_bandwidth, stage_breakdown
from stagewise.bench.harness.machine import machine_info
from stagewise.bench.harness.random_gguf import SHAPES, random_gguf
from stagewise.calc.hardware import last_level_cache_bytes
from stagewise.cpu import build, int8_dot
from stagewise.engine.llm import LLM
from stagewise.files import write_text_atomic
from stagewise.quant.packed_parts import packed_leaves
from stagewise.quant.packed_weight import PackedWeight, is_packed
from stagewise.sampling_params import SamplingParams
from stagewise.stages import dequant_gemm_torch


def projection_weights(weights) -> list:
    """(name, packed weight) of every projection in step order, then the LM head."""
    out = []
    for i, lw in enumerate(weights.layers):
        for name in ("w_qkv", "w_o", "w_gate_up", "w_down"):
            out.append((f"{i}.{name}", getattr(lw, name)))
    return out + [("lm_head", weights.lm_head)]


def gemm_pass(named: list, x_of: dict, gemm) -> float:
    """Seconds for one row through every weight of `named` in turn."""
    start = time.perf_counter()
    for _, w in named:
        gemm(x_of[w.shape[0]], w)
    return time.perf_counter() - start


def stock_copy(w: PackedWeight) -> PackedWeight:
    """A weight with PyTorch's int4pack form (what the torch tier builds without the compiled kernel)."""
    copies = []
    for leaf in packed_leaves(w):
        c = PackedWeight(leaf.kind, leaf.codes.clone(), leaf.scales, leaf.mins, leaf.group_size)
        if dequant_gemm_torch.form_name(c) == "rows8" and c.kind in ("q4_0", "q4_1", "q4_k"):
            c.prepared["torch"] = dequant_gemm_torch._int4pack(c)
        elif dequant_gemm_torch.form_name(c) == "rows8":
            c.prepared["torch"] = dequant_gemm_torch._q8_nibbles(c)
        copies.append(c)
    return copies[0] if len(copies) == 1 else type(w)(copies)


def projections(llm: LLM, repeats: int) -> dict:
    weights = llm.model.weights
    named = [(n, w) for n, w in projection_weights(weights) if is_packed(w)]
    x_of = {w.shape[0]: torch.randn(1, w.shape[0]) for _, w in named}
    tier = lambda x, w: dequant_gemm_torch.gemm(x, w)  # noqa: E731
    gemm_pass(named, x_of, tier)  # warm-up
    whole = [gemm_pass(named, x_of, tier) for _ in range(repeats)]
    nbytes = sum(w.nbytes for _, w in named)
    out = {
        "weights": len(named),
        "bytes": nbytes,
        "ms_median": 1e3 * statistics.median(whole),
        "GBps_median": nbytes / statistics.median(whole) / 1e9,
        "GBps_best": nbytes / min(whole) / 1e9,
    }
    sample = [(n, w) for n, w in named if n.split(".")[0] in ("0", "1", "lm_head")]
    stock = [(n, stock_copy(w)) for n, w in sample]
    a, b = [], []
    for _ in range(repeats):
        a.append(gemm_pass(sample, x_of, tier))
        b.append(gemm_pass(stock, x_of, tier))
    sample_bytes = sum(w.nbytes for _, w in sample)
    out["ab_sample"] = {
        "weights": [n for n, _ in sample],
        "bytes": sample_bytes,
        "torch_tier_ms": 1e3 * statistics.median(a),
        "int4pack_ms": 1e3 * statistics.median(b),
        "torch_tier_GBps": sample_bytes / statistics.median(a) / 1e9,
        "int4pack_GBps": sample_bytes / statistics.median(b) / 1e9,
    }
    return out


def decode_speed(llm: LLM, prompt: str, tokens: int, repeats: int) -> list[float]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    speeds = []
    for _ in range(repeats):
        m = llm.generate(prompt, params)[0].metrics
        speeds.append((tokens - 1) / (m.finish_time - m.first_token_time))
    return speeds


def run(model: str, threads: int, tokens: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    probe_bytes = max(2**30, 4 * last_level_cache_bytes())
    sum_bw = plain_read_bandwidth("cpu")["bytes_per_s"]
    stream_bw = int8_dot.stream_read_bandwidth(probe_bytes, threads)
    llm = LLM(model, backend="torch", mode="paged")
    decode_bytes = llm.model.weights.decode_bytes()
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    speeds = decode_speed(llm, prompt, tokens, repeats)
    params = SamplingParams(max_tokens=min(tokens, 8), temperature=0, ignore_eos=True)
    breakdown = stage_breakdown(llm, prompt, params)
    proj = projections(llm, repeats)
    step_ms = 1e3 / statistics.median(speeds)
    floors = {"sum": 1e3 * decode_bytes / sum_bw}
    if stream_bw:
        floors["stream"] = 1e3 * decode_bytes / stream_bw
    return {
        "benchmark": "decode_profile",
        "machine": machine_info(),
        "model": model,
        "threads": threads,
        "kernel": build.describe(),
        "weights": llm.describe().get("weights"),
        "loadavg_start": load_start,
        "decode_bytes": decode_bytes,
        "read_GBps": {"sum": sum_bw / 1e9, "stream": None if stream_bw is None else stream_bw / 1e9},
        "floor_ms": floors,
        "decode_tok_s": speeds,
        "step_ms_median": step_ms,
        "projections_alone": proj,
        "traced_step": breakdown,
        "loadavg_end": os.getloadavg(),
    }


def report(r: dict) -> str:
    bw, floors, proj, br = r["read_GBps"], r["floor_ms"], r["projections_alone"], r["traced_step"]
    lines = [
        f"{r['model']}: {r['weights']}, {r['threads']} thread(s), load average "
        f"{r['loadavg_start'][0]:.1f} -> {r['loadavg_end'][0]:.1f}; {r['kernel']}",
        f"read bandwidth: float32 sum {bw['sum']:.1f} GB/s, {r['threads']}-thread stream "
        + (f"{bw['stream']:.1f} GB/s" if bw["stream"] else "(no compiled probe)"),
        f"decode bytes per token {r['decode_bytes'] / 1e9:.3f} GB: floor "
        + ", ".join(f"{v:.1f} ms ({k})" for k, v in floors.items()),
        f"decode step {r['step_ms_median']:.1f} ms ({statistics.median(r['decode_tok_s']):.2f} tok/s)",
        f"projections alone, one row: {proj['ms_median']:.1f} ms ({proj['GBps_median']:.1f} GB/s of packed "
        f"bytes, best {proj['GBps_best']:.1f})",
    ]
    ab = proj["ab_sample"]
    lines.append(
        f"  layers 0-1 + head: torch tier {ab['torch_tier_ms']:.1f} ms ({ab['torch_tier_GBps']:.1f} GB/s), "
        f"int4pack {ab['int4pack_ms']:.1f} ms ({ab['int4pack_GBps']:.1f} GB/s)"
    )
    if br:
        lines.append(f"traced step {br['step_ms']:.1f} ms (tracing adds a little per stage):")
        for stage, ms in br["stages_ms"].items():
            kind = "weights" if stage in PROJECTIONS else "other"
            lines.append(f"  {stage:18s} {ms:8.2f} ms  {kind}")
        lines.append(f"  {'outside stages':18s} {br['outside_stages_ms']:8.2f} ms  host (Python, metadata)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3-8b", choices=sorted(SHAPES))
    ap.add_argument("--model", help="a .gguf file instead of the random one")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape has (a quick run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    model = args.model or str(random_gguf(args.shape, args.layers))
    r = run(model, args.threads, args.tokens, args.repeats)
    print(report(r))
    if args.json:
        write_text_atomic(args.json, json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
